#!/bin/bash
# Llama-3 8B pretraining on one 8-GPU node (TP=1, PP=1, distributed optimizer, bf16; FP8=1 for FP8 GEMMs).
# Usage: bash examples/llama/train_llama3_8b.sh <ckpt dir> <tensorboard dir> <HF tokenizer name or path> <data prefix>
# With data prefix "MOCK" it trains on mock data (no dataset needed).
set -euo pipefail
export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
CHECKPOINT_PATH=$1
TENSORBOARD_LOGS_PATH=$2
TOKENIZER_MODEL=$3
DATA_PATH=$4

MODEL_ARGS=(--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
            --group-query-attention --num-query-groups 8 --kv-channels 128 --seq-length 8192
            --max-position-embeddings 8192 --position-embedding-type rope --rotary-base 500000
            --normalization RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights
            --init-method-std 0.0134 --attention-dropout 0.0 --hidden-dropout 0.0)
TRAINING_ARGS=(--micro-batch-size 1 --global-batch-size 128 --train-iters 100000 --lr 3e-4 --min-lr 3e-5
               --lr-decay-style cosine --lr-warmup-iters 2000 --weight-decay 0.1 --adam-beta1 0.9
               --adam-beta2 0.95 --clip-grad 1.0 --bf16 --use-distributed-optimizer --overlap-grad-reduce
               --overlap-param-gather)
# FP8=1: FP8 GEMMs in the transformer layers (H100/H200; native Triton + torch._scaled_mm, Transformer Engine
# not needed), with the amax recipe of Megatron-LM's Llama-3 FP8 example.
if [ "${FP8:-0}" = "1" ]; then
    TRAINING_ARGS+=(--fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max
                    --transformer-impl local)
fi
if [ "$DATA_PATH" = "MOCK" ]; then
    DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 128255)
else
    DATA_ARGS=(--data-path "$DATA_PATH" --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL"
               --split 99,1,0)
fi
LOGGING_ARGS=(--log-interval 10 --log-throughput --save-interval 1000 --eval-interval 1000 --eval-iters 10
              --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --tensorboard-dir "$TENSORBOARD_LOGS_PATH")

cd "$(dirname "$0")/../.."
torchrun --nproc-per-node "$GPUS_PER_NODE" pretrain_gpt.py \
    "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${LOGGING_ARGS[@]}"
