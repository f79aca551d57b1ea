#!/bin/bash
# A tiny hybrid Mamba model (pattern M*M-: Mamba, attention, Mamba, MLP) on mock data that runs anywhere
# (CPU with gloo, or GPUs). Usage: bash examples/mamba/train_hybrid_tiny_cpu.sh [nproc (default 1)] [save dir]
# Set TP / PP in the environment to try model parallelism (TP must divide 2 groups; PP must divide 4 layers).
set -euo pipefail
export CUDA_DEVICE_MAX_CONNECTIONS=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

NPROC=${1:-1}
SAVE_DIR=${2:-}
TP=${TP:-1}
PP=${PP:-1}

MODEL_ARGS=(--num-layers 4 --hidden-size 64 --num-attention-heads 4 --hybrid-override-pattern "M*M-"
            --spec megatron.core.models.mamba.mamba_layer_specs mamba_stack_spec --is-hybrid-model
            --mamba-state-dim 16 --mamba-head-dim 16 --mamba-num-groups 2 --normalization RMSNorm
            --disable-bias-linear --position-embedding-type none --seq-length 128 --max-position-embeddings 128)
TRAINING_ARGS=(--micro-batch-size 4 --global-batch-size $((8 * NPROC / (TP * PP))) --train-iters 30 --lr 1e-3
               --lr-decay-style cosine --lr-warmup-iters 3 --min-lr 1e-4 --weight-decay 0.1 --clip-grad 1.0)
PARALLEL_ARGS=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
               --distributed-backend gloo --no-gradient-accumulation-fusion)
DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 4096)
LOGGING_ARGS=(--log-interval 5 --eval-interval 15 --eval-iters 2)
if [ -n "$SAVE_DIR" ]; then
    LOGGING_ARGS+=(--save "$SAVE_DIR" --load "$SAVE_DIR" --save-interval 15 --ckpt-format torch_dist)
fi

cd "$(dirname "$0")/../.."
torchrun --nproc-per-node "$NPROC" pretrain_mamba.py \
    "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" "${LOGGING_ARGS[@]}"
