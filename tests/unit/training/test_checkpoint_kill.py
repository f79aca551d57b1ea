"""A checkpoint writer killed with SIGKILL in the middle of a save, for the legacy `torch` format and `torch_dist`
(synchronous and `--async-save`).

Each variant runs `pretrain` in a forked process (world size 1, gloo) that saves iteration 2 normally and blocks
inside the save of iteration 4, after part of it is on disk: the legacy writer has written half of
`model_optim_rng.pt`; the torch_dist writer has written its `.distcp` data files but not `.metadata` or
`metadata.json` (with --async-save the block is in the background writer thread while the main thread waits to
finalize). The parent kills the process and checks that the tracker still says 2, iteration 2 is intact and
loads (file by file, then by resuming training from the tracker: each resumed iteration 3 has the loss of an
uninterrupted run's iteration 3), the partial save stayed in `.tmp_iter_0000004`, and loading the
damaged iteration names what is missing. The three writers run at the same time.
"""
import io
import multiprocessing as mp
import os
import signal
import time
from argparse import Namespace

import pytest
import torch
import torch._dynamo  # noqa: F401  (torch.optim imports it lazily: once here, not in every forked writer)

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import CheckpointingException
from megatron.core.dist_checkpointing.safe_load import safe_torch_load
from megatron.core.dist_checkpointing.strategies import torch as torch_strategy
from megatron.training import checkpointing
from megatron.training.global_vars import get_args
from tests.functional.cli import reset_training_state, run_pretrain_in_process
from tests.harness import inherited_objects_frozen, run_on_ranks

BASE = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 "
    "--micro-batch-size 1 --global-batch-size 1 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
    "--vocab-size 4095 --log-interval 10 --eval-iters 0 --transformer-impl local --seed 7 --swiglu --num-workers 0 "
    "--train-iters 4 --save-interval 2"
).split()
VARIANTS = {"torch": ["--ckpt-format", "torch"], "torch_dist": [], "torch_dist_async": ["--async-save"]}
KILLED_DIR = ".tmp_iter_0000004"
WAIT_S = 180


def _signal_and_block(marker):
    with open(marker, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(WAIT_S + 60)


def _install_blocking_writer(variant, save, marker):
    if variant == "torch":
        real_save = torch.save

        def half_written_save(obj, f, *args, **kwargs):
            if isinstance(f, str) and KILLED_DIR in f and f.endswith("model_optim_rng.pt"):
                buffer = io.BytesIO()
                real_save(obj, buffer)
                with open(f, "wb") as out:
                    out.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
                    out.flush()
                    os.fsync(out.fileno())
                _signal_and_block(marker)
            return real_save(obj, f, *args, **kwargs)

        torch.save = half_written_save
        return
    real_write = torch_strategy.write_planned

    def write_then_block(state):
        real_write(state)
        if KILLED_DIR in state.checkpoint_dir:
            tracker = os.path.join(save, "latest_checkpointed_iteration.txt")
            deadline = time.time() + WAIT_S
            # Async: iteration 2 is published by the main thread while it waits for this write.
            while not (os.path.isfile(tracker) and open(tracker).read() == "2") and time.time() < deadline:
                time.sleep(0.05)
            _signal_and_block(marker)

    torch_strategy.write_planned = write_then_block


def _writer(variant, save, marker):
    torch.set_num_threads(1)
    _install_blocking_writer(variant, save, marker)
    run_pretrain_in_process(BASE + VARIANTS[variant] + ["--save", save])
    os._exit(3)  # not reached: the save of iteration 4 blocks until the parent kills this process


def _kill_writers(root):
    ctx = mp.get_context("fork")
    procs = {}
    with inherited_objects_frozen("fork"):
        for variant in VARIANTS:
            marker = os.path.join(root, variant + ".writing")
            proc = ctx.Process(target=_writer, args=(variant, os.path.join(root, variant), marker))
            proc.start()
            procs[variant] = (proc, marker)
    deadline = time.time() + WAIT_S
    try:
        for variant, (proc, marker) in procs.items():
            while not os.path.isfile(marker) and proc.is_alive() and time.time() < deadline:
                time.sleep(0.05)
            assert os.path.isfile(marker), f"{variant}: the writer never reached the blocking point"
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(30)
            assert proc.exitcode == -signal.SIGKILL, (variant, proc.exitcode)
    finally:
        for proc, _ in procs.values():
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
                proc.join(30)


def _assert_previous_checkpoint_intact(save, variant):
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read() == "2", variant
    entries = sorted(os.listdir(save))
    assert [e for e in entries if "iter_" in e] == [KILLED_DIR, "iter_0000002"], (variant, entries)
    iter2 = os.path.join(save, "iter_0000002")
    if variant == "torch":
        state = safe_torch_load(os.path.join(iter2, "mp_rank_00", "model_optim_rng.pt"))
        assert state["iteration"] == 2 and "decoder.layers.0.mlp.linear_fc1.weight" in state["model"]
        return
    assert dist_checkpointing.load_common_state_dict(iter2)["iteration"] == 2
    tensors = dist_checkpointing.load_plain_tensors(iter2)
    assert tensors["decoder.layers.mlp.linear_fc1.weight"].shape == (2, 128, 32)
    assert "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight" in tensors


def _assert_damaged_save_is_named(save, variant):
    damaged = os.path.join(save, KILLED_DIR)
    args = Namespace(ckpt_format="torch" if variant == "torch" else "torch_dist", auto_detect_ckpt_format=False)
    with pytest.raises(FileNotFoundError, match=r"iter_0000004 does not exist \(.*\.tmp_iter_0000004 holds an "
                                                r"interrupted save"):
        checkpointing._detect_format(args, os.path.join(save, "iter_0000004"))
    if variant == "torch":
        with pytest.raises(RuntimeError, match=r"\.tmp_iter_0000004/mp_rank_00/model_optim_rng\.pt is corrupt"):
            checkpointing._load_file(os.path.join(damaged, "mp_rank_00", "model_optim_rng.pt"))
        return
    assert sorted(os.listdir(damaged)) == ["__0_0.distcp", "__0_1.distcp", "common.pt"], variant
    with pytest.raises(CheckpointingException, match=r"\.tmp_iter_0000004/metadata\.json is missing"):
        dist_checkpointing.load_plain_tensors(damaged)
    with pytest.raises(FileNotFoundError, match="is not a complete checkpoint: its metadata.json is missing"):
        checkpointing._detect_format(args, damaged)


def _resume_each(root):
    """Resume every variant from its tracker for one iteration: (iteration loaded, iteration-3 losses)."""
    code, uninterrupted = run_pretrain_in_process(BASE + ["--exit-interval", "3"])
    assert code == 0 and len(uninterrupted) == 3
    results = {"uninterrupted": (0, uninterrupted[-1:])}
    for variant, flags in VARIANTS.items():
        flags = [f for f in flags if f != "--async-save"]
        code, losses = run_pretrain_in_process(BASE + flags + ["--load", os.path.join(root, variant),
                                                               "--exit-interval", "3"])
        assert code == 0, (variant, code)
        results[variant] = (get_args().iteration, losses)
    reset_training_state()
    return results


def test_sigkill_during_save_leaves_previous_checkpoint_and_tracker(tmp_path):
    root = str(tmp_path)
    _kill_writers(root)
    for variant in VARIANTS:
        save = os.path.join(root, variant)
        _assert_previous_checkpoint_intact(save, variant)
        _assert_damaged_save_is_named(save, variant)
    resumed = run_on_ranks(_resume_each, 1, root, timeout=120)[0]
    reference = resumed.pop("uninterrupted")[1]
    assert all(iteration == 2 and losses == reference for iteration, losses in resumed.values()), (reference, resumed)
