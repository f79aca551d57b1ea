#!/bin/bash
# Hybrid Mamba models (Mamba + attention + MLP layers), the recipe of Megatron-LM's examples/mamba/train.sh.
# Usage: bash examples/mamba/train.sh <data prefix> <tokenizer.model> [800M|8B (default 8B)]
# One node of 8 GPUs; TP=4 with sequence parallelism for 8B, TP=1 for 800M; the rest is data parallelism.
set -euo pipefail
export CUDA_DEVICE_MAX_CONNECTIONS=1

DATA_PATH=$1
TOKENIZER_MODEL=$2
MODEL_SCALE=${3:-8B}
CHECKPOINT_DIR=${CHECKPOINT_DIR:-./checkpoints/mamba-${MODEL_SCALE}}
TENSORBOARD_DIR=${TENSORBOARD_DIR:-./tensorboard/mamba-${MODEL_SCALE}}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}

case "$MODEL_SCALE" in
    800M) TP=1; NUM_LAYERS=48; HIDDEN_SIZE=1024; NUM_ATTENTION_HEADS=16; GLOBAL_BATCH_SIZE=32 ;;
    8B) TP=4; NUM_LAYERS=56; HIDDEN_SIZE=4096; NUM_ATTENTION_HEADS=32; GLOBAL_BATCH_SIZE=8 ;;
    *) echo "MODEL_SCALE must be 800M or 8B, got $MODEL_SCALE" >&2; exit 1 ;;
esac
SEQ_LEN=4096
TRAIN_SAMPLES=73242188  # 300B tokens / 4096
LR_WARMUP_SAMPLES=50000
LR_DECAY_SAMPLES=73192188  # TRAIN_SAMPLES - LR_WARMUP_SAMPLES

MODEL_ARGS=(--num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN_SIZE" --num-attention-heads "$NUM_ATTENTION_HEADS"
            --group-query-attention --num-query-groups 8 --hybrid-attention-ratio 0.08 --hybrid-mlp-ratio 0.5
            --is-hybrid-model --spec megatron.core.models.mamba.mamba_layer_specs mamba_stack_spec
            --seq-length "$SEQ_LEN" --max-position-embeddings "$SEQ_LEN" --position-embedding-type none
            --untie-embeddings-and-output-weights --init-method-std 0.02 --disable-bias-linear
            --normalization RMSNorm --attention-dropout 0.0 --hidden-dropout 0.0)
TRAINING_ARGS=(--micro-batch-size 1 --global-batch-size "$GLOBAL_BATCH_SIZE" --train-samples "$TRAIN_SAMPLES"
               --lr-warmup-samples "$LR_WARMUP_SAMPLES" --lr-decay-samples "$LR_DECAY_SAMPLES" --lr 2.5e-4
               --min-lr 2.5e-5 --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9
               --adam-beta2 0.95 --bf16)
PARALLEL_ARGS=(--tensor-model-parallel-size "$TP" --sequence-parallel --pipeline-model-parallel-size 1
               --use-distributed-optimizer --overlap-param-gather --overlap-grad-reduce)
DATA_ARGS=(--data-path "$DATA_PATH" --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model "$TOKENIZER_MODEL"
           --split 99,1,0 --no-create-attention-mask-in-dataloader)
LOGGING_ARGS=(--log-interval 10 --save-interval 2000 --eval-interval 2000 --eval-iters 32 --log-throughput
              --save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR" --tensorboard-dir "$TENSORBOARD_DIR")

cd "$(dirname "$0")/../.."
torchrun --nproc-per-node "$GPUS_PER_NODE" pretrain_mamba.py \
    "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" "${LOGGING_ARGS[@]}"
