"""Run `pretrain_gpt.py` as a subprocess (plain python or torchrun) and parse its log lines.

`run_pretrain(flags, nproc=None)` returns a `RunResult` with the exit code, the combined output, the
parsed training log lines (`iterations`), and the validation blocks (`validations`). The regex is
Megatron's log line format, so a format drift fails the tests that use it.
"""
import os
import re
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

import pretrain_gpt
from megatron.core import parallel_state, rerun_state_machine
from megatron.core.enums import ModelType
from megatron.training import global_vars
from tests.harness import repo_root

LOG_LINE_RE = re.compile(
    r"^ \[(?P<date>\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2})\]"
    r" iteration +(?P<iteration>\d+)/ *(?P<train_iters>\d+) \|"
    r" consumed samples: +(?P<consumed>\d+) \|"
    r"(?: skipped samples: +\d+ \|)?"
    r" elapsed time per iteration \(ms\): (?P<elapsed_ms>[0-9.]+) \|"
    r"(?: throughput per GPU \(TFLOP/s/GPU\): (?P<tflops>[0-9.]+) \|)?"
    r" learning rate: (?P<lr>[0-9.]+E[+-]\d+) \|"
    r"(?: decoupled learning rate: [0-9.]+E[+-]\d+ \|)?"
    r" global batch size: +(?P<gbs>\d+) \|"
    r"(?P<losses>(?: [a-z0-9_ \-]+: [0-9.]+E[+-]\d+ \|)*)"
    r" loss scale: (?P<loss_scale>[0-9.]+) \|"
    r"(?: grad norm: (?P<grad_norm>[0-9.]+|nan|inf) \|)?"
    r"(?: num zeros: \d+ \|)?"
    r"(?: params norm: (?P<params_norm>[0-9.]+) \|)?"
    r" number of skipped iterations: +(?P<skipped>\d+) \|"
    r" number of nan iterations: +(?P<nan>\d+) \|$"
)
LOSS_RE = re.compile(r" ([a-z0-9_ \-]+): ([0-9.]+E[+-]\d+) \|")
VALIDATION_RE = re.compile(
    r"^ validation loss at (?P<prefix>.+?) \| lm loss value: (?P<value>[0-9.]+E[+-]\d+) \|"
    r" lm loss PPL: (?P<ppl>[0-9.]+E[+-]\d+) \| $"
)


@dataclass
class RunResult:
    """Outcome of one subprocess run."""

    returncode: int
    """Exit status of the process."""
    output: str
    """stdout, then stderr."""
    iterations: List[Dict[str, str]] = field(default_factory=list)
    """One regex group dict per training log line (plus a parsed `loss_values` dict)."""
    validations: List[Dict[str, str]] = field(default_factory=list)
    """One group dict per validation block line."""
    unmatched_log_lines: List[str] = field(default_factory=list)
    """Lines that start like a log line but do not match the format."""


def parse_output(output: str) -> RunResult:
    """Parse training log lines and validation blocks out of a run's output."""
    result = RunResult(returncode=0, output=output)
    for line in output.splitlines():
        line = line.rstrip("\n")
        if re.match(r"^ \[\d{4}-\d{2}-\d{2} [0-9:]+\] iteration", line):
            match = LOG_LINE_RE.match(line)
            if match is None:
                result.unmatched_log_lines.append(line)
                continue
            entry = match.groupdict()
            entry["loss_values"] = {k: float(v) for k, v in LOSS_RE.findall(entry["losses"] or "")}
            result.iterations.append(entry)
        match = VALIDATION_RE.match(line)
        if match is not None:
            result.validations.append(match.groupdict())
    return result


def _env(extra_env: Optional[Dict[str, str]]) -> Dict[str, str]:
    env = dict(os.environ)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    env["PYTHONPATH"] = repo_root() + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra_env or {})
    return env


def command(flags: List[str], nproc: Optional[int] = None, script: str = "pretrain_gpt.py") -> List[str]:
    """The argv: `python script flags` or `python -m torch.distributed.run --nproc-per-node N script flags`."""
    script_path = os.path.join(repo_root(), script)
    if nproc is None:
        return [sys.executable, script_path, *flags]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
            str(_free_port()), script_path, *flags]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_pretrain(flags: List[str], nproc: Optional[int] = None, timeout: float = 600,
                 extra_env: Optional[Dict[str, str]] = None, script: str = "pretrain_gpt.py") -> RunResult:
    """Run the script and parse its output (never raises on a non-zero exit; check `returncode`). A launch
    whose rendezvous port was taken between `_free_port` and the launcher's bind runs again on another port."""
    for _ in range(2):
        proc = subprocess.run(command(flags, nproc, script), cwd=repo_root(), env=_env(extra_env),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout)
        if nproc is None or proc.returncode == 0 or "EADDRINUSE" not in proc.stderr + proc.stdout:
            break
    # log lines are parsed from stdout alone: another rank's warning on the shared stderr could land inside one
    result = parse_output(proc.stdout)
    result.output = proc.stdout + proc.stderr
    result.returncode = proc.returncode
    return result


def reset_training_state() -> None:
    """Forget globals of a previous in-process run (the process group itself stays up)."""
    parallel_state.destroy_model_parallel()
    global_vars.destroy_global_vars()
    rerun_state_machine.destroy_rerun_state_machine()


def run_pretrain_in_process(flags: List[str], record_losses: bool = True, hook=None):
    """Call `pretrain` of pretrain_gpt.py in this process with `flags`.

    Returns `(exit_code, losses)`: exit_code is None when pretrain returned normally (else the SystemExit
    code), and losses is a list of `(loss_sum, num_tokens)` float pairs, one per training microbatch, read
    from the exact tensors the loss function returned. `hook(model)`, when given, runs before every forward.
    """
    losses = []

    def forward_step(data_iterator, model):
        if hook is not None:
            hook(model)
        output_tensor, loss_fn = pretrain_gpt.forward_step(data_iterator, model)

        def recording_loss_fn(output):
            loss, num_tokens, report = loss_fn(output)
            if torch.is_grad_enabled() and record_losses:
                losses.append((loss.detach().double().item(), num_tokens.item()))
            return loss, num_tokens, report

        return output_tensor, recording_loss_fn

    reset_training_state()
    saved_argv = sys.argv
    sys.argv = ["pretrain_gpt.py", *flags]
    exit_code = None
    try:
        pretrain_gpt.train_valid_test_datasets_provider.is_distributed = True
        pretrain_gpt.pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
                              ModelType.encoder_or_decoder, forward_step,
                              args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    except SystemExit as exc:
        exit_code = exc.code
    finally:
        sys.argv = saved_argv
    return exit_code, losses
