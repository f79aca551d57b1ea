#!/usr/bin/env bash
# Same-GPU A/B of two source trees: for each config, the OLD tree's run_bench, then this tree's (with the
# yardstick, once per model), alternating, so both commits run in one job on one GPU.
#   OLD=.bench/old YARD=.bench/gpt_baseline.py bash benchmarks/gpu/ab_two_trees.sh gpt1.3b:graph llama1b:graph
# Results: $OUT/old_<config>/ and $OUT/new_<config>/ (run_bench's bench.json and logs). The old tree is a
# `git archive` of the earlier commit (its run_bench may use the variant names of its time).
set -uo pipefail
cd "$(dirname "$0")/../.."
OLD="${OLD:?path of the old tree}"
YARD="${YARD:?path of a copy of gpt_baseline.py}"
OUT="${OUT:-.}"
ROOT="$PWD"
mkdir -p "$OUT"
declare -A yard_done
for config in "$@"; do
    tag="${config//[:+]/_}"
    model="${config%%:*}"
    yard=(--yardstick "$ROOT/$YARD")  # once per model: the yardstick does not depend on the variant
    [[ -n "${yard_done[$model]:-}" ]] && yard=()
    yard_done[$model]=1
    (cd "$OLD" && python benchmarks/gpu/run_bench.py --configs "$config" --budget-s 150 ${GPUS:+--gpus $GPUS} --out "$OUT/old_$tag") \
        2>&1 | tee -a "$OUT/ab.log" | grep -vE "^\[bench\] (start|launch)" || true
    python benchmarks/gpu/run_bench.py "${yard[@]}" --configs "$config" --budget-s 200 ${GPUS:+--gpus $GPUS} \
        --out "$OUT/new_$tag" 2>&1 | tee -a "$OUT/ab.log" | grep -vE "^\[bench\] (start|launch)" || true
done
