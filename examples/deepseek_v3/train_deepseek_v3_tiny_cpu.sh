#!/bin/bash
# A tiny DeepSeek-V3-shaped model on mock data: multi-latent attention (q/kv LoRA, latent norms, decoupled RoPE
# with YaRN), MoE with sigmoid scores, aux-loss-free expert bias, group-limited top-k, seq-aux loss, a shared
# expert, the first layer dense (--moe-layer-freq list) and one multi-token-prediction depth. Runs on CPU with
# gloo or on GPUs. Usage: bash examples/deepseek_v3/train_deepseek_v3_tiny_cpu.sh [nproc (default 1)]
set -euo pipefail
export CUDA_DEVICE_MAX_CONNECTIONS=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

NPROC=${1:-1}
MODEL_ARGS=(--num-layers 3 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4
            --seq-length 128 --max-position-embeddings 128 --position-embedding-type rope --normalization RMSNorm
            --swiglu --disable-bias-linear --untie-embeddings-and-output-weights --qk-layernorm
            --attention-dropout 0.0 --hidden-dropout 0.0
            --multi-latent-attention --q-lora-rank 32 --kv-lora-rank 16 --qk-head-dim 16 --qk-pos-emb-head-dim 8
            --v-head-dim 16 --rotary-scaling-factor 4 --mscale 1.0 --mscale-all-dim 1.0 --rotary-base 10000
            --mtp-num-layers 1 --mtp-loss-scaling-factor 0.1)
MOE_ARGS=(--num-experts 8 --moe-layer-freq "([0]*1+[1]*2)" --moe-ffn-hidden-size 32
          --moe-shared-expert-intermediate-size 32 --moe-router-topk 2 --moe-router-num-groups 4
          --moe-router-group-topk 2 --moe-router-score-function sigmoid --moe-router-enable-expert-bias
          --moe-router-bias-update-rate 1e-3 --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4
          --moe-router-topk-scaling-factor 2.5 --moe-token-dispatcher-type alltoall --moe-router-dtype fp32)
TRAINING_ARGS=(--micro-batch-size 4 --global-batch-size $((8 * NPROC)) --train-iters 20 --lr 1e-3
               --lr-decay-style cosine --lr-warmup-iters 2 --min-lr 1e-4 --weight-decay 0.1 --clip-grad 1.0)
DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 8191)

cd "$(dirname "$0")/../.."
torchrun --nproc-per-node "$NPROC" pretrain_gpt.py \
    "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" --log-interval 5 --eval-iters 0
