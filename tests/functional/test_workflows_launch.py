"""Launch workflows as users run them: each tiny example script as written, and the SLURM launcher
(`examples/slurm/launch.sh`, what the sbatch files `srun`) as two torchrun agents on one host acting as two
"nodes" (`--nnodes 2`, c10d rendezvous, gloo), compared with the single-process run of the same batch.

Every subprocess runs in its own session under a hard timeout; on a timeout or a failure the whole process
group (agents and their workers) is killed, so a stuck rendezvous fails the test instead of hanging CI.
"""
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

from tests.functional.cli import _env, _free_port, parse_output, run_pretrain
from tests.harness import repo_root

ROOT = Path(repo_root())
# The model families whose tiny CPU example the project ships (examples/<family>/*_tiny_cpu.sh). A family
# listed here whose script has not landed yet is skipped; any script found is run, listed or not.
FAMILIES = ("gpt3", "llama", "mixtral", "deepseek_v3", "mamba")
# Families whose tiny examples have their own test (which also checks that the loss falls): not run twice.
OWN_TESTS = {"bert": "tests/functional/test_examples_bert_t5.py", "t5": "tests/functional/test_examples_bert_t5.py"}
EXAMPLE_TIMEOUT_S = 420


def _with_interpreter_on_path(env: Dict[str, str]) -> Dict[str, str]:
    """The scripts call `torchrun` and `python`: make them this interpreter's, even without an activated venv."""
    return dict(env, PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""))


def _start(cmd: List[str], env: Dict[str, str]) -> subprocess.Popen:
    env = _with_interpreter_on_path(env)
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _finish(procs: List[subprocess.Popen], timeout: float) -> List[Tuple[int, str]]:
    """(returncode, output) of each process; all groups are killed if one times out or fails."""
    results = []
    try:
        for proc in procs:
            output, _ = proc.communicate(timeout=timeout)
            results.append((proc.returncode, output))
            if proc.returncode != 0:
                break
    except subprocess.TimeoutExpired:
        for proc in procs:
            _kill_group(proc)
        outputs = [proc.communicate()[0] for proc in procs]
        pytest.fail(f"timed out after {timeout} s; outputs:\n" + "\n=====\n".join(o[-3000:] for o in outputs))
    finally:
        for proc in procs:
            if proc.poll() is None:
                _kill_group(proc)
                proc.communicate()
    return results


def _example_scripts():
    found = {path.parent.name: path for path in sorted(ROOT.glob("examples/*/*_tiny_cpu.sh"))
             if path.parent.name not in OWN_TESTS}
    params = []
    for family in sorted(set(FAMILIES) | set(found)):
        marks = () if family in found else (pytest.mark.skip(reason=f"examples/{family}/*_tiny_cpu.sh not yet added"),)
        params.append(pytest.param(found.get(family), id=family, marks=marks))
    return params


@pytest.mark.parametrize("script", _example_scripts())
def test_tiny_example_runs_as_written(script):
    env = _env({"OMP_NUM_THREADS": "1"})
    [(returncode, output)] = _finish([_start(["bash", str(script)], env)], EXAMPLE_TIMEOUT_S)
    assert returncode == 0, output[-5000:]
    result = parse_output(output)
    assert not result.unmatched_log_lines, result.unmatched_log_lines[:2]
    assert result.iterations, "no training log line:\n" + output[-3000:]
    last = result.iterations[-1]
    assert last["iteration"] == last["train_iters"], "training stopped early"
    losses = [v for entry in result.iterations for v in entry["loss_values"].values()]
    assert losses and all(math.isfinite(v) and v > 0 for v in losses), losses
    assert int(last["nan"]) == 0 and int(last["skipped"]) == 0


TWO_NODE_FLAGS = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--micro-batch-size 2 --global-batch-size 4 --train-iters 4 --lr 1e-3 --lr-warmup-iters 1 --min-lr 1e-4 "
    "--lr-decay-style cosine --hidden-dropout 0.0 --attention-dropout 0.0 --mock-data --tokenizer-type NullTokenizer "
    "--vocab-size 4095 --log-interval 1 --eval-iters 0 --seed 7 --transformer-impl local"
).split()


def _node_env(node_rank: int, port: int, job_id: str) -> Dict[str, str]:
    return _env({
        "SLURM_JOB_ID": job_id, "SLURM_NNODES": "2", "SLURM_NODEID": str(node_rank),
        "SLURM_JOB_NODELIST": "127.0.0.1", "MASTER_PORT": str(port), "GPUS_PER_NODE": "1",
        "LOCAL_ADDR": "127.0.0.1", "RDZV_TIMEOUT": "120", "GLOO_SOCKET_IFNAME": "lo",
        "CUDA_VISIBLE_DEVICES": "",
    })


def test_two_nodes_through_the_slurm_launcher_match_one_process():
    port = _free_port()
    job_id = f"pytest-{os.getpid()}"
    launcher = ["bash", str(ROOT / "examples" / "slurm" / "launch.sh"), "pretrain_gpt.py", *TWO_NODE_FLAGS]
    agents = [_start(launcher, _node_env(rank, port, job_id)) for rank in (0, 1)]
    reference = run_pretrain(TWO_NODE_FLAGS, timeout=300)
    results = _finish(agents, timeout=300)
    assert [rc for rc, _ in results] == [0, 0], "\n=====\n".join(out[-4000:] for _, out in results)
    assert reference.returncode == 0, reference.output[-4000:]
    node0 = "".join(out for _, out in results)
    assert "[launch] node 0/2" in node0 and "[launch] node 1/2" in node0
    two_nodes = parse_output(node0)
    assert len(two_nodes.iterations) == len(reference.iterations) == 4
    assert re.search(r"^  world_size \.+ 2$", node0, re.M) and re.search(r"^  world_size \.+ 1$", reference.output, re.M)
    for multi, single in zip(two_nodes.iterations, reference.iterations):
        assert multi["consumed"] == single["consumed"]
        assert multi["loss_values"]["lm loss"] == pytest.approx(single["loss_values"]["lm loss"], rel=2e-5)
        assert float(multi["grad_norm"]) == pytest.approx(float(single["grad_norm"]), rel=1e-3)
