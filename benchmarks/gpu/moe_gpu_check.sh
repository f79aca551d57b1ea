#!/usr/bin/env bash
# One GPU job for the MoE work that was checked on the CPU only (2026-12-03, nineteenth session), not part
# of the product: the GPU tests of the pieces first, then the Mixtral-style benchmark with per-layer CUDA
# graphs and eagerly, and the kernel benchmarks. Key lines go to stdout (a job returns only a few files).
#   YARD=<copy of shared/bench/gpt_baseline.py> OUT=<dir> bash benchmarks/gpu/moe_gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-.}"
YARD="${YARD:?path of a copy of gpt_baseline.py}"
export OMP_NUM_THREADS=1
python "$YARD" --compile --steps 12 > "$OUT/yard.txt" 2>&1; tail -1 "$OUT/yard.txt"
timeout 300 python -m pytest -q -p no:cacheprovider tests/unit/transformer/moe/test_moe_gpu.py \
    tests/unit/transformer/moe/test_triton_grouped_wgrad.py tests/unit/fusions/test_fused_grad_accumulation.py \
    tests/unit/fusions/test_triton_weighted_swiglu.py 2>&1 | grep -E "passed|failed|Error|assert" | tail -8
timeout 240 python -m pytest -q -p no:cacheprovider tests/functional/test_cuda_graph_gpu.py \
    -k "1gpu-moe or 1gpu-2micro" 2>&1 | grep -E "passed|failed|Error|assert" | tail -6
B="python benchmarks/gpu/moe_bench.py --skip-gemm --iters 12"
timeout 240 $B --runs moe dense --extra-flags=--enable-cuda-graph --out "$OUT/graphed.json" 2>&1 | grep "^pretrain"
timeout 200 $B --runs moe dense --out "$OUT/eager.json" 2>&1 | grep "^pretrain"
timeout 120 python benchmarks/gpu/grouped_wgrad_bench.py --sweep > "$OUT/wgrad.txt" 2>&1
cut -c1-200 "$OUT/wgrad.txt" | grep variant | head -60
timeout 120 python benchmarks/gpu/activation_bench.py 2>&1 | grep weighted
# the DeepSeek-V3 proxy (MLA, group-limited sigmoid routing with expert bias, shared expert, MTP) graphed
timeout 300 python benchmarks/gpu/deepseek_bench.py --only deepseek --iters 12 --extra-flags=--enable-cuda-graph \
    --out-dir "$OUT/deepseek_graphed" 2>&1 | tail -4 | cut -c1-300
