"""`pretrain` in this process with feature flag sets: the Llama-style model, bf16 with fp32 master weights,
timers, and SIGTERM -> checkpoint -> exit."""
import os
import signal

import pytest
import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing
from megatron.core.optimizer import Float16OptimizerWithFloat16Params
from megatron.training import training
from megatron.training.global_vars import get_args
from tests.functional.cli import LOG_LINE_RE, reset_training_state, run_pretrain_in_process

TINY = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 2 --global-batch-size 4 --mock-data --tokenizer-type NullTokenizer --vocab-size 4096 "
    "--eval-iters 0 --seed 3"
).split()
LLAMA = (
    "--normalization RMSNorm --swiglu --position-embedding-type rope --group-query-attention --num-query-groups 2 "
    "--disable-bias-linear --untie-embeddings-and-output-weights --qk-layernorm"
).split()


@pytest.fixture(scope="module", autouse=True)
def _destroy_process_group_at_end():
    yield
    reset_training_state()
    if dist.is_initialized():
        dist.destroy_process_group()


def _log_lines(text):
    return [LOG_LINE_RE.match(line) for line in text.splitlines() if line.startswith(" [") and "iteration" in line]


def test_llama_flag_set_trains_and_logs(capsys):
    code, losses = run_pretrain_in_process(
        TINY + LLAMA + ["--seq-length", "32", "--max-position-embeddings", "32", "--vocab-size", "8191",
                        "--train-iters", "12", "--lr", "1e-2", "--lr-decay-style", "constant", "--log-interval", "4",
                        "--timing-log-level", "2"])
    assert code is None and len(losses) == 24
    per_iter = [(losses[2 * i][0] + losses[2 * i + 1][0]) / (losses[2 * i][1] + losses[2 * i + 1][1])
                for i in range(12)]
    assert sum(per_iter[-3:]) < sum(per_iter[:3]) - 0.15, per_iter
    out = capsys.readouterr().out
    lines = _log_lines(out)
    assert len(lines) == 3 and all(lines), out[-3000:]
    # The logged value is the token-weighted mean over the 4 iterations of the interval (§12.1).
    logged = float(lines[-1]["losses"].split(": ")[1].split(" |")[0])
    expected = sum(per_iter[8:12]) / 4
    assert abs(logged - expected) < 1e-5 * expected
    assert "    forward-backward ..." in out and "    forward-compute ..." in out and "    optimizer ..." in out
    args = get_args()
    assert args.swiglu and args.num_query_groups == 2 and args.normalization == "RMSNorm"


def test_bf16_fp32_master_weights_and_sigterm_checkpoint(tmp_path, monkeypatch, capsys):
    captured = {}
    original_setup = training.setup_model_and_optimizer

    def capture_setup(*a, **k):
        captured["result"] = original_setup(*a, **k)
        return captured["result"]

    monkeypatch.setattr(training, "setup_model_and_optimizer", capture_setup)
    calls = []

    def send_sigterm_at_third_iteration(model):
        calls.append(1)
        if len(calls) == 5:  # first microbatch of iteration 3
            os.kill(os.getpid(), signal.SIGTERM)

    save = str(tmp_path / "ckpt")
    code, losses = run_pretrain_in_process(
        TINY + ["--bf16", "--train-iters", "20", "--lr", "1e-3", "--log-interval", "1", "--save", save,
                "--save-interval", "100", "--exit-signal-handler", "--transformer-impl", "local"],
        hook=send_sigterm_at_third_iteration)
    assert code == 0, "SIGTERM must save and exit with status 0"
    model, optimizer, _ = captured["result"]
    params = list(model[0].parameters())
    assert params and all(p.dtype == torch.bfloat16 for p in params)
    assert isinstance(optimizer, Float16OptimizerWithFloat16Params)
    masters = [p for group in optimizer.optimizer.param_groups for p in group["params"]]
    assert masters and all(p.dtype == torch.float32 for p in masters)
    assert len(losses) == 6 and all(torch.isfinite(torch.tensor(x[0])) for x in losses)
    out = capsys.readouterr().out
    lines = _log_lines(out)
    assert [int(m["iteration"]) for m in lines] == [1, 2, 3] and all(m["loss_scale"] == "1.0" for m in lines)
    assert "exiting program after receiving SIGTERM." in out
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read() == "3"
    ckpt_dir = os.path.join(save, "iter_0000003")  # the default --ckpt-format torch_dist
    assert dist_checkpointing.check_is_distributed_checkpoint(ckpt_dir)
    args = dist_checkpointing.load_common_state_dict(ckpt_dir)["args"]
    args = args if isinstance(args, dict) else vars(args)
    assert args["bf16"] is True and str(args["params_dtype"]) == "torch.bfloat16"
    tensors = dist_checkpointing.load_tensors_metadata(ckpt_dir)
    weights = {k: v for k, v in tensors.items() if k.endswith(".weight") and not k.startswith("optimizer.")}
    assert weights and all(v.dtype == torch.bfloat16 for v in weights.values()), weights
    masters = {k: v for k, v in tensors.items() if k.startswith("optimizer.state.fp32_param.")}
    assert masters and all(v.dtype == torch.float32 for v in masters.values())
    assert signal.getsignal(signal.SIGTERM) is not None


@pytest.mark.slow
def test_wandb_offline_run_is_written(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    code, _ = run_pretrain_in_process(
        TINY + ["--train-iters", "2", "--lr", "1e-3", "--log-interval", "1", "--wandb-project", "p",
                "--wandb-exp-name", "e", "--wandb-save-dir", str(tmp_path)])
    assert code is None
    runs = list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    assert runs and runs[0].stat().st_size > 0
