#!/bin/bash
# A tiny Llama-style model (RMSNorm, SwiGLU, RoPE, GQA, no biases, untied output, QK-layernorm) on mock
# data; runs on CPU with gloo or on GPUs. Usage: bash examples/llama/train_llama_tiny_cpu.sh [nproc (default 1)]
set -euo pipefail
export CUDA_DEVICE_MAX_CONNECTIONS=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

NPROC=${1:-1}
MODEL_ARGS=(--num-layers 2 --hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2
            --seq-length 128 --max-position-embeddings 128 --position-embedding-type rope --normalization RMSNorm
            --swiglu --disable-bias-linear --untie-embeddings-and-output-weights --qk-layernorm
            --attention-dropout 0.0 --hidden-dropout 0.0)
TRAINING_ARGS=(--micro-batch-size 4 --global-batch-size $((8 * NPROC)) --train-iters 50 --lr 1e-3
               --lr-decay-style cosine --lr-warmup-iters 5 --min-lr 1e-4 --weight-decay 0.1 --clip-grad 1.0)
DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 8191)

cd "$(dirname "$0")/../.."
torchrun --nproc-per-node "$NPROC" pretrain_gpt.py \
    "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" --log-interval 10 --eval-iters 0
