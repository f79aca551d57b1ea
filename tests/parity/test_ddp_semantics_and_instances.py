"""DDP grad-sync semantics and the partial distributed optimizer (--num-distributed-optimizer-instances),
on 4 gloo ranks in one launch.

What Megatron 0.13.1 does, and what each check below holds this framework to:
- Without `overlap_grad_reduce`, backward only accumulates into `param.main_grad` (and clears
  `param.grad`); nothing is communicated until `finish_grad_sync()` (or `start_grad_sync()`, which then
  runs the whole reduction synchronously): each bucket is multiplied by 1/DP and summed over DP, i.e.
  every rank ends with the DP mean of the accumulated local gradients. `register_grad_ready` is an error
  without overlap. `no_sync()` only marks non-final microbatches, `scale_gradients(f)` multiplies the
  buffers, `zero_grad_buffer()` zeroes them and resets `grad_added_to_main_grad` and the readiness
  bookkeeping, `broadcast_params()` copies DP rank 0's parameters.
- A parameter that gets no gradient in a step (unused by this rank's forward) keeps a zero `main_grad`;
  without overlap it simply enters the mean as zero. With overlap its bucket never becomes ready, so
  `finish_grad_sync()` fails ("Communication call has not been issued for this bucket ..."); a gradient
  registered twice in one step is an error too.
- With N distributed-optimizer instances the DP x CP group is split into N contiguous instances:
  gradients are reduce-scattered inside an instance, all-reduced across instances (the expert-DP-derived
  inter-instance group), the optimizer state is sharded inside an instance only, grad norms are reduced
  over the instance, and parameters are all-gathered inside it. Losses, gradients and parameters equal the
  single-process run (DP=4 with 2 instances vs DP=1, several steps), and checkpoints (torch_dist and the
  legacy format with distrib_optim.pt) save and resume, also into another instance count (torch_dist).

Tolerances: 1e-6 relative for losses and parameters (fp32; only the order of the DP sums differs, ~1e-7),
1e-5 relative for per-step gradient shards (the same rounding, seen through Adam's updated parameters).
"""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from tests.harness import run_on_ranks
from tests.unit.distributed import dp_toy

TOL, GRAD_TOL = 1e-6, 1e-5
STEPS, GLOBAL_BATCH, NUM_MICRO = 3, 8, 2


def _gathered(tensor):
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(out, tensor.contiguous())
    return out


def _local_backward(ddp, batch, micro):
    tokens = batch["tokens"].chunk(dist.get_world_size())[dist.get_rank()].chunk(NUM_MICRO)[micro]
    mask = batch["mask"].chunk(dist.get_world_size())[dist.get_rank()].chunk(NUM_MICRO)[micro]
    total, count = dp_toy.microbatch_loss(ddp, tokens, mask)
    (total / 10.0).backward()


def _flat_main_grads(ddp):
    return torch.cat([p.main_grad.detach().flatten().clone() for p in ddp.params_with_grad])


def _check_sync_without_overlap(report):
    """No communication before finish/start_grad_sync; then the DP mean (1/DP pre-scaling + SUM)."""
    batches = dp_toy.global_batches(1, GLOBAL_BATCH, seed=3)
    _, ddp, _ = dp_toy.build(dict())
    ddp.zero_grad_buffer()
    with ddp.no_sync():
        _local_backward(ddp, batches[0], 0)
    first = _flat_main_grads(ddp)
    assert all(p.grad is None for p in ddp.params_with_grad), "the hook moves .grad into main_grad"
    _local_backward(ddp, batches[0], 1)  # last microbatch: still no communication without overlap
    local = _flat_main_grads(ddp)
    assert not torch.equal(local, first), "the second microbatch accumulates"
    everyone = _gathered(local)
    assert not all(torch.equal(everyone[0], g) for g in everyone[1:]), "nothing was reduced during backward"
    assert all(g.grad_reduce_handle is None for g in ddp.bucket_groups)
    with pytest.raises(RuntimeError, match="only used with overlap_grad_reduce"):
        ddp.bucket_groups[0].register_grad_ready(ddp.params_with_grad[0])
    ddp.finish_grad_sync()
    mean = torch.stack(everyone).sum(0) / dist.get_world_size()
    torch.testing.assert_close(_flat_main_grads(ddp), mean, rtol=1e-6, atol=1e-7)

    ddp.zero_grad_buffer()
    _local_backward(ddp, batches[0], 1)
    everyone = _gathered(_flat_main_grads(ddp))
    ddp.start_grad_sync()  # synchronous: the reduction is complete when it returns
    assert all(g.grad_reduce_handle is None for g in ddp.bucket_groups)
    torch.testing.assert_close(_flat_main_grads(ddp), torch.stack(everyone).mean(0), rtol=1e-6, atol=1e-7)
    before = _flat_main_grads(ddp)
    ddp.scale_gradients(0.5)
    assert torch.equal(_flat_main_grads(ddp), before * 0.5)
    for param in ddp.params_with_grad:
        param.grad_added_to_main_grad = True
    ddp.bucket_groups[0].is_last_microbatch = False
    ddp.zero_grad_buffer()
    assert not _flat_main_grads(ddp).any() and not any(p.grad_added_to_main_grad for p in ddp.params_with_grad)
    assert all(g.is_last_microbatch and not g.params_with_grad for g in ddp.bucket_groups)
    report["sync_without_overlap"] = True


class _TwoBranches(torch.nn.Module):
    """`branch` is used only when `use_branch` is set: a parameter that gets no gradient on some ranks."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.trunk = torch.nn.Linear(4, 4)
        self.branch = torch.nn.Linear(4, 4)
        self.use_branch = True

    def forward(self, x):
        y = self.trunk(x)
        return y + self.branch(x) if self.use_branch else y


def _check_unused_parameters(report):
    """Without overlap an unused parameter enters the DP mean with a zero gradient; with overlap its bucket
    is never launched and finish_grad_sync raises (Megatron asserts); a double registration is an error."""
    rank, world = dist.get_rank(), dist.get_world_size()
    config = dp_toy.ToyConfig()
    model = _TwoBranches()
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    model.use_branch = rank == 0
    x = torch.full((2, 4), float(rank + 1))
    ddp.zero_grad_buffer()
    model(x).sum().backward()
    local = model.branch.weight.main_grad.clone()
    assert rank == 0 or not local.any(), "an unused parameter keeps a zero main_grad"
    ddp.finish_grad_sync()
    torch.testing.assert_close(model.branch.weight.main_grad, _gathered(local)[0] / world)

    model = _TwoBranches()
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=1), model)
    assert len(ddp.bucket_groups) == 4
    model.use_branch = False  # on every rank, so every rank skips the same bucket
    ddp.zero_grad_buffer()
    model(x).sum().backward()
    launched = {p: g.grad_reduce_handle is not None for p, g in ddp.param_to_bucket_group.items()}
    assert launched[model.trunk.weight] and launched[model.trunk.bias]
    assert not launched[model.branch.weight] and not launched[model.branch.bias]
    trunk_group = ddp.param_to_bucket_group[model.trunk.weight]
    with pytest.raises(RuntimeError, match="Cannot set grad twice"):
        trunk_group.register_grad_ready(model.trunk.weight)
    with pytest.raises(RuntimeError, match=r"Communication call has not been issued for this bucket \(0/1 params"):
        ddp.finish_grad_sync()
    for group in ddp.bucket_groups:  # let the launched collectives finish before the next check
        for handle in group.grad_reduce_handles:
            handle.wait()
        group.grad_reduce_handles = []
    # Inside no_sync a ready gradient is not registered (only the last microbatch launches collectives).
    ddp.zero_grad_buffer()
    with ddp.no_sync():
        model(x).sum().backward()
    assert all(g.grad_reduce_handle is None and not g.params_with_grad for g in ddp.bucket_groups)

    torch.manual_seed(rank)
    model = _TwoBranches.__new__(_TwoBranches)
    torch.nn.Module.__init__(model)
    model.trunk, model.branch, model.use_branch = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), True
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    ddp.broadcast_params()
    mine = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert all(torch.equal(mine, g) for g in _gathered(mine)), "broadcast_params copies DP rank 0's params"
    report["unused_parameters"] = True


def _train_capturing(ddp, optimizer, batches, groups=None, shards=None):
    """dp_toy's loop, also returning each step's gradients (after finalize, before the step) and grad norm."""
    dp_group = parallel_state.get_data_parallel_group() if groups is None else groups.dp
    dp_size, dp_rank = dp_group.size(), dist.get_rank(dp_group)
    losses, grads, norms = [], [], []
    for batch in batches:
        tokens, mask = batch["tokens"].chunk(dp_size)[dp_rank], batch["mask"].chunk(dp_size)[dp_rank]
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        loss_sum = torch.zeros(2)
        pieces = list(zip(tokens.chunk(NUM_MICRO), mask.chunk(NUM_MICRO)))
        for micro, (tok, msk) in enumerate(pieces):
            with ddp.no_sync() if micro < len(pieces) - 1 else torch.enable_grad():
                total, count = dp_toy.microbatch_loss(ddp, tok, msk)
                (total * dp_size / batch["mask"].sum()).backward()
            loss_sum += torch.stack([total.detach(), count])
        finalize_model_grads([ddp], pg_collection=None if groups is None else groups.finalize)
        step_grads = {}
        for name, param in ddp.module.named_parameters():
            if param.requires_grad:
                start, stop = shards(param) if shards else (0, param.numel())
                step_grads[name] = (start, param.main_grad.detach().flatten()[start:stop].clone())
        grads.append(step_grads)
        _, grad_norm, _ = optimizer.step()
        norms.append(float(grad_norm))
        dist.all_reduce(loss_sum, group=dp_group)
        losses.append((loss_sum[0] / loss_sum[1]).item())
    return losses, grads, norms


def _grad_diff(grads, ref_grads):
    worst = 0.0
    for step, ref in zip(grads, ref_grads):
        for name, (start, shard) in step.items():
            expected = ref[name][1][start:start + shard.numel()]
            if shard.numel():
                worst = max(worst, ((shard - expected).abs().max() / ref[name][1].abs().max()).item())
    return worst


def _check_two_instances_toy(report):
    """DP=4 split into 2 instances vs the single-process run: losses, grad shards, grad norms, params."""
    batches = dp_toy.global_batches(STEPS, GLOBAL_BATCH, seed=21)
    single = dp_toy.single_rank_groups()
    model, ddp, opt = dp_toy.build(dict(), groups=single)
    ref_losses, ref_grads, ref_norms = _train_capturing(ddp, opt, batches, groups=single)
    ref_params = dp_toy.params_of(model)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(num_distributed_optimizer_instances=2)
    intra = parallel_state.get_intra_distributed_optimizer_instance_group()
    inter = parallel_state.get_inter_distributed_optimizer_instance_group()
    rank = dist.get_rank()
    assert dist.get_process_group_ranks(intra) == ([0, 1] if rank < 2 else [2, 3])
    assert dist.get_process_group_ranks(inter) == [rank % 2, rank % 2 + 2]
    for name, kwargs in {
        "sync": dict(),
        "overlap_buckets_param_gather": dict(overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=100),
        "average_in_collective": dict(average_in_collective=True, overlap_grad_reduce=True, bucket_size=100),
    }.items():
        kwargs = dict(kwargs, use_distributed_optimizer=True, num_distributed_optimizer_instances=2)
        model, ddp, opt = dp_toy.build(kwargs)
        assert opt.data_parallel_group.size() == 2 and opt.distributed_optimizer_instance_id == rank // 2
        assert opt.grad_stats_parallel_group is intra
        assert all(b.data_parallel_world_size == 2 for b in ddp.buffers)

        def owned(param, opt=opt):
            if param not in opt.model_param_gbuf_map:
                return 0, 0
            piece = opt._get_model_param_range_map(param)["param"]
            return piece.start, piece.end

        losses, grads, norms = _train_capturing(ddp, opt, batches, shards=owned)
        if ddp.use_forward_hook:
            ddp.disable_forward_pre_hook(param_sync=True)
        loss_diff = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        norm_diff = max(abs(float(a) - float(b)) / float(b) for a, b in zip(norms, ref_norms))
        param_diff = dp_toy.max_rel_diff(dp_toy.params_of(model), ref_params)
        grad_diff = _grad_diff(grads, ref_grads)
        report[f"two_instances_{name}"] = (loss_diff, grad_diff, norm_diff, param_diff)
        assert max(loss_diff, param_diff, norm_diff) <= TOL and grad_diff <= GRAD_TOL, report[f"two_instances_{name}"]
        owned_numel = sum(b - a for a, b in map(owned, ddp.params_with_grad))
        total = sum(buffer.numel for buffer in ddp.buffers)
        assert owned_numel <= total // 2, "each rank owns at most its instance share (1/2) of every bucket"
        everyone = _gathered(torch.tensor([owned_numel]))
        assert everyone[0] + everyone[1] == everyone[2] + everyone[3] == sum(p.numel() for p in ddp.params_with_grad)


FLAGS = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 1 --global-batch-size 8 --lr 1e-2 --min-lr 1e-3 --lr-decay-style cosine --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 4095 --log-interval 100 --eval-iters 0 --transformer-impl local "
    "--seed 11 --attention-dropout 0 --hidden-dropout 0 --train-iters 4 --use-distributed-optimizer "
    "--overlap-grad-reduce --overlap-param-gather --ddp-bucket-size 4000"
).split()


def _iteration_losses(losses):
    """Global (all-rank) loss of each iteration from this rank's per-microbatch (sum, tokens) pairs."""
    per_iteration = GLOBAL_BATCH // dist.get_world_size()
    values = torch.tensor([[sum(x[0] for x in losses[i:i + per_iteration]), sum(x[1] for x in losses[i:i + per_iteration])]
                           for i in range(0, len(losses), per_iteration)], dtype=torch.float64)
    dist.all_reduce(values)
    return (values[:, 0] / values[:, 1]).tolist()


def _pretrain(extra):
    from tests.functional.cli import reset_training_state, run_pretrain_in_process

    instances = int(extra.split("--num-distributed-optimizer-instances ")[1].split()[0])
    seen = []

    def hook(model):
        # The run really shards over DP / instances ranks and all-reduces across instances.
        seen.append([buffer.data_parallel_world_size for buffer in model.buffers])
        assert model.ddp_config.num_distributed_optimizer_instances == instances
        assert all(g.inter_distributed_optimizer_instance_group is not None for g in model.bucket_groups) == (
            instances > 1)

    code, losses = run_pretrain_in_process(FLAGS + extra.split(), hook=hook)
    assert seen and all(sizes == [dist.get_world_size() // instances] for sizes in seen), seen
    assert code is None, code
    values = _iteration_losses(losses)
    reset_training_state()
    return values


def _check_instances_cli(directory, report):
    """pretrain_gpt with --num-distributed-optimizer-instances 2 (DP=4): the loss curve of one instance
    (within 1e-6), resume from torch_dist (same and other instance count) and from the legacy format."""
    one = _pretrain("--num-distributed-optimizer-instances 1")
    two = _pretrain(f"--num-distributed-optimizer-instances 2 --save {directory}/dist --save-interval 2")
    report["cli_curve_one_vs_two_instances"] = max(abs(a - b) / b for a, b in zip(one, two))
    assert report["cli_curve_one_vs_two_instances"] <= TOL, (one, two)
    for name, extra in {
        "torch_dist_2_to_2": f"--num-distributed-optimizer-instances 2 --load {directory}/dist --ckpt-step 2",
        "torch_dist_2_to_1": f"--num-distributed-optimizer-instances 1 --load {directory}/dist --ckpt-step 2",
    }.items():
        resumed = _pretrain(extra)
        report[f"cli_resume_{name}"] = max(abs(a - b) / b for a, b in zip(resumed, two[2:]))
        assert len(resumed) == 2 and report[f"cli_resume_{name}"] <= TOL, (resumed, two)
    legacy = "--num-distributed-optimizer-instances 2 --ckpt-format torch"
    full = _pretrain(f"{legacy} --save {directory}/legacy --save-interval 2")
    assert os.path.isfile(f"{directory}/legacy/iter_0000002/mp_rank_00/distrib_optim.pt")
    resumed = _pretrain(f"{legacy} --load {directory}/legacy --ckpt-step 2")
    report["cli_resume_legacy_2_to_2"] = max(abs(a - b) / b for a, b in zip(full[:2] + resumed, two))
    assert len(resumed) == 2 and report["cli_resume_legacy_2_to_2"] <= TOL, (full, resumed, two)


def _four_ranks(directory):
    report = {}
    parallel_state.initialize_model_parallel()
    _check_sync_without_overlap(report)
    _check_unused_parameters(report)
    _check_two_instances_toy(report)
    parallel_state.destroy_model_parallel()
    _check_instances_cli(directory, report)
    return report


def test_ddp_semantics_and_two_optimizer_instances():
    """DP=4: DDP sync semantics and unused parameters; 2 optimizer instances vs DP=1; CLI runs and resumes."""
    directory = tempfile.mkdtemp(prefix="instances_")
    reports = run_on_ranks(_four_ranks, 4, directory, timeout=480)
    for name, value in reports[0].items():
        print(f"{name}: {value}")
