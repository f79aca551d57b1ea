"""Checkpoint save/resume through `pretrain` in this process (world size 1, gloo).

One uninterrupted 40-iteration run is the reference; a run that saves at 20 and exits, then a run that
resumes from it, must reproduce iterations 21..40 bit for bit (every microbatch's loss sum). The same
checkpoint directory then serves the crash-during-save, damaged-file and load-flag checks.
"""
import argparse
import os
import shutil

import pytest
import torch.distributed as dist

from megatron.core.dist_checkpointing.safe_load import safe_torch_load
from megatron.core.rerun_state_machine import RerunState
from megatron.training import checkpointing
from megatron.training.global_vars import get_args
from tests.functional.cli import reset_training_state, run_pretrain_in_process

BASE = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
    "--vocab-size 4096 --log-interval 10 --eval-iters 0 --transformer-impl local --seed 7 --ckpt-format torch"
).split()
MICROBATCHES_PER_ITER = 2


@pytest.fixture(scope="module", autouse=True)
def _destroy_process_group_at_end():
    yield
    reset_training_state()
    if dist.is_initialized():
        dist.destroy_process_group()


def _run(*flags, **kwargs):
    return run_pretrain_in_process([*BASE, *flags], **kwargs)


class _Killed(BaseException):
    """Raised where a SIGKILL would stop the writer."""


class _CrashingSave:
    """Stands in for torch.save inside checkpointing: writes half a file, then dies like a killed writer."""

    def __call__(self, obj, path):
        with open(path, "wb") as f:
            f.write(b"PK\x03\x04 partial")
        raise _Killed("simulated kill during checkpoint write")


def test_resume_crash_damage_and_load_flags(tmp_path, monkeypatch, capsys):
    save = str(tmp_path / "ckpt")
    code, full = _run("--train-iters", "40")
    assert code is None and len(full) == 40 * MICROBATCHES_PER_ITER
    first, last = sum(x[0] for x in full[:10]), sum(x[0] for x in full[-10:])
    assert last < first, "loss must fall over 40 iterations"

    code, part1 = _run("--train-iters", "40", "--save", save, "--save-interval", "20", "--exit-interval", "20")
    assert code == 0 and part1 == full[: 20 * MICROBATCHES_PER_ITER]
    assert "in torch format" in capsys.readouterr().out
    code, part2 = _run("--train-iters", "40", "--save", save, "--save-interval", "20", "--load", save)
    assert code is None
    assert part2 == full[20 * MICROBATCHES_PER_ITER:], "resumed losses 21..40 differ from the uninterrupted run"
    assert get_args().consumed_train_samples == 40 * 4
    out = capsys.readouterr().out
    assert "successfully loaded checkpoint from" in out and "at iteration 20" in out

    tracker = os.path.join(save, "latest_checkpointed_iteration.txt")
    assert open(tracker).read() == "40"
    # Megatron-LM's contents (an args Namespace, numpy RNG state, rerun-state enums), read by the safe loader.
    state = safe_torch_load(os.path.join(save, "iter_0000040", "mp_rank_00", "model_optim_rng.pt"))
    assert state["checkpoint_version"] == 3.0 and state["iteration"] == 40
    assert state["args"].consumed_train_samples == 160 and isinstance(state["args"], argparse.Namespace)
    assert state["rerun_state_machine"]["sharded"]["state"] is RerunState.NOT_RUNNING_YET
    assert {"model", "optimizer", "opt_param_scheduler", "rng_state"} <= set(state)
    assert state["num_floating_point_operations_so_far"] > 0
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in state["model"]

    # A writer killed in the middle of saving iteration 42 leaves iteration 40 in place and loadable.
    monkeypatch.setattr(checkpointing.torch, "save", _CrashingSave())
    with pytest.raises(_Killed):
        _run("--train-iters", "44", "--save", save, "--save-interval", "2", "--load", save,
             "--override-opt_param-scheduler")
    monkeypatch.undo()
    assert open(tracker).read() == "40"
    assert not os.path.exists(os.path.join(save, "iter_0000042"))
    assert sorted(n for n in os.listdir(save) if n.startswith("iter_")) == ["iter_0000020", "iter_0000040"]
    code, _ = _run("--train-iters", "40", "--load", save)
    assert code is None and get_args().iteration == 40

    # --finetune loads weights only: iteration and consumed samples start from zero.
    code, tuned = _run("--train-iters", "2", "--load", save, "--finetune")
    assert code is None and get_args().iteration == 0 and get_args().consumed_train_samples == 8
    assert len(tuned) == 2 * MICROBATCHES_PER_ITER

    # Damaged and mismatched checkpoints fail with a message naming the file / the flags.
    model_file = os.path.join(save, "iter_0000040", "mp_rank_00", "model_optim_rng.pt")
    with open(model_file, "r+b") as f:
        f.truncate(100)
    with pytest.raises(RuntimeError, match="model_optim_rng.pt is corrupt"):
        _run("--train-iters", "40", "--load", save)
    shutil.rmtree(os.path.join(save, "iter_0000040", "mp_rank_00"))
    with pytest.raises(FileNotFoundError, match="iter_0000040 is not a checkpoint: it has no metadata.json"):
        _run("--train-iters", "40", "--load", save)
    with pytest.raises(ValueError, match="--num-layers is 3 but the checkpoint was saved with 2"):
        _run("--train-iters", "20", "--load", save, "--ckpt-step", "20", "--num-layers", "3")
    reset_training_state()
