"""The CUDA/NCCL paths of data parallelism (2 GPUs): async NCCL reduce-scatter/all-gather into bucket
views, native ReduceOp.AVG, bf16 parameter all-gather, distrib_optim.pt through the gloo DP group.

Each rank trains a DP=1 reference on its own GPU (DDP over an NCCL group of one) and then each variant at
DP=2. cuBLAS may pick different kernels for different batch sizes, so the fp32 tolerance is 1e-5.
"""
import os
import tempfile
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallelConfig, TorchFullyShardedDataParallel
from tests.unit.distributed import dp_toy

TOL = 1e-5
VARIANTS = {
    "allreduce": dict(),
    "overlap_buckets": dict(overlap_grad_reduce=True, bucket_size=100),
    "distopt_overlap_param_gather": dict(
        use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=100
    ),
    "distopt_average_in_collective": dict(use_distributed_optimizer=True, average_in_collective=True),
}


def _finished(ddp, model):
    if ddp.use_forward_hook:
        ddp.disable_forward_pre_hook(param_sync=True)
    return dp_toy.params_of(model)


def _fsdp2_run(batches, device, per_token):
    """FSDP2 on NCCL; per-token loss sums gradients in the reduce-scatter (divide factor 1)."""
    torch.manual_seed(0)
    model = dp_toy.ToyLM(dp_toy.ToyConfig(calculate_per_token_loss=per_token)).to(device)
    wrapped = TorchFullyShardedDataParallel(
        model.config, DistributedDataParallelConfig(), model, sub_modules_to_wrap={torch.nn.Linear}
    )
    opt = torch.optim.AdamW([p for p in wrapped.parameters() if p.requires_grad], lr=1e-2)
    rank, size = dist.get_rank(), dist.get_world_size()
    losses = []
    for batch in batches:
        tokens, mask = batch["tokens"].chunk(size)[rank].to(device), batch["mask"].chunk(size)[rank].to(device)
        opt.zero_grad()
        total, count = dp_toy.microbatch_loss(wrapped, tokens, mask)
        (total if per_token else total * size / batch["mask"].sum().to(device)).backward()
        dp_toy.finalize_model_grads([wrapped], num_tokens=count.clone() if per_token else None)
        opt.step()
        stats = torch.stack([total.detach(), count])
        dist.all_reduce(stats)
        losses.append((stats[0] / stats[1]).item())
    return losses, {name: p.full_tensor().detach().float().cpu() for name, p in model.named_parameters()}


def _suite(rank, world_size, init_file, out_dir):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=120))
    parallel_state.initialize_model_parallel(create_gloo_process_groups=True)
    batches = dp_toy.global_batches(3, 8)
    single = dp_toy.single_rank_groups()
    device = torch.device("cuda", rank)
    ref_model, ref_ddp, ref_opt = dp_toy.build({}, groups=single, device=device)
    ref_losses = dp_toy.train_steps(ref_ddp, ref_opt, batches, 2, groups=single)
    ref_params = dp_toy.params_of(ref_model)
    report = {}
    for name, kwargs in VARIANTS.items():
        model, ddp, opt = dp_toy.build(kwargs, device=device)
        losses = dp_toy.train_steps(ddp, opt, batches, 2)
        loss_diff = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        report[name] = (loss_diff, dp_toy.max_rel_diff(_finished(ddp, model), ref_params))
    bf16 = dict(grad_reduce_in_fp32=True, overlap_grad_reduce=True, bucket_size=100)
    model_a, ddp_a, opt_a = dp_toy.build(bf16, dtype=torch.bfloat16, device=device)
    dp_toy.train_steps(ddp_a, opt_a, batches, 2)
    model_b, ddp_b, opt_b = dp_toy.build(dict(bf16, use_distributed_optimizer=True), dtype=torch.bfloat16, device=device)
    dp_toy.train_steps(ddp_b, opt_b, batches, 2)
    report["bf16_distopt_vs_float16_optimizer"] = (0.0, dp_toy.max_rel_diff(dp_toy.params_of(model_b), dp_toy.params_of(model_a)))
    path = os.path.join(out_dir, "distrib_optim.pt")
    opt_b.save_parameter_state(path)
    state = opt_b.state_dict()
    _, _, opt_c = dp_toy.build(dict(bf16, use_distributed_optimizer=True), dtype=torch.bfloat16, device=device, seed=3)
    opt_c.load_state_dict(state)
    opt_c.load_parameter_state(path)
    same = all(torch.equal(a, b) for ga, gb in zip(opt_b.shard_fp32_from_float16_groups, opt_c.shard_fp32_from_float16_groups)
               for a, b in zip(ga, gb))
    report["distrib_optim_roundtrip"] = (0.0, 0.0 if same else 1.0)
    mean_losses, mean_params = _fsdp2_run(batches, device, per_token=False)
    token_losses, token_params = _fsdp2_run(batches, device, per_token=True)
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(token_losses, mean_losses))
    report["fsdp2_per_token_vs_mean"] = (loss_diff, dp_toy.max_rel_diff(token_params, mean_params))
    torch.save(report, os.path.join(out_dir, f"report_{rank}.pt"))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.mark.gpu
def test_dp2_nccl_matches_single_gpu():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_suite, args=(2, os.path.join(tmp, "rendezvous"), tmp), nprocs=2, join=True)
        reports = [torch.load(os.path.join(tmp, f"report_{r}.pt"), weights_only=True) for r in range(2)]
    for name, (loss_diff, param_diff) in reports[0].items():
        print(f"NCCL DP=2 {name}: loss {loss_diff:.2e} params {param_diff:.2e}")
    for report in reports:
        for name, (loss_diff, param_diff) in report.items():
            assert loss_diff <= TOL and param_diff <= TOL, f"{name}: {loss_diff:.2e} {param_diff:.2e}"
