#!/bin/bash
# BERT-large ("340M": 24 layers, hidden 1024, 16 heads, seq 512): Megatron-LM's examples/bert recipe, same flags.
# Usage: bash examples/bert/train_bert_340m_distributed.sh CHECKPOINT_PATH TENSORBOARD_LOGS_PATH VOCAB_FILE DATA_PATH
#   VOCAB_FILE: a BERT vocab.txt (uncased: the default --tokenizer-type BertWordPieceLowerCase);
#   DATA_PATH: the prefix of a sentence-split corpus, e.g. my-bert_00_text_sentence, made by
#   tools/preprocess_data.py --split-sentences --tokenizer-type BertWordPieceLowerCase --vocab-file VOCAB_FILE.
# Megatron's parallel layout is TP 8 x PP 16 (128 GPUs), and 24 layers do not split into 16 stages (Megatron
# refuses that too): override with the environment, e.g. on one 8-GPU node
#   TP=1 PP=1 bash examples/bert/train_bert_340m_distributed.sh ...   (data parallel 8), or TP=2 PP=4, ...
set -euo pipefail
export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NUM_NODES=${NUM_NODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
TP=${TP:-8}
PP=${PP:-16}

CHECKPOINT_PATH=$1
TENSORBOARD_LOGS_PATH=$2
VOCAB_FILE=$3
DATA_PATH=$4

DISTRIBUTED_ARGS=(--nproc_per_node "$GPUS_PER_NODE" --nnodes "$NUM_NODES" --node_rank "$NODE_RANK"
                  --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")
BERT_MODEL_ARGS=(--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 512
                 --max-position-embeddings 512 --attention-backend auto)
TRAINING_ARGS=(--micro-batch-size 4 --global-batch-size 32 --train-iters 1000000 --weight-decay 1e-2 --clip-grad 1.0
               --fp16 --lr 0.0001 --lr-decay-iters 990000 --lr-decay-style linear --min-lr 1.0e-5
               --lr-warmup-fraction .01)
MODEL_PARALLEL_ARGS=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP")
DATA_ARGS=(--data-path "$DATA_PATH" --vocab-file "$VOCAB_FILE" --split 949,50,1)
EVAL_AND_LOGGING_ARGS=(--log-interval 100 --save-interval 10000 --eval-interval 1000 --save "$CHECKPOINT_PATH"
                       --load "$CHECKPOINT_PATH" --eval-iters 10 --tensorboard-dir "$TENSORBOARD_LOGS_PATH")

cd "$(dirname "$0")/../.."
torchrun "${DISTRIBUTED_ARGS[@]}" pretrain_bert.py \
    "${BERT_MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" \
    "${EVAL_AND_LOGGING_ARGS[@]}"
