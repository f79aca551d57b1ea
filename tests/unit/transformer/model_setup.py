"""Shared setup of the model tests: a one-rank gloo process group and TP=PP=1 parallel state.

`init_single_rank()` creates the process group (file:// rendezvous, no ports) when none exists and
(re)initialises parallel_state and the RNG trackers. `teardown_single_rank()` (run after every test by
the conftest files of tests/unit/transformer and tests/unit/models) destroys what it created, so other
test files in the same pytest process start from a clean torch.distributed.
"""
import itertools
import os
import tempfile

import torch
import torch.distributed as dist

from megatron.core import parallel_state, tensor_parallel

_INIT_DIR = tempfile.mkdtemp(prefix="megatron_model_tests_")
_COUNTER = itertools.count()
_STATE = {"owns_process_group": False}


def init_single_rank(seed: int = 1234, **parallel_kwargs) -> None:
    """Initialise a 1-rank gloo world (if none exists), parallel_state and the RNG trackers."""
    if not dist.is_initialized():
        init_file = os.path.join(_INIT_DIR, f"rendezvous_{next(_COUNTER)}")
        dist.init_process_group(backend="gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
        _STATE["owns_process_group"] = True
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(**parallel_kwargs)
    seed_all(seed)


def teardown_single_rank() -> None:
    """Destroy parallel_state and the process group if `init_single_rank` created it."""
    if not _STATE["owns_process_group"]:
        return
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    _STATE["owns_process_group"] = False


def seed_all(seed: int) -> None:
    """Seed torch and the model-parallel RNG trackers."""
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def apply_plan(model, device=None, compile_backend: str = "inductor", **decisions):
    """Resolve and apply the optimisation plan to a built model (a module or a list of chunks), as
    `get_model` does; `device` (a `DeviceFacts`) replaces the facts read from the model, and `decisions`
    replace plan rows (`compile_layers=Decision(True, "test")`). Returns the model and the plan."""
    import dataclasses

    from megatron.core.optimization_plan.apply import apply_optimization_plan, device_facts_of
    from megatron.core.optimization_plan.resolve import resolve_plan

    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    plan = resolve_plan(chunks[0].config, device if device is not None else device_facts_of(chunks))
    if decisions:
        plan = dataclasses.replace(plan, **decisions)
    apply_optimization_plan(chunks, plan, compile_backend=compile_backend)
    return model, plan
