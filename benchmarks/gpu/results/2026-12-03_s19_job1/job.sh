#!/usr/bin/env bash
# job 1: yardstick, MoE GPU tests, MoE old (HEAD) vs new (no host wait at EP=1), dense, profile of new MoE
set -uo pipefail
export OMP_NUM_THREADS=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader | tee $OUT/clock.txt
python .bench/gpt_baseline.py --compile --steps 12 > $OUT/yard.txt 2>&1; tail -1 $OUT/yard.txt
timeout 300 python -m pytest -q -p no:cacheprovider tests/unit/transformer/moe/test_moe_gpu.py -k "not sequential" 2>&1 | tail -4
(cd .bench/old && timeout 300 python benchmarks/gpu/moe_bench.py --runs moe --skip-gemm --iters 16 --out $OUT/old_moe.json 2>&1 | tail -2)
timeout 400 python benchmarks/gpu/moe_bench.py --iters 16 --out $OUT/new.json 2>&1 | tail -8
timeout 300 python benchmarks/gpu/moe_bench.py --runs moe --skip-gemm --iters 6 --warmup 3 --profile --out $OUT/prof.json 2>&1 | tail -2
head -16 $OUT/profile_moe.txt | cut -c1-200
python - <<'PY'
import json, os
out = os.environ["OUT"]
for f in ("old_moe.json", "new.json"):
    d = json.load(open(os.path.join(out, f)))
    for k in ("moe", "dense"):
        if k in d: print(f, k, d[k]["tflops_per_gpu"], d[k]["ms_per_iter"], d[k]["tflops_all"])
PY
