#!/bin/bash
# GPT-3 175B on a cluster: 128 nodes x 8 GPUs (TP=8, PP=16), the recipe of Megatron-LM's examples/gpt3.
# Usage: bash examples/gpt3/train_gpt3_175b_distributed.sh <ckpt dir> <tensorboard dir> <vocab.json> <merges.txt> <data prefix>
# Run it on every node with NODE_RANK, MASTER_ADDR and NUM_NODES set (e.g. by your SLURM wrapper).
set -euo pipefail
export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
NUM_NODES=${NUM_NODES:-1}
NODE_RANK=${NODE_RANK:-0}

CHECKPOINT_PATH=$1
TENSORBOARD_LOGS_PATH=$2
VOCAB_FILE=$3
MERGE_FILE=$4
DATA_PATH=$5

DISTRIBUTED_ARGS=(--nproc-per-node "$GPUS_PER_NODE" --nnodes "$NUM_NODES" --node-rank "$NODE_RANK"
                  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT")
GPT_MODEL_ARGS=(--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048
                --max-position-embeddings 2048 --attention-backend auto)
TRAINING_ARGS=(--micro-batch-size 1 --global-batch-size 1536 --rampup-batch-size 16 16 5859375
               --train-iters 500000 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006
               --clip-grad 1.0 --fp16 --lr 6.0e-5 --lr-decay-style cosine --min-lr 6.0e-6
               --lr-warmup-fraction .001 --lr-decay-iters 430000)
MODEL_PARALLEL_ARGS=(--tensor-model-parallel-size 8 --pipeline-model-parallel-size 16)
DATA_ARGS=(--data-path "$DATA_PATH" --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE" --split 949,50,1)
EVAL_AND_LOGGING_ARGS=(--log-interval 100 --save-interval 10000 --eval-interval 1000 --save "$CHECKPOINT_PATH"
                       --load "$CHECKPOINT_PATH" --eval-iters 10 --tensorboard-dir "$TENSORBOARD_LOGS_PATH")

cd "$(dirname "$0")/../.."
torchrun "${DISTRIBUTED_ARGS[@]}" pretrain_gpt.py \
    "${GPT_MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" \
    "${EVAL_AND_LOGGING_ARGS[@]}"
