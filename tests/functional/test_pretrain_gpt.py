"""`pretrain_gpt.py` as users run it: plain python and torchrun command lines on CPU.

The issue's command line is used as written; the python run adds only evaluation and TensorBoard flags
(the default --eval-iters 100 would spend most of the test budget on the final evaluation).
"""
import glob
import math
import os

import pytest

from tests.functional.cli import run_pretrain

DONE_WHEN = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 "
    "--micro-batch-size 4 --global-batch-size 8 --train-iters 50 --lr 1e-3 --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 8191 --log-interval 10"
).split()


def _check_log(result, train_iters, log_interval, gbs=8):
    assert result.returncode == 0, result.output[-4000:]
    assert not result.unmatched_log_lines, result.unmatched_log_lines
    iterations = [int(x["iteration"]) for x in result.iterations]
    assert iterations == list(range(log_interval, train_iters + 1, log_interval)), result.output[-3000:]
    for entry in result.iterations:
        assert int(entry["train_iters"]) == train_iters and int(entry["gbs"]) == gbs
        assert int(entry["consumed"]) == int(entry["iteration"]) * gbs
        assert entry["loss_scale"] == "1.0" and entry["skipped"] == "0" and entry["nan"] == "0"
        assert math.isfinite(entry["loss_values"]["lm loss"]) and float(entry["grad_norm"]) > 0
    return [x["loss_values"]["lm loss"] for x in result.iterations]


def test_done_when_command_line_plain_python(tmp_path):
    tb_dir = str(tmp_path / "tb")
    result = run_pretrain(DONE_WHEN + ["--eval-iters", "1", "--eval-interval", "25", "--tensorboard-dir", tb_dir])
    losses = _check_log(result, train_iters=50, log_interval=10)
    assert losses[-1] < losses[0] - 0.3, f"loss did not fall: {losses}"
    assert "INFO: no CUDA device is available, so torch.distributed uses the gloo backend" in result.output
    assert " > number of parameters on (tensor, pipeline) model parallel rank (0, 0): " in result.output
    prefixes = [v["prefix"] for v in result.validations]
    assert prefixes == ["iteration 25", "iteration 50", "iteration 50 on validation set", "iteration 50 on test set"]
    block = [line for line in result.output.splitlines() if line.startswith(" validation loss at iteration 25 |")][0]
    lines = result.output.splitlines()
    index = lines.index(block)
    assert lines[index - 1] == lines[index + 1] == "-" * (len(block) + 1)
    for value in result.validations:
        assert math.isclose(float(value["ppl"]), math.exp(min(20.0, float(value["value"]))), rel_tol=1e-5)

    event_files = glob.glob(os.path.join(tb_dir, "events.out.tfevents.*"))
    assert event_files, "no TensorBoard event file written"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(tb_dir)
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    for key in ("learning-rate", "batch-size", "lm loss", "loss-scale", "grad-norm", "lm loss vs samples",
                "lm loss validation"):
        assert key in scalars, sorted(scalars)
    assert [e.step for e in events.Scalars("lm loss")] == list(range(1, 51))


def test_done_when_command_line_under_torchrun():
    flags = DONE_WHEN + ["--train-iters", "10", "--log-interval", "5", "--eval-iters", "0", "--log-throughput"]
    result = run_pretrain(flags, nproc=1)
    _check_log(result, train_iters=10, log_interval=5)
    assert all(float(x["tflops"]) >= 0.0 for x in result.iterations)


def test_bad_command_line_lists_every_problem_and_exits_2():
    flags = [f for f in DONE_WHEN] + ["--num-attention-heads", "5", "--tensor-model-parallel-size", "2",
                                      "--save", "/tmp/never-written", "--no-such-flag", "1"]
    result = run_pretrain(flags, timeout=300)
    assert result.returncode == 2, result.output[-3000:]
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if ": error: " in line]
    assert len(errors) == 1, result.output[-3000:]
    for fragment in ("--no-such-flag", "--num-attention-heads (5) must be divisible by --tensor-model-parallel-size",
                     "--save", "--save-interval"):
        assert fragment in result.output
    assert not os.path.exists("/tmp/never-written")


@pytest.mark.slow
def test_done_when_command_line_exactly_as_written():
    result = run_pretrain(DONE_WHEN)
    losses = _check_log(result, train_iters=50, log_interval=10)
    assert losses[-1] < losses[0]


def test_fp8_command_line_tracks_bf16_under_data_parallelism():
    """`--fp8-format hybrid` (delayed scaling; the emulated FP8 GEMMs on CPU) with DP=2 and the distributed
    optimizer: the weight gradients reach DDP's main_grad buffers, and the loss and gradient-norm curves
    follow the bf16 run's (Adam hides a wrongly scaled gradient in the loss; the grad norm shows it)."""
    flags = DONE_WHEN + ["--train-iters", "20", "--log-interval", "5", "--eval-iters", "0", "--bf16",
                         "--use-distributed-optimizer", "--micro-batch-size", "2"]
    curves = []
    for extra in ([], ["--fp8-format", "hybrid"]):
        result = run_pretrain(flags + extra, nproc=2)
        losses = _check_log(result, train_iters=20, log_interval=5)
        curves.append((losses, [float(x["grad_norm"]) for x in result.iterations]))
    (bf16_loss, bf16_norm), (fp8_loss, fp8_norm) = curves
    print(f"bf16 {curves[0]} fp8 {curves[1]}")
    assert fp8_loss[-1] < fp8_loss[0] - 0.2, f"loss did not fall: {fp8_loss}"
    assert fp8_loss != bf16_loss, "the FP8 run computed exactly the bf16 numbers: were its GEMMs FP8 at all?"
    assert max(abs(a - b) for a, b in zip(fp8_loss, bf16_loss)) < 0.01, f"fp8 {fp8_loss} vs bf16 {bf16_loss}"
    assert max(abs(a / b - 1) for a, b in zip(fp8_norm, bf16_norm)) < 0.05, f"fp8 {fp8_norm} vs bf16 {bf16_norm}"
