"""Shared pytest setup: CPU-only by default, GPU tests skipped where no GPU is present."""
import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _reset_global_state():
    """Every test starts and ends without parallel_state, global args or a fused-kernel mode left over."""
    yield
    try:
        from megatron.core.fusions._compile import reset_fusion_kernels

        reset_fusion_kernels()
    except Exception:
        pass
    try:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    except Exception:
        pass
    try:
        from megatron.training import global_vars

        global_vars.destroy_global_vars()
    except Exception:
        pass
    try:
        import torch.distributed as dist

        # A process group left in this (parent) process would be inherited by forked ranks.
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
