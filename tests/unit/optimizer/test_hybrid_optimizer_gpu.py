"""`HybridDeviceOptimizer` with CUDA params (skipped without a GPU): pinned host copies, asynchronous copies on the
current stream or on side streams (overlap), against plain optimizers that make the same split by hand (torch's
fused AdamW on the CPU for the host part, on the GPU for the rest): equal bit for bit. Gradients are written by
GPU kernels right before each step and the params are read right after it, so a missing stream wait shows.

  python -m pytest -q tests/unit/optimizer/test_hybrid_optimizer_gpu.py
"""
import pytest
import torch

from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

pytestmark = pytest.mark.gpu

SHAPES = [(1024, 1024), (4096,), (512, 2048), (1000,)]  # 1048576, 4096, 1048576, 1000 elements
KWARGS = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)


def _grad(index, step, shape):
    numel = torch.Size(shape).numel()
    ramp = torch.arange(numel, device="cuda", dtype=torch.float32)
    return torch.sin(ramp * (0.001 * (index + 1)) + step).view(shape)


def _case(dtype, fraction, overlap, pin, steps=3):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, device="cuda").to(dtype)) for shape in SHAPES]
    hybrid = HybridDeviceOptimizer([{"params": params}], offload_fraction=fraction,
                                   cpu_optimizer_cls=torch.optim.AdamW, gpu_optimizer_cls=torch.optim.AdamW,
                                   param_update_in_fp32=True, pin_cpu_grads=pin, pin_cpu_params=pin,
                                   overlap_cpu_optimizer_d2h_h2d=overlap, **KWARGS)
    # The split by hand: offload while fewer than fraction x all elements are offloaded.
    threshold, offloaded, on_host = fraction * sum(p.numel() for p in params), 0, []
    for param in params:
        on_host.append(offloaded < threshold)
        offloaded += param.numel() if on_host[-1] else 0
    masters = [torch.nn.Parameter(p.detach().to("cpu" if host else "cuda", torch.float32, copy=True))
               for p, host in zip(params, on_host)]
    plain = [torch.optim.AdamW([{"params": [m for m, h in zip(masters, on_host) if h == host]}], **KWARGS)
             for host in (True, False) if host in on_host]
    for step in range(steps):
        for index, (param, master) in enumerate(zip(params, masters)):
            grad = _grad(index, step, param.shape)
            param.grad = grad.to(dtype)
            master.grad = grad.to(dtype).float().to(master.device)
        hybrid.step()
        hybrid.zero_grad()
        sums = [p.float().sum() for p in params]  # read on the current stream right after the step
        for opt in plain:
            opt.step()
        for param, master, total in zip(params, masters, sums):
            want = master.detach().to("cuda", dtype)
            assert torch.equal(param.detach(), want), (dtype, fraction, overlap, pin, step)
            assert torch.equal(total, want.float().sum()), "the step's uploads were not awaited"
    inner = [hybrid.param_to_inner_param[p] for p in params]
    assert [t.device.type == "cpu" for t in inner] == on_host
    assert all(t.is_pinned() == pin for t, host in zip(inner, on_host) if host)
    assert (hybrid._transfers.download_stream is not None) == overlap


@pytest.mark.parametrize("overlap", [False, True], ids=["same-stream", "overlap"])
def test_cuda_params_match_the_split_done_by_hand(overlap):
    for dtype in (torch.float32, torch.bfloat16):
        for fraction in (0.0, 0.5, 1.0):
            _case(dtype, fraction, overlap, pin=True)
    _case(torch.bfloat16, 0.5, overlap, pin=False)
