#!/bin/bash
# DeepSeek-V3 (671B total, 37B active) pre-training, the command line of Megatron-LM's DeepSeek-V3 recipe
# (61 layers, the first 3 dense; MLA; 256 routed experts top-8 in 8 groups (top-4 groups) + 1 shared expert;
# sigmoid routing with aux-loss-free expert bias and a seq-aux loss; YaRN RoPE; one MTP depth).
# Parallelism as in the recipe for 1024 H100/H200 GPUs: TP 2, PP 16 (uneven first/last stages), EP 64.
# Usage: torchrun ... examples/deepseek_v3/pretrain_deepseek_v3_671b.sh (set DATA_PATH and TOKENIZER_MODEL).
set -euo pipefail
export CUDA_DEVICE_MAX_CONNECTIONS=1
DATA_PATH=${DATA_PATH:?set DATA_PATH to a preprocessed dataset prefix}
TOKENIZER_MODEL=${TOKENIZER_MODEL:-deepseek-ai/DeepSeek-V3}

MODEL_ARGS=(--num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128
            --kv-channels 128 --seq-length 4096 --max-position-embeddings 4096 --position-embedding-type rope
            --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --disable-bias-linear
            --untie-embeddings-and-output-weights --qk-layernorm --attention-dropout 0.0 --hidden-dropout 0.0
            --multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128
            --qk-pos-emb-head-dim 64 --v-head-dim 128 --rotary-base 10000 --rotary-scaling-factor 40
            --mscale 1.0 --mscale-all-dim 1.0 --mtp-num-layers 1 --mtp-loss-scaling-factor 0.1
            --make-vocab-size-divisible-by 3232)
MOE_ARGS=(--num-experts 256 --moe-layer-freq "([0]*3+[1]*58)" --moe-ffn-hidden-size 2048
          --moe-shared-expert-intermediate-size 2048 --moe-router-topk 8 --moe-router-num-groups 8
          --moe-router-group-topk 4 --moe-router-score-function sigmoid --moe-router-enable-expert-bias
          --moe-router-bias-update-rate 1e-3 --moe-router-load-balancing-type seq_aux_loss
          --moe-aux-loss-coeff 1e-4 --moe-router-topk-scaling-factor 2.5 --moe-router-dtype fp32
          --moe-grouped-gemm --moe-token-dispatcher-type alltoall --moe-permute-fusion)
PARALLEL_ARGS=(--tensor-model-parallel-size 2 --pipeline-model-parallel-size 16 --expert-model-parallel-size 64
               --expert-tensor-parallel-size 1
               --sequence-parallel --decoder-first-pipeline-num-layers 3 --decoder-last-pipeline-num-layers 2
               --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather)
TRAINING_ARGS=(--micro-batch-size 1 --global-batch-size 8192 --train-iters 500000 --lr 2.2e-4 --min-lr 2.2e-5
               --lr-decay-style cosine --lr-warmup-iters 2000 --weight-decay 0.1 --adam-beta1 0.9
               --adam-beta2 0.95 --clip-grad 1.0 --bf16 --init-method-std 0.006
               --recompute-granularity selective --recompute-modules mla_up_proj moe_act layernorm)
DATA_ARGS=(--data-path "$DATA_PATH" --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL"
           --split 99,1,0)

cd "$(dirname "$0")/../.."
python pretrain_gpt.py "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAINING_ARGS[@]}" \
    "${DATA_ARGS[@]}" --log-interval 1 --eval-iters 32 --eval-interval 2000 --save-interval 2000
