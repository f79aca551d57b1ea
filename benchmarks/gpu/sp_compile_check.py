"""Diagnose compiled tensor-parallel layers on 2 GPUs with NCCL (not part of the product or of CI).

  PYTHONPATH=$PWD python benchmarks/gpu/sp_compile_check.py

Trains the tiny GPT of the TP parity test for three SGD steps in bf16: TP=1 eager (the reference), TP=1
with compiled layers, TP=2 with compiled layers without and with sequence parallelism. Prints, from rank
0, the losses next to the reference, the gradient-norm ratio of one weight in each layer (1.0 = right,
0.0 = the layer got no gradient) and the three largest relative gradient errors of the first step.
On 2026-11-30 (before the functional-collective change in tensor_parallel/mappings.py) the last case gave
ratio 0.0 for every layer; see megatron/core/transformer/layer_compile.py. Compilation is the plan's
`--compile-layers on` (the parity test's `_train(..., compile_layers=...)`).
"""
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.getcwd())
from tests.parity.test_tp_gpt_parity import _rel_err, _train  # noqa: E402


def _report(rank, label, got, ref):
    if rank:
        return
    ratios = []
    for layer in (0, 1):
        name = f"decoder.layers.{layer}.mlp.linear_fc2.weight"
        ratios.append(round(got[0][1][name].norm().item() / ref[0][1][name].norm().item(), 4))
    errors = sorted(((_rel_err(got[0][1][k], ref[0][1][k]), k) for k in got[0][1]), reverse=True)[:3]
    losses = [(round(a[0], 4), round(b[0], 4)) for a, b in zip(got, ref)]
    print(f"{label}: losses {losses} fc2 grad-norm ratio per layer {ratios} worst {errors}", flush=True)


def _worker(rank, init_file):
    from megatron.core import parallel_state as ps

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=2)
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    ref = _train("gpt", 1, False, 0.0, 0.0, None, device="cuda", dtype=torch.bfloat16, compile_layers="off")
    compiled = _train("gpt", 1, False, 0.0, 0.0, None, device="cuda", dtype=torch.bfloat16, compile_layers="on")
    _report(rank, "TP=1 compiled", compiled, ref)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    group = ps.get_tensor_model_parallel_group()
    for sp in (False, True):
        torch._dynamo.reset()
        got = _train("gpt", 2, sp, 0.0, 0.0, None, group, device="cuda", dtype=torch.bfloat16, compile_layers="on")
        _report(rank, f"TP=2 sequence_parallel={sp} compiled", got, ref)
    # The same with the block's model-parallel RNG fork (entered only under sequence parallelism) left out.
    import megatron.core.tensor_parallel as tp_module
    from contextlib import nullcontext

    class _NoFork:
        def fork(self, name=None):
            return nullcontext()

    tracker = tp_module.get_cuda_rng_tracker
    tp_module.get_cuda_rng_tracker = lambda: _NoFork()
    torch._dynamo.reset()
    got = _train("gpt", 2, True, 0.0, 0.0, None, group, device="cuda", dtype=torch.bfloat16, compile_layers="on")
    _report(rank, "TP=2 sequence_parallel=True compiled, no RNG fork", got, ref)
    tp_module.get_cuda_rng_tracker = tracker
    dist.destroy_process_group()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(os.path.join(tmp, "rendezvous"),), nprocs=2, join=True)
