"""examples/mixtral: the tiny CPU variant runs as written (2 gloo ranks, EP=2) and learns; the full Mixtral-8x7B
recipe's command line (captured through a stand-in `torchrun`, mock data) passes argument validation at its
32-GPU layout (PP=4 x EP=8). About 30 s."""
import os
import re
import stat
import subprocess
import sys

from megatron.training.arguments import _parse, validate_args
from tests.harness import repo_root

EXAMPLES = os.path.join(repo_root(), "examples", "mixtral")
ITERATION_RE = re.compile(r"\] iteration\s+(\d+)/\s*(\d+) .*? lm loss: ([0-9.E+-]+) \|")


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=repo_root(), **extra)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return env


def test_tiny_cpu_variant_runs_and_learns():
    script = os.path.join(EXAMPLES, "train_mixtral_tiny_cpu.sh")
    proc = subprocess.run(["bash", script, "2", "10"], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    lines = [(int(m[1]), float(m[3])) for m in ITERATION_RE.finditer(proc.stdout)]
    assert [i for i, _ in lines] == [5, 10], proc.stdout[-3000:]
    assert lines[1][1] < lines[0][1], lines


def test_mixtral_8x7b_recipe_validates_at_its_layout(tmp_path):
    shim = tmp_path / "torchrun"
    shim.write_text('#!/bin/bash\nprintf "%s\\n" "$@" > "$CAPTURE"\n')
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    capture = tmp_path / "argv.txt"
    env = _env(CAPTURE=str(capture))
    env["PATH"] = str(tmp_path) + os.pathsep + env["PATH"]
    script = os.path.join(EXAMPLES, "train_mixtral_8x7b_distributed.sh")
    proc = subprocess.run(["bash", script, str(tmp_path / "ckpt"), "unused", "MOCK"], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout
    argv = capture.read_text().splitlines()
    flags = argv[argv.index("pretrain_gpt.py") + 1:]
    args = _parse(flags)
    args.world_size, args.rank = 32, 0
    args = validate_args(args)
    assert (args.num_experts, args.moe_router_topk, args.expert_model_parallel_size) == (8, 2, 8)
    assert args.pipeline_model_parallel_size == 4 and args.moe_grouped_gemm and args.rotary_base == 1000000
