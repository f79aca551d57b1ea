#!/bin/bash
# The Mixtral recipe at a tiny size: the same architecture and MoE flags (8 experts, top-2, aux loss, grouped GEMM,
# alltoall, RoPE base 1e6, GQA, RMSNorm, SwiGLU, no biases, untied output) on mock data; runs on CPU with gloo
# or on GPUs. With nproc 2 or 4 the experts are split over the ranks (--expert-model-parallel-size nproc).
# Usage: bash examples/mixtral/train_mixtral_tiny_cpu.sh [nproc (default 1)] [train iters (default 20)]
set -euo pipefail
export CUDA_DEVICE_MAX_CONNECTIONS=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

NPROC=${1:-1}
ITERS=${2:-20}
MODEL_ARGS=(--disable-bias-linear --seq-length 64 --max-position-embeddings 256 --num-layers 2 --hidden-size 64
            --ffn-hidden-size 128 --num-attention-heads 4 --init-method-std 0.01 --attention-dropout 0.0
            --hidden-dropout 0.0 --normalization RMSNorm --position-embedding-type rope --swiglu
            --untie-embeddings-and-output-weights --group-query-attention --num-query-groups 2
            --no-masked-softmax-fusion --no-position-embedding --rotary-base 1000000)
MOE_ARGS=(--num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
          --moe-grouped-gemm --moe-token-dispatcher-type alltoall --expert-model-parallel-size "$NPROC")
TRAINING_ARGS=(--micro-batch-size 2 --global-batch-size $((4 * NPROC)) --lr 1e-3 --train-iters "$ITERS"
               --lr-decay-style cosine --min-lr 1.0e-4 --weight-decay 0.1 --lr-warmup-iters 2 --clip-grad 1.0
               --use-distributed-optimizer)
DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 4095)

cd "$(dirname "$0")/../.."
torchrun --nproc-per-node "$NPROC" pretrain_gpt.py \
    "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" --log-interval 5 --eval-iters 0
