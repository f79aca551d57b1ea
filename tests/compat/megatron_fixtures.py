"""Helpers for the tests over the checkpoints Megatron-LM 0.13.1 wrote (`shared/fixtures/megatron/`).

- `FIXTURES`, `expected()`: the folder and its `expected.json` (flags, Megatron's printed losses).
- `extract(case, root)`: unpack one case's archive (once per session, by the tests' fixture).
- `run(flags)`: `pretrain` of pretrain_gpt.py in this process, returning the exit code, the per-microbatch
  training losses, the printed validation/test losses and the model and optimizer it built.
- `optimizer_state_mismatch(...)`: compare the optimizer state a run loaded with the checkpoint's tensors,
  rebuilt in model space by plain reshapes (independent of the loader).
"""
import contextlib
import io
import json
import os
import tarfile
from typing import Dict, List, Tuple

import torch

from megatron.core import dist_checkpointing
from megatron.core.optimizer.sharded_state import model_space_state_shards, param_to_sharded_map, state_tensors
from megatron.training import training
from megatron.training.utils import unwrap_model
from tests.functional.cli import VALIDATION_RE, run_pretrain_in_process
from tests.harness import repo_root

FIXTURES = os.path.normpath(os.path.join(repo_root(), "..", "shared", "fixtures", "megatron"))
DENSE = ("gpt_fp32_torch_dist", "gpt_bf16_distopt", "gpt_torch_legacy", "llama_bf16_distopt")


def available() -> bool:
    """True when the fixtures folder is present (CI machines without it skip these tests)."""
    return os.path.isfile(os.path.join(FIXTURES, "expected.json"))


def expected() -> Dict:
    """`expected.json`."""
    with open(os.path.join(FIXTURES, "expected.json")) as f:
        return json.load(f)


def flags(case: str, *extra: str) -> List[str]:
    """Megatron's command line of `case` (`common_flags` + its `extra`), then `extra`."""
    spec = expected()
    return [*spec["common_flags"], *spec["cases"][case]["extra"], *extra]


def extract(case: str, root: str) -> str:
    """Unpack the archive of `case` under `root`; returns the checkpoint folder (holding the tracker)."""
    target = os.path.join(root, case)
    with tarfile.open(os.path.join(FIXTURES, expected()["cases"][case]["archive"])) as tar:
        tar.extractall(target, filter="data")
    (inner,) = os.listdir(target)
    return os.path.join(target, inner)


def run(run_flags: List[str]):
    """(exit code, [(loss sum, tokens)] per training microbatch, {"valid", "test": loss}, {"model", "optimizer"}).

    Validation and test losses come from the lines `pretrain` prints ("... on validation set | lm loss value:
    ..."), on the last rank only; the model and optimizer are the ones `setup_model_and_optimizer` built and
    loaded."""
    built = {}
    original = training.setup_model_and_optimizer

    def capture(*args, **kwargs):
        model, optimizer, scheduler = original(*args, **kwargs)
        built.update(model=model, optimizer=optimizer)
        return model, optimizer, scheduler

    training.setup_model_and_optimizer = capture
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            code, losses = run_pretrain_in_process(run_flags)
    finally:
        training.setup_model_and_optimizer = original
    evaluations = {}
    for line in out.getvalue().splitlines():
        match = VALIDATION_RE.match(line)
        if match is not None and match["prefix"].endswith("on validation set"):
            evaluations["valid"] = float(match["value"])
        elif match is not None and match["prefix"].endswith("on test set"):
            evaluations["test"] = float(match["value"])
    return code, losses, evaluations, built


def iteration_losses(losses: List[Tuple[float, float]], per_iteration: int) -> List[float]:
    """Mean loss of each iteration from per-microbatch (loss sum, tokens) pairs."""
    groups = [losses[i:i + per_iteration] for i in range(0, len(losses), per_iteration)]
    return [sum(x[0] for x in g) / sum(x[1] for x in g) for g in groups]


def _model_space(stored: torch.Tensor, global_shape: Tuple[int, ...]) -> torch.Tensor:
    """A stored optimizer tensor in model space: N-D flattened [*S, numel of chunk] with chunks G // S becomes G."""
    if stored.dim() == len(global_shape):
        return stored
    fragments = stored.shape[:-1]
    chunk = [g // f for g, f in zip(global_shape, fragments)]
    n = len(global_shape)
    # [*S, prod(C)] -> [*S, *C] -> [S0, C0, S1, C1, ...] -> [*G]
    interleaved = [axis for pair in zip(range(n), range(n, 2 * n)) for axis in pair]
    return stored.reshape(*fragments, *chunk).permute(*interleaved).reshape(global_shape)


def optimizer_state_mismatch(checkpoint_dir: str, built: Dict) -> Tuple[float, int]:
    """(largest absolute difference, number of tensors compared) between every optimizer state tensor the run
    loaded (exp_avg, exp_avg_sq and, where the optimizer keeps one, fp32_param) and the checkpoint's tensors.

    Works for a distributed optimizer at DP=1 (each rank owns whole params) and the non-distributed ones."""
    stored = dist_checkpointing.load_plain_tensors(checkpoint_dir)
    chunks = unwrap_model(built["model"])
    param_map = param_to_sharded_map({i: chunk.sharded_state_dict() for i, chunk in enumerate(chunks)})
    worst, compared = 0.0, 0
    for opt in getattr(built["optimizer"], "chained_optimizers", [built["optimizer"]]):
        with_main = type(opt).__name__ != "FP32Optimizer"
        entries = []
        for model, main, start, stop in opt._model_and_main_params():
            assert (start, stop) == (0, model.numel()), "the check needs whole params on every rank (DP=1)"
            entries.append((model, start, stop, state_tensors(opt.optimizer, main, with_main_param=with_main)))
        for shard in model_space_state_shards(entries, param_map, sharded_over_dp=False).values():
            reference = _model_space(stored[shard.key], tuple(shard.global_shape))
            region = reference[tuple(slice(o, o + s) for o, s in zip(shard.global_offset, shard.chunk_shape()))]
            worst = max(worst, (region.reshape(shard.local_shape) - shard.data).abs().max().item())
            compared += 1
    return worst, compared


__all__ = ["FIXTURES", "DENSE", "available", "expected", "flags", "extract", "run", "iteration_losses",
           "optimizer_state_mismatch"]
