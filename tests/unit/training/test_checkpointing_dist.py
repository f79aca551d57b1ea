"""torch_dist checkpoints through `pretrain` in this process (world size 1, gloo): resume bit for bit,
async saves equal to synchronous ones, a killed writer, damaged files, format conversion, checkpoint args
(also Megatron-LM's pickled Namespace in common.pt, read by the restricted unpickler).
"""
import argparse
import os
import shutil
import threading

import pytest
import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.safe_load import safe_torch_load
from megatron.core.dist_checkpointing.strategies import torch as torch_strategy
from megatron.core.transformer.enums import AttnBackend
from megatron.training import checkpointing
from megatron.training.global_vars import get_args
from tests.functional.cli import reset_training_state, run_pretrain_in_process

BASE = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
    "--vocab-size 4095 --log-interval 10 --eval-iters 0 --transformer-impl local --seed 7 --swiglu"
).split()
PER_ITER = 2


@pytest.fixture(scope="module", autouse=True)
def _destroy_process_group_at_end():
    yield
    reset_training_state()
    if dist.is_initialized():
        dist.destroy_process_group()


def _run(*flags):
    return run_pretrain_in_process([*BASE, *flags])


class _Killed(BaseException):
    """Raised where a SIGKILL would stop the writer."""


def _killed_writer(state):
    with open(os.path.join(state.checkpoint_dir, "__0_0.distcp"), "wb") as f:
        f.write(b"partial")
    raise _Killed("simulated kill during the data write")


def _rewrite_args_as_namespace(path):
    """Make sure common.pt / model_optim_rng.pt hold args as Megatron-LM pickles them: a Namespace with dtypes
    and enums (readable only by the restricted unpickler, never by weights_only alone)."""
    common = safe_torch_load(path)
    fields = dict(vars(common["args"]), params_dtype=torch.float32, attention_backend=AttnBackend.auto)
    common["args"] = argparse.Namespace(**fields)
    torch.save(common, path)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """An uninterrupted 5-iteration run that saves at 2, 4 and 5: (save dir, per-microbatch losses)."""
    save = str(tmp_path_factory.mktemp("reference") / "ckpt")
    code, full = _run("--train-iters", "5", "--save", save, "--save-interval", "2")
    assert code is None and len(full) == 5 * PER_ITER
    return save, full


def test_torch_dist_resume_async_crash_damage_convert(reference_run, tmp_path, monkeypatch, capsys):
    save, full = reference_run
    save_async, converted = (str(tmp_path / name) for name in ("ckpt_async", "converted"))
    iter2 = os.path.join(save, "iter_0000002")
    assert sorted(os.listdir(iter2)) == [".metadata", "__0_0.distcp", "__0_1.distcp", "common.pt", "metadata.json"]
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read() == "5"
    common = dist_checkpointing.load_common_state_dict(iter2)
    assert common["iteration"] == 2 and isinstance(common["args"], argparse.Namespace)
    assert common["checkpoint_version"] == 3.0 and common["content_metadata"] == {}
    assert common["num_floating_point_operations_so_far"] > 0 and "opt_param_scheduler" in common
    assert float(common["optimizer"]["state"]["common_step"]) == 2 and common["rerun_state_machine"]["mode"] == "disabled"
    stored = dist_checkpointing.load_sharded_metadata(iter2)
    assert "rng_state/shard_0.0_1.1" in stored
    assert stored["decoder.layers.mlp.linear_fc1.weight"].global_shape == (2, 128, 32)
    assert "optimizer.state.exp_avg_sq.decoder.layers.mlp.linear_fc1.weight" in stored

    # Resume from iteration 2 (args read from a Megatron-style Namespace): iterations 3..5 bit for bit.
    _rewrite_args_as_namespace(os.path.join(iter2, "common.pt"))
    code, resumed = _run("--train-iters", "5", "--load", save, "--ckpt-step", "2")
    assert code is None and resumed == full[2 * PER_ITER:]
    assert "successfully loaded checkpoint from" in capsys.readouterr().out

    # --async-save writes the same tensors from a background thread; the tracker appears once finalized.
    writer_threads = []
    original_write = torch_strategy.write_planned

    def recording_write(state):
        writer_threads.append(threading.current_thread().name)
        original_write(state)

    monkeypatch.setattr(torch_strategy, "write_planned", recording_write)
    code, _ = _run("--train-iters", "5", "--exit-interval", "2", "--save", save_async, "--save-interval", "2",
                   "--async-save")
    assert code == 0 and "scheduled asynchronous save of iteration 2" in capsys.readouterr().out
    monkeypatch.undo()
    assert writer_threads == ["async-ckpt-0"]
    assert open(os.path.join(save_async, "latest_checkpointed_iteration.txt")).read() == "2"
    sync_tensors = dist_checkpointing.load_plain_tensors(iter2)
    async_tensors = dist_checkpointing.load_plain_tensors(os.path.join(save_async, "iter_0000002"))
    assert sync_tensors.keys() == async_tensors.keys() and len(sync_tensors) > 30
    assert all(torch.equal(sync_tensors[k], async_tensors[k]) for k in sync_tensors)

    # A writer killed while saving iteration 6 leaves the tracker and iteration 5 untouched.
    monkeypatch.setattr(torch_strategy, "write_planned", _killed_writer)
    with pytest.raises(_Killed):
        _run("--train-iters", "7", "--save", save, "--save-interval", "6", "--load", save,
             "--override-opt_param-scheduler")
    monkeypatch.undo()
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read() == "5"
    assert sorted(n for n in os.listdir(save) if n.startswith("iter_")) == ["iter_0000002", "iter_0000004",
                                                                              "iter_0000005"]

    # Convert iteration 4 to the legacy format (args from the checkpoint), then resume from it: iteration 5 matches.
    code, _ = _run("--train-iters", "5", "--load", save, "--ckpt-step", "4", "--use-checkpoint-args",
                   "--num-layers", "3", "--ckpt-convert-format", "torch", "--ckpt-convert-save", converted)
    assert code == 0 and get_args().num_layers == 2
    legacy_file = os.path.join(converted, "torch", "iter_0000004", "mp_rank_00", "model_optim_rng.pt")
    _rewrite_args_as_namespace(legacy_file)
    with pytest.raises(Exception):
        torch.load(legacy_file, weights_only=True)
    code, from_legacy = _run("--train-iters", "5", "--load", os.path.join(converted, "torch"), "--ckpt-format",
                             "torch")
    assert code is None and from_legacy == full[4 * PER_ITER:]

    # Damaged checkpoints name the file.
    iter5 = os.path.join(save, "iter_0000005")
    with open(os.path.join(iter5, "__0_1.distcp"), "r+b") as f:
        f.truncate(10)
    with pytest.raises(Exception, match="__0_1.distcp"):
        _run("--train-iters", "6", "--load", save)
    os.remove(os.path.join(iter5, "metadata.json"))
    with pytest.raises(FileNotFoundError, match="iter_0000005 is not a complete checkpoint: its metadata.json is missing"):
        _run("--train-iters", "6", "--load", save)
    shutil.rmtree(iter5)


def test_checkpoint_args_from_common_pt(reference_run):
    save = reference_run[0]
    args = argparse.Namespace(load=save, pretrained_checkpoint=None, ckpt_step=4, exit_on_missing_checkpoint=False,
                              finetune=False, num_layers=7, hidden_size=8, tensor_model_parallel_size=2,
                              pipeline_model_parallel_size=3, use_mp_args_from_checkpoint_args=False)
    args, checkpoint_args = checkpointing.load_args_from_checkpoint(args)
    assert (args.num_layers, args.hidden_size, args.iteration) == (2, 32, 4)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (2, 3), "torch_dist reshards"
    assert checkpoint_args.swiglu is True
    args.use_mp_args_from_checkpoint_args = True
    args, _ = checkpointing.load_args_from_checkpoint(args)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (1, 1)


def test_non_persistent_global_checkpoints(reference_run, tmp_path, capsys):
    save, full = str(tmp_path / "ckpt"), reference_run[1]
    code, _ = _run("--train-iters", "5", "--exit-interval", "3", "--save", save, "--save-interval", "2",
                   "--non-persistent-save-interval", "1", "--non-persistent-ckpt-type", "global")
    assert code == 0
    non_persistent = os.path.join(save, "non_persistent")
    assert sorted(os.listdir(non_persistent)) == ["iter_0000003", "latest_checkpointed_iteration.txt"]
    # Pretend the persistent save of iteration 3 never happened: the newer non-persistent one is loaded.
    shutil.rmtree(os.path.join(save, "iter_0000003"))
    with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("2")
    capsys.readouterr()
    code, resumed = _run("--train-iters", "5", "--load", save)
    assert code is None and resumed == full[3 * PER_ITER:]
    assert "non-persistent checkpoint" in capsys.readouterr().out
    code, _ = _run("--train-iters", "5", "--non-persistent-ckpt-type", "local")
    assert code == 2
    assert "--non-persistent-ckpt-type local needs --non-persistent-local-ckpt-dir" in capsys.readouterr().err
    code, _ = _run("--train-iters", "5", "--non-persistent-ckpt-type", "in_memory")
    assert code == 2
    assert "--non-persistent-ckpt-type in_memory: in-memory non-persistent" in capsys.readouterr().err
    reset_training_state()
