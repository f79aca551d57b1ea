"""FP8 GEMMs with `--tp-comm-overlap` on 2 GPUs with NCCL in bf16 (the GPU half of the FP8 overlap parity).

Each rank trains the TP=2 + SP FP8 models of the CPU parity test (GPT tensorwise, Llama delayed with full
recompute) with and without `--tp-comm-overlap` (the plan's transport on GPUs; the FP8 pipelines move uint8
FP8 chunks over NCCL send/recv), three SGD-with-momentum steps. The FP8 bytes are the same in both; what may
differ is the bf16 rounding of per-chunk GEMMs (the FP8 GEMM may pick another kernel for fewer rows). The
bound is measured, not assumed: overlap vs no overlap must stay within a tenth of the deviation of the FP8
run from the bf16 run (TP=2 + SP both), i.e. far below what FP8 itself changes.
"""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.parity.test_tp_gpt_parity import _rel_err, _train

pytestmark = pytest.mark.gpu

CASES = [("gpt", "gpt-fp8", None), ("llama", "llama-fp8d", "full-block")]  # name, FP8 kind, recompute


def _worst(got, want):
    loss = max(abs(a[0] - b[0]) / abs(b[0]) for a, b in zip(got, want))
    grad = max(_rel_err(a[1][name], b[1][name]) for a, b in zip(got, want) for name in a[1])
    return loss, grad


def _worker(rank, world_size, init_file, out_dir):
    from megatron.core import parallel_state as ps

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=2)
        group = ps.get_tensor_model_parallel_group()
        results = {}
        for name, kind, recompute in CASES:
            runs = {sp: _train(kind, 2, sp, 0.0, 0.0, recompute, group, device="cuda", dtype=torch.bfloat16)
                    for sp in (True, "overlap")}
            bf16 = _train(name, 2, True, 0.0, 0.0, recompute, group, device="cuda", dtype=torch.bfloat16)
            results[name] = {"overlap": _worst(runs["overlap"], runs[True]), "fp8": _worst(runs[True], bf16)}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_fp8_tp2_overlap_on_nccl_matches_fp8_without_overlap():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(2, os.path.join(tmp, "rendezvous"), tmp), nprocs=2, join=True)
        saved = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=True) for r in range(2)]
    for rank, results in enumerate(saved):
        for name, result in results.items():
            (loss_err, grad_err), (loss_fp8, grad_fp8) = result["overlap"], result["fp8"]
            print(f"rank {rank} {name}: FP8 overlap vs FP8 loss {loss_err:.1e} grad {grad_err:.1e}; FP8 vs bf16 "
                  f"loss {loss_fp8:.1e} grad {grad_fp8:.1e}")
            assert loss_err <= max(0.1 * loss_fp8, 1e-4), f"rank {rank} {name}: loss error {loss_err:.2e}"
            assert grad_err <= 0.1 * grad_fp8, f"rank {rank} {name}: gradient error {grad_err:.2e}"
