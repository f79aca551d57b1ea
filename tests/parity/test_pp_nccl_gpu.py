"""The toy pipeline parity cases on 2 GPUs with NCCL (batched and unbatched p2p, 1F1B and interleaved).

NCCL pairs same-peer p2p ops in issue order and ignores tags, so this checks the op ordering of
`p2p_communication` where gloo cannot (with PP=2 both neighbours are the same rank). Tolerance
1e-5: the reference runs on CPU, the stages on GPU, and fp32 kernels sum in a different order.
"""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.parity.test_pp_schedules_parity import _check_case, _run_case

pytestmark = pytest.mark.gpu

GPU_CASES = [
    dict(name="nccl-pp2-1f1b", pp=2, m=5, config=dict(deallocate_pipeline_outputs=True)),
    dict(name="nccl-pp2-1f1b-unbatched", pp=2, m=3, config=dict(batch_p2p_comm=False)),
    dict(name="nccl-pp2-vp2", pp=2, vp=2, m=4, config=dict(deallocate_pipeline_outputs=True)),
    dict(name="nccl-pp2-vp2-overlap-varlen", pp=2, vp=2, m=5, varlen=True,
         config=dict(microbatch_group_size_per_vp_stage=3, overlap_p2p_comm=True, batch_p2p_comm=False,
                     variable_seq_lengths=True)),
    dict(name="nccl-pp2-fwd", pp=2, vp=2, m=4, config={}, forward_only=True),
]


def _nccl_worker(rank, world_size, init_file, out_dir):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        results = [_run_case(case, device="cuda") for case in GPU_CASES]
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_pipeline_schedules_on_nccl():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_nccl_worker, args=(2, os.path.join(tmp, "rendezvous"), tmp), nprocs=2, join=True)
        results = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(2)]
    for index, case in enumerate(GPU_CASES):
        _check_case(case, [results[rank][index] for rank in range(2)], rtol=1e-5)
