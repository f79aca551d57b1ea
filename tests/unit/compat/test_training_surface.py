"""Megatron-LM's `megatron.training` helper names (one process): global_vars, initialize, training, utils,
checkpointing, async_utils and arguments helpers, each checked for what it does."""
import argparse
import logging
import os
from datetime import datetime

import pytest
import torch

from megatron.core import config as core_config
from megatron.core import num_microbatches_calculator as nmc
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.energy_monitor import EnergyMonitor
from megatron.training import async_utils, checkpointing, global_vars, initialize, training, utils
from megatron.training.arguments import _check_arg_is_not_none, _parse, moe_freq_type, no_rope_freq_type
from tests.unit.transformer.model_setup import init_single_rank

BASE = ("--num-layers 1 --hidden-size 8 --num-attention-heads 2 --seq-length 8 --max-position-embeddings 8 "
        "--micro-batch-size 1 --global-batch-size 1 --tokenizer-type NullTokenizer --vocab-size 31").split()


def _args(*extra):
    args = _parse(BASE + list(extra))
    args.rank, args.world_size, args.data_parallel_size = 0, 1, 1
    return args


def test_global_vars(tmp_path):
    args = _args("--enable-experimental")
    global_vars.set_global_variables(args)
    assert core_config.is_experimental_enabled() and isinstance(global_vars.get_energy_monitor(), EnergyMonitor)
    with pytest.raises(AssertionError, match="args is already initialized"):
        global_vars._ensure_var_is_not_initialized(global_vars.get_args(), "args")
    global_vars.unset_global_variables()
    with pytest.raises(AssertionError, match="args is not initialized"):
        global_vars.get_args()
    with pytest.raises(RuntimeError):  # the microbatch calculator went too
        nmc.get_num_microbatches()
    global_vars.set_global_variables(_args())  # can be set again
    assert global_vars.get_args().vocab_size == 31
    global_vars.destroy_global_vars()
    assert not core_config.is_experimental_enabled()


class _Writer:
    def __init__(self):
        self.texts = {}

    def add_text(self, name, value, global_step):
        self.texts[name] = (value, global_step)


def test_initialize_helpers(monkeypatch, caplog):
    args = _args()
    args.iteration = 5
    global_vars.set_args(args)
    writer = _Writer()
    monkeypatch.setattr(global_vars, "_GLOBAL_TENSORBOARD_WRITER", writer)
    initialize.write_args_to_tensorboard()
    assert writer.texts["hidden_size"] == ("8", 5) and len(writer.texts) == len(vars(args))
    assert initialize._compile_dependencies() is None and initialize._warmup_jit_function() is None
    with caplog.at_level(logging.INFO):
        initialize._initialize_tp_communicators()
    assert "no userbuffers communicators" in caplog.text


def test_training_helpers(tmp_path):
    args = _args()
    common = {"args": argparse.Namespace(rank=3, local_rank=1, lr=0.1), "iteration": 7}
    processed = training.preprocess_common_state_dict(common)
    assert processed == {"args": {"lr": 0.1}, "iteration": 7} and vars(common["args"])["rank"] == 3

    args.save, args.world_size = str(tmp_path), 2
    global_vars.set_args(args)
    lines = ["2026-01-01 10:00:00\tJob ID: 1\t# GPUs: 4\tStarting job",
             "2026-01-01 11:00:00\tJob ID: 2\t# GPUs: 2\tStarting job",
             "2026-01-01 11:30:00\tJob ID: 2\t# GPUs: 2\tSaved checkpoint\tIteration: 10\tJob throughput: 1.0 TFLOP/s/GPU"
             "\tCumulative throughput: 1.0 TFLOP/s/GPU\tFloating-point operations: 3.00e+15\tTokens (in billions): 0.01",
             "2026-01-01 12:00:00\tJob ID: 3\t# GPUs: 2\tStarting job"]
    (tmp_path / "progress.txt").write_text("\n".join(lines) + "\n")
    assert training.get_start_time_from_progress_log() == (datetime(2026, 1, 1, 11, 0, 0), 0.0)
    args.world_size = 8
    with pytest.raises(RuntimeError, match="no 'Starting job' line"):
        training.get_start_time_from_progress_log()

    class Chunk:
        def __init__(self):
            self.calls = []

        def enable_forward_pre_hook(self):
            self.calls.append("on")

        def disable_forward_pre_hook(self, param_sync=True):
            self.calls.append(("off", param_sync))

    chunks = [Chunk(), Chunk()]
    training.enable_forward_pre_hook(chunks)
    training.disable_forward_pre_hook(chunks, param_sync=False)
    assert all(c.calls == ["on", ("off", False)] for c in chunks)


def test_utils_helpers(capsys):
    init_single_rank()
    assert utils.reduce_max_stat_across_model_parallel_group(None) is None
    assert utils.reduce_max_stat_across_model_parallel_group(2.5) == 2.5
    assert utils.logical_and_across_model_parallel_group(True) is True

    params = [torch.nn.Parameter(torch.tensor([-1.0, 3.0])), torch.nn.Parameter(torch.tensor([[2.0]]))]
    params[0].tensor_model_parallel = True
    optimizer = argparse.Namespace(optimizer=torch.optim.SGD(params, lr=0.1))
    utils.print_params_min_max_norm(optimizer, 12)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "iteration, rank, index, tensor-model-parallel, min, max, norm"
    assert out[1] == "     12,    0,    1,  1, -1.000000E+00, 3.000000E+00, 3.162278E+00"
    assert out[2].startswith("     12,    0,    2,  0, 2.000000E+00")

    args = argparse.Namespace(ckpt_format="torch")
    utils.update_use_dist_ckpt(args)
    assert args.use_dist_ckpt is False
    args.ckpt_format = "torch_dist"
    utils.update_use_dist_ckpt(args)
    assert args.use_dist_ckpt is True

    with torch.device("meta"):
        module = torch.nn.Linear(3, 2)
    module.register_buffer("table", torch.arange(4.0))
    utils.to_empty_if_meta_device(module, device=torch.device("cpu"))
    assert module.weight.device.type == "cpu" and module.weight.shape == (2, 3)
    assert module.table.tolist() == [0.0, 1.0, 2.0, 3.0]  # a buffer with values keeps them (to_empty would not)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            utils.get_device_arch_version()


def test_checkpoint_paths(tmp_path):
    root = str(tmp_path)
    assert checkpointing.find_checkpoint_rank_0(root, 4) is None
    legacy = tmp_path / "iter_0000004" / "mp_rank_00_000"
    legacy.mkdir(parents=True)
    (legacy / "model_optim_rng.pt").write_bytes(b"")
    assert checkpointing.find_checkpoint_rank_0(root, 4) == str(legacy / "model_optim_rng.pt")
    assert checkpointing.isfile_(str(legacy / "model_optim_rng.pt")) and not checkpointing.isfile_(str(legacy))
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("4")
    args = argparse.Namespace(load=root, ckpt_step=None)
    assert checkpointing.get_load_checkpoint_path_by_args(args) == os.path.join(root, "iter_0000004")
    args.ckpt_step = 2
    assert checkpointing.get_load_checkpoint_path_by_args(args) == os.path.join(root, "iter_0000002")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release")
    args.ckpt_step = None
    assert checkpointing.get_load_checkpoint_path_by_args(args) == os.path.join(root, "release")


def test_async_utils():
    args = _args("--async-save")
    global_vars.set_args(args)
    done = []
    request = AsyncRequest(async_fn=lambda x: done.append(("wrote", x)), async_fn_args=(3,),
                           finalize_fns=[lambda: done.append("finalized")])
    async_utils.schedule_async_save(request)
    assert request.is_frozen and not async_utils.is_empty_async_queue()
    async_utils.maybe_finalize_async_save(blocking=True, terminate=True)
    assert done == [("wrote", 3), "finalized"] and async_utils.is_empty_async_queue()
    args.async_save = False
    async_utils.maybe_finalize_async_save(blocking=True)  # nothing to do without --async-save


def test_argument_helpers():
    assert moe_freq_type(3) == 3 and moe_freq_type("2") == 2
    assert moe_freq_type("([0]+[1]*2)*2") == [0, 1, 1, 0, 1, 1]
    assert no_rope_freq_type("[1,0]") == [1, 0]
    with pytest.raises(argparse.ArgumentTypeError):
        moe_freq_type("__import__('os')")  # Megatron evals the string; here only list expressions pass
    _check_arg_is_not_none(argparse.Namespace(load="x"), "load")
    with pytest.raises(ValueError, match="--save argument is None"):
        _check_arg_is_not_none(argparse.Namespace(save=None), "save")
