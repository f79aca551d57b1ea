#!/bin/bash
# A tiny GPT on mock data that runs anywhere (CPU with gloo, or GPUs): the smoke test of a setup.
# Usage: bash examples/gpt3/train_gpt_tiny_cpu.sh [nproc (default 1)] [save dir (default: none)]
# With nproc 2 or 4 it adds data parallelism; set TP/PP in the environment to try model parallelism.
set -euo pipefail
export CUDA_DEVICE_MAX_CONNECTIONS=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

NPROC=${1:-1}
SAVE_DIR=${2:-}
TP=${TP:-1}
PP=${PP:-1}

MODEL_ARGS=(--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128)
TRAINING_ARGS=(--micro-batch-size 4 --global-batch-size $((8 * NPROC / (TP * PP))) --train-iters 50 --lr 1e-3
               --lr-decay-style cosine --lr-warmup-iters 5 --min-lr 1e-4 --weight-decay 0.1 --clip-grad 1.0)
PARALLEL_ARGS=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP")
DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 8191)
LOGGING_ARGS=(--log-interval 10 --eval-interval 25 --eval-iters 2)
if [ -n "$SAVE_DIR" ]; then
    LOGGING_ARGS+=(--save "$SAVE_DIR" --load "$SAVE_DIR" --save-interval 25 --ckpt-format torch)
fi

cd "$(dirname "$0")/../.."
torchrun --nproc-per-node "$NPROC" pretrain_gpt.py \
    "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" "${LOGGING_ARGS[@]}"
