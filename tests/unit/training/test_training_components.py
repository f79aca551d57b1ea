"""Single-process checks of the training layer's pieces: timers, FLOPs, rerun checks, args as plain data,
checkpoint names, the log-line format."""
import argparse
import enum
import math
import time
import types

import pytest
import torch

from megatron.core.deferred_checks import get_deferred_checks
from megatron.core.rerun_state_machine import RerunMode, RerunStateMachine
from megatron.core.timers import DummyTimer, Timers
from megatron.training.checkpoint_args import args_to_plain_dict, plain_dict_to_args
from megatron.training.checkpointing import get_checkpoint_name, get_checkpoint_tracker_filename, read_metadata
from megatron.training.training_log import ADVANCED_ITERS_KEY, NAN_ITERS_KEY, SKIPPED_ITERS_KEY, _format_line
from megatron.training.training_log import num_floating_point_operations
from tests.functional.cli import LOG_LINE_RE, VALIDATION_RE


def test_timers_levels_format_and_write(capsys):
    timers = Timers(log_level=1, log_option="minmax")
    assert isinstance(timers("deep", log_level=2), DummyTimer)
    timer = timers("fwd", log_level=1)
    timer.start()
    time.sleep(0.02)
    timer.stop()
    with pytest.raises(RuntimeError):
        timer.stop()
    assert timers("fwd") is timer
    with pytest.raises(ValueError):
        timers("fwd", log_level=0)
    timers.log(["fwd", "never-started"], normalizer=2.0)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "(min, max) time across ranks (ms):"
    assert out[1].startswith("    fwd " + "." * 44 + ": (")
    low, high = (float(x) for x in out[1].split(": (")[1].rstrip(")").split(", "))
    assert 9.0 <= low == high < 1000.0  # 20 ms / normalizer 2
    assert len(out) == 2  # a timer that never ran is not printed
    assert timer.elapsed(reset=False) == 0.0  # log() reset it

    class Writer:
        scalars = {}

        def add_scalar(self, name, value, step):
            self.scalars[name] = (value, step)

    timers_max = Timers(log_level=2, log_option="max")
    t = timers_max("opt")
    t.start()
    t.stop()
    writer = Writer()
    timers_max.write(["opt"], writer, iteration=7)
    assert "opt-time" in writer.scalars and writer.scalars["opt-time"][1] == 7
    timers_max.log(["opt"])
    assert capsys.readouterr().out.startswith("max time across ranks (ms):\n    opt ")
    with pytest.raises(ValueError):
        Timers(0, "median")


def _flops_args(**overrides):
    values = dict(num_layers=4, hidden_size=256, num_attention_heads=8, kv_channels=32, ffn_hidden_size=1024,
                  seq_length=512, padded_vocab_size=32000, group_query_attention=False, num_query_groups=None,
                  num_experts=None, mtp_num_layers=None, moe_ffn_hidden_size=None,
                  moe_shared_expert_intermediate_size=None, swiglu=False, multi_latent_attention=False,
                  is_hybrid_model=False)
    values.update(overrides)
    return types.SimpleNamespace(**values)


def test_flops_formula_matches_closed_form_and_gqa_swiglu_moe():
    args = _flops_args()
    B, s, L, h, V = 8, 512, 4, 256, 32000
    closed = 72 * B * s * L * h * h * (1 + s / (12 * h) + V / (12 * L * h))
    assert math.isclose(num_floating_point_operations(args, B), closed, rel_tol=1e-12)
    assert args.num_query_groups == args.num_attention_heads  # Megatron mutates args without GQA
    gqa = _flops_args(group_query_attention=True, num_query_groups=2, swiglu=True, ffn_hidden_size=683)
    attn = 12 * L * h * h * (1 + 2 / 8 + s / (2 * h)) * (32 * 8 / h)
    mlp = 12 * L * h * 683 * 1.5
    logit = 6 * h * V
    assert math.isclose(num_floating_point_operations(gqa, B), B * s * (attn + mlp + logit), rel_tol=1e-12)
    moe = _flops_args(num_experts=4, moe_layer_freq=2, moe_router_topk=2, moe_ffn_hidden_size=512)
    dense_part = 12 * L * h * (1024 * 2 / 4 + 512 * 2 * 2 / 4)
    attn = 12 * L * h * h * (2 + s / (2 * h))
    assert math.isclose(num_floating_point_operations(moe, 1), s * (dense_part + attn + 6 * h * V), rel_tol=1e-12)


def test_theoretical_memory_report_writes_whole_lines(monkeypatch):
    """Each line of the memory report leaves in one write: under torchrun all ranks share one stdout, and a
    line written as text then newline let the last rank's iteration-1 log line land in between."""
    from megatron.training import theoretical_memory_usage

    writes = []

    class Recorder:
        def write(self, text):
            writes.append(text)

        def flush(self):
            pass

    monkeypatch.setattr("sys.stdout", Recorder())
    args = _flops_args(untie_embeddings_and_output_weights=False, tensor_model_parallel_size=2,
                       pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=None,
                       use_distributed_optimizer=False, sequence_parallel=True, recompute_granularity="selective",
                       micro_batch_size=2)
    theoretical_memory_usage.report_theoretical_memory(args, num_microbatches=4, verbose=True)
    assert len(writes) >= 6
    assert all(text.endswith("\n") and "\n" not in text[:-1].rstrip("\n") for text in writes), writes


def test_rerun_state_machine_nan_and_spiky_checks():
    machine = RerunStateMachine(mode=RerunMode.DISABLED)
    machine.validate_result(torch.tensor(1.0), torch.isnan, "ok")
    with pytest.raises(RuntimeError, match="found NaN"):
        machine.validate_result(torch.tensor(float("nan")), torch.isnan, "found NaN", fatal=True)
    assert machine.is_unexpectedly_large(torch.tensor(1e9), 10, "loss") is False  # first samples set the reference
    deferred = get_deferred_checks()
    deferred.enabled, deferred.device_types = True, ("cpu",)
    try:
        machine.current_iteration = 7
        machine.validate_result(torch.tensor(1.0), torch.isnan, "fine", fatal=True)
        machine.validate_result(torch.tensor(float("inf")), torch.isinf, "found Inf", fatal=True)
        machine.current_iteration = 8
        assert deferred.pending() == 2
        with pytest.raises(RuntimeError, match=r"iteration 7: Unexpected result inf \(message='found Inf'\)"):
            deferred.flush()
        deferred.flush()  # nothing left
    finally:
        deferred.enabled, deferred.device_types = False, ("cuda",)
        deferred.clear()
    active = RerunStateMachine(mode=RerunMode.VALIDATE_RESULTS)
    for value in (1.0, 2.0, 3.0):
        assert not active.is_unexpectedly_large(torch.tensor(value), 10, "loss", num_samples=3)
    assert not active.is_unexpectedly_large(torch.tensor(29.0), 10, "loss", num_samples=3)
    assert active.is_unexpectedly_large(torch.tensor(31.0), 10, "loss", num_samples=3)
    assert active.should_run_forward_backward(None) and not active.should_run_forward_backward(None)


class _Style(enum.Enum):
    fast = "fast"


def test_args_round_trip_as_plain_data(tmp_path):
    args = argparse.Namespace(params_dtype=torch.bfloat16, lr=1e-3, layers=[1, 2], style=_Style.fast, name=None,
                              tup=(1, "a"), flag=True, path=tmp_path)
    plain = args_to_plain_dict(args)
    assert plain["params_dtype"] == "torch.bfloat16" and plain["style"] == "fast" and plain["tup"] == [1, "a"]
    torch.save({"args": plain}, tmp_path / "x.pt")
    loaded = torch.load(tmp_path / "x.pt", weights_only=True)["args"]
    back = plain_dict_to_args(loaded)
    assert back.params_dtype is torch.bfloat16 and back.lr == 1e-3 and back.layers == [1, 2] and back.flag is True


def test_checkpoint_names_and_tracker(tmp_path):
    name = get_checkpoint_name("/ck", 20, pipeline_parallel=False, tensor_rank=1, pipeline_rank=0,
                               expert_parallel=False, expert_rank=0)
    assert name == "/ck/iter_0000020/mp_rank_01/model_optim_rng.pt"
    name = get_checkpoint_name("/ck", 3, pipeline_parallel=True, tensor_rank=0, pipeline_rank=2,
                               expert_parallel=True, expert_rank=1)
    assert name == "/ck/iter_0000003/mp_rank_00_002_001/model_optim_rng.pt"
    assert get_checkpoint_name("/ck", 0, release=True, return_base_dir=True) == "/ck/release"
    tracker = get_checkpoint_tracker_filename(str(tmp_path))
    assert tracker.endswith("latest_checkpointed_iteration.txt")
    with open(tracker, "w") as f:
        f.write("1000\n")
    assert read_metadata(tracker) == (1000, False)
    with open(tracker, "w") as f:
        f.write("release")
    assert read_metadata(tracker) == (0, True)
    with open(tracker, "w") as f:
        f.write("garbage")
    with pytest.raises(ValueError, match="latest_checkpointed_iteration.txt"):
        read_metadata(tracker)


def test_log_line_format_matches_megatron_regex():
    args = types.SimpleNamespace(train_iters=50, consumed_train_samples=80, skipped_train_samples=0,
                                 log_throughput=True, decoupled_lr=None)
    totals = {ADVANCED_ITERS_KEY: 4, SKIPPED_ITERS_KEY: 1, NAN_ITERS_KEY: 1,
              "lm loss": torch.tensor(34.0), "zero loss": torch.tensor(0.0)}
    line = _format_line(args, totals, 10, 0.1234, 5.0, 1e-3, None, 8, 1.0, 0.5, None, None)
    match = LOG_LINE_RE.match(line)
    assert match is not None, line
    assert match["iteration"] == "10" and match["train_iters"] == "50" and match["elapsed_ms"] == "123.4"
    assert " lm loss: 8.500000E+00 |" in line and "zero loss" not in line  # zero averages are not printed
    assert match["tflops"] == "5.0" and match["skipped"] == "1" and match["nan"] == "1"
    assert "lm loss" not in totals  # the interval accumulator was consumed
    block = " validation loss at iteration 5 | lm loss value: 2.000000E+00 | lm loss PPL: 7.389056E+00 | "
    assert VALIDATION_RE.match(block)
