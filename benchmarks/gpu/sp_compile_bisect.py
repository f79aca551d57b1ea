"""Bisect the compiled sequence-parallel gradient bug on 2 GPUs (NCCL); not part of the product or of CI.

  PYTHONPATH=$PWD python benchmarks/gpu/sp_compile_bisect.py [--cpu]

Each case compiles a small function of sequence-parallel pieces and compares, after one backward, the
output, the input gradient and every parameter gradient with the same function run eagerly (printed as
relative errors; 1.0 = zero or missing gradient). `--cpu` runs the same cases on gloo with the NCCL code
branch of mappings.py forced (funcol), as a control.
"""
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.getcwd())

S, B, H = 16, 2, 64


def _rel(a, b):
    if a is None or b is None:
        return "None" if a is None else "ref-None"
    return f"{(a.float() - b.float()).norm().item() / max(b.float().norm().item(), 1e-12):.2e}"


def _config(dtype):
    from megatron.core.model_parallel_config import ModelParallelConfig

    return ModelParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True, params_dtype=dtype,
                               use_cpu_initialization=True, bf16=dtype == torch.bfloat16)


class ColRow(torch.nn.Module):
    def __init__(self, dtype, which):
        super().__init__()
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

        init = lambda w: torch.nn.init.normal_(w, std=0.1)  # noqa: E731
        cfg = _config(dtype)
        self.which = which
        self.col = ColumnParallelLinear(H, 2 * H, config=cfg, init_method=init, bias=True)
        self.row = RowParallelLinear(2 * H, H, config=cfg, init_method=init, bias=True, input_is_parallel=True,
                                     skip_bias_add=False)

    def forward(self, x):
        if self.which == "col":
            y, _ = self.col(x)
            return y
        if self.which == "row":
            return self.row(x.repeat(1, 1, 1))[0]
        y, _ = self.col(x)
        return self.row(torch.nn.functional.gelu(y))[0] + x


class Mappings(torch.nn.Module):
    def __init__(self, dtype, device):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(H, H, dtype=dtype, device=device) * 0.1)

    def forward(self, x):
        from megatron.core.tensor_parallel import mappings as m

        full = m.gather_from_sequence_parallel_region(x)  # [s/tp, b, h] -> [s, b, h]
        y = full @ self.w
        return m.reduce_scatter_to_sequence_parallel_region(y) + x  # [s, b, h] -> [s/tp, b, h]


def _case(label, make, rank, device, dtype, backend, in_width=H):
    torch.manual_seed(0)
    eager = make().to(device)
    torch.manual_seed(0)
    compiled_mod = make().to(device)
    compiled_mod.load_state_dict(eager.state_dict())
    gen = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(S // 2, B, in_width, generator=gen).to(device=device, dtype=dtype)
    dy = torch.randn_like(eager(x)).detach()
    results = []
    for mod, fn in ((eager, eager.forward), (compiled_mod, torch.compile(compiled_mod.forward, backend=backend))):
        xi = x.clone().requires_grad_(True)
        out = fn(xi)
        (out.float() * dy.float()).sum().backward()
        results.append((out.detach(), xi.grad, {n: p.grad for n, p in mod.named_parameters()}))
    (oe, ge, pe), (oc, gc, pc) = results
    report = {"out": _rel(oc, oe), "dx": _rel(gc, ge)}
    report.update({n: _rel(pc[n], pe[n]) for n in pe})
    if rank == 0:
        print(f"{label} [{backend}, {dtype}]: {report}", flush=True)


def _worker(rank, init_file, cpu):
    from megatron.core import parallel_state as ps

    if cpu:
        from megatron.core.tensor_parallel import mappings

        mappings._is_gloo = lambda g: False
        device = torch.device("cpu")
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    else:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=2)
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for backend in ("aot_eager", "inductor"):
            for label, make, width in (
                ("mappings", lambda: Mappings(dtype, device), H),
                ("col", lambda: ColRow(dtype, "col"), H),
                ("row", lambda: ColRow(dtype, "row"), H),
                ("col+row", lambda: ColRow(dtype, "both"), H),
            ):
                torch._dynamo.reset()
                try:
                    _case(label, make, rank, device, dtype, backend, width if label != "row" else H)
                except Exception as error:  # report and go on to the next case
                    if rank == 0:
                        print(f"{label} [{backend}, {dtype}]: ERROR {type(error).__name__}: {error}"[:400], flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    use_cpu = "--cpu" in sys.argv
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(os.path.join(tmp, "rendezvous"), use_cpu), nprocs=2, join=True)
