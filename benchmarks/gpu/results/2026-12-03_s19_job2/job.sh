#!/usr/bin/env bash
# job 2: yardstick; GPU tests; s1 (no host wait) vs new (+ fused router, Triton fp32 grad add), with and without
# --manual-gc; dense both ways; profile of new MoE
set -uo pipefail
export OMP_NUM_THREADS=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader | tee $OUT/clock.txt
python .bench/gpt_baseline.py --compile --steps 12 > $OUT/yard.txt 2>&1; tail -1 $OUT/yard.txt
timeout 240 python -m pytest -q -p no:cacheprovider tests/unit/transformer/moe/test_moe_gpu.py tests/unit/fusions/test_fused_grad_accumulation.py -k "not sequential" 2>&1 | grep -E "passed|failed|Error|assert" | tail -6
B="python benchmarks/gpu/moe_bench.py --skip-gemm --iters 12"
(cd .bench/s1 && timeout 200 $B --runs moe --out $OUT/s1_moe.json 2>&1 | grep "^pretrain")
timeout 200 $B --runs moe --out $OUT/new_moe.json 2>&1 | grep "^pretrain"
timeout 200 $B --runs moe dense --extra-flags=--manual-gc --out $OUT/new_gc.json 2>&1 | grep "^pretrain"
timeout 200 $B --runs dense --out $OUT/new_dense.json 2>&1 | grep "^pretrain"
timeout 240 python benchmarks/gpu/moe_bench.py --skip-gemm --runs moe --iters 6 --warmup 3 --profile --extra-flags=--manual-gc --out $OUT/prof.json 2>&1 | grep "^pretrain"
head -14 $OUT/profile_moe.txt | cut -c1-180
python - <<'PY'
import json, os
out = os.environ["OUT"]
for f in ("s1_moe.json", "new_moe.json", "new_gc.json", "new_dense.json"):
    try:
        d = json.load(open(os.path.join(out, f)))
    except Exception as e:
        print(f, "missing", e); continue
    for k in ("moe", "dense"):
        if k in d: print(f, k, d[k]["tflops_per_gpu"], d[k]["ms_per_iter"], d[k]["tflops_all"])
PY
