"""The tensor-parallel checks of test_tensor_parallel_layers.py on CUDA with NCCL (skipped without 2 GPUs).

Same checks (fp32, TF32 off) at TP = number of GPUs (at most 4), plus a bf16 sequence-parallel
column -> row block with fused weight-gradient accumulation into fp32 `main_grad`.
"""
import os
import tempfile

import pytest
import torch

from tests.unit.tensor_parallel.test_tensor_parallel_layers import _tp_body


def _bf16_block_check(tp):
    from megatron.core import parallel_state as ps
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.utils import init_method_normal

    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    r = ps.get_tensor_model_parallel_rank()
    cfg = ModelParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=True, bf16=True,
                              params_dtype=torch.bfloat16, gradient_accumulation_fusion=True)
    torch.manual_seed(3)
    col = ColumnParallelLinear(64, 128, config=cfg, init_method=init_method_normal(0.05), bias=True)
    row = RowParallelLinear(128, 64, config=cfg, init_method=init_method_normal(0.05), bias=True,
                            input_is_parallel=True, skip_bias_add=False)
    assert col.weight.device.type == "cuda" and col.weight.dtype == torch.bfloat16
    for p in (col.weight, row.weight):
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device="cuda")
        p.grad_added_to_main_grad = False
    x = torch.randn(16, 2, 64, device="cuda", dtype=torch.bfloat16)
    x_local = x.chunk(tp, dim=0)[r].contiguous().requires_grad_()
    y, _ = row(col(x_local)[0])
    assert y.shape == (16 // tp, 2, 64) and y.dtype == torch.bfloat16
    y.float().pow(2).sum().backward()
    assert col.weight.main_grad.abs().sum() > 0 and row.weight.main_grad.abs().sum() > 0
    assert torch.isfinite(x_local.grad).all()
    ps.destroy_model_parallel()


def _gpu_rank(rank, world, init_file):
    import torch.distributed as dist

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        torch.set_default_device("cuda")
        _tp_body(tp_sizes=(world,))
        torch.set_default_device("cpu")
        _bf16_block_check(world)
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_tensor_parallel_layers_on_gpus_with_nccl():
    world = min(torch.cuda.device_count(), 4)
    if world < 2:
        pytest.skip("needs at least 2 GPUs")
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.spawn(_gpu_rank, args=(world, os.path.join(tmp, "rdzv")), nprocs=world, join=True)
