#!/usr/bin/env bash
# job 3: yardstick; MoE vs dense with per-layer CUDA graphs (MoE now graphable at EP=1) and eager; GPU tests
# (graphed MoE = eager, fp32 grad add, Triton grouped wgrad); grouped wgrad bench
set -uo pipefail
export OMP_NUM_THREADS=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader | tee $OUT/clock.txt
python .bench/gpt_baseline.py --compile --steps 12 > $OUT/yard.txt 2>&1; tail -1 $OUT/yard.txt
B="python benchmarks/gpu/moe_bench.py --skip-gemm --iters 12"
timeout 200 $B --runs moe dense --extra-flags=--enable-cuda-graph --out $OUT/graphed.json 2>&1 | grep "^pretrain"
timeout 160 $B --runs moe dense --out $OUT/eager.json 2>&1 | grep "^pretrain"
timeout 150 python -m pytest -q -p no:cacheprovider tests/functional/test_cuda_graph_gpu.py -k "1gpu-moe" tests/unit/fusions/test_fused_grad_accumulation.py tests/unit/transformer/moe/test_triton_grouped_wgrad.py 2>&1 | grep -E "passed|failed|Error|assert|FAIL" | tail -8
timeout 60 python benchmarks/gpu/grouped_wgrad_bench.py > $OUT/wgrad.txt 2>&1; cut -c1-220 $OUT/wgrad.txt | tail -20
python - <<'PY'
import json, os
out = os.environ["OUT"]
for f in ("graphed.json", "eager.json"):
    try:
        d = json.load(open(os.path.join(out, f)))
    except Exception as e:
        print(f, "missing", e); continue
    for k in ("moe", "dense"):
        if k in d:
            print(f, k, d[k]["tflops_per_gpu"], d[k]["ms_per_iter"], d[k]["tflops_all"], d[k].get("max_allocated_mb"))
            if d[k].get("log_tail"): print(d[k]["log_tail"][-2500:])
PY
