"""benchmarks/gpu/bert_t5_bench.py --smoke: the three runs (GPT, BERT, T5 through their entry scripts) succeed on
CPU at tiny shapes and the JSON carries the TFLOP/s (Megatron's formula, from the logs), step times and the
BERT/GPT ratio; the formula recomputed in the script agrees with the logged number."""
import json
import os
import subprocess
import sys

from tests.harness import repo_root


def test_bench_smoke_writes_the_report(tmp_path):
    out = tmp_path / "report.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(repo_root(), "benchmarks", "gpu", "bert_t5_bench.py"),
                           "--smoke", "--work-dir", str(tmp_path / "work"), "--out", str(out)],
                          cwd=repo_root(), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:]
    report = json.loads(out.read_text())
    assert set(report["runs"]) == {"gpt", "bert", "t5"}
    for run in report["runs"].values():
        assert run["rc"] == 0 and run["step_ms"] > 0 and run["tflops"] is not None and len(run["lm_losses"]) == 2
    assert "bert_vs_gpt" in report and "bert_ge_90pct_of_gpt" in report
    for name in ("gpt", "bert"):
        run = report["runs"][name]
        assert run["tflops_formula"] > 0
        if run["tflops"] > 0:  # the log prints one decimal
            assert abs(run["tflops_formula"] - run["tflops"]) <= 0.05 * run["tflops"] + 0.05, run
