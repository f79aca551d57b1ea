"""Data parallelism vs a single-process reference, on gloo, same global batch: two launches.

- World 2 (DP=2): every DDP / distributed-optimizer variant, per-token loss, gradient-accumulation
  fusion, bf16, no_sync, NaN / large-grad checks, broadcast_params, distrib_optim.pt save + resume,
  buffer layout rules, FSDP2, optimizer-state memory.
- World 8 (TP=2 x DP=4 toy variants, two optimizer instances, memory; finalize_model_grads at
  TP=2 x PP=2 x DP=2; a tiny GPTModel at TP=2 x PP=2 x DP=2 with the distributed optimizer).

Every rank first trains a DP=1 reference (DDP over a group of one, itself checked against a plain-torch
loop), then each variant, on the same fixed batches. Losses and parameters after 3 AdamW steps (fp32)
must agree within 1e-6 relative: the only differences are the order of floating-point sums (a 2- or
4-way reduction instead of one local sum), which is ~1e-7.
"""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.deferred_checks import get_deferred_checks
from megatron.core.distributed import DistributedDataParallelConfig, TorchFullyShardedDataParallel, param_and_grad_buffer
from tests.harness import run_on_ranks
from tests.unit.distributed import dp_gpt, dp_toy

TOL = 1e-6
# The GPT run also splits matmul sums over TP and reduce-scatters SP activations: a few 1e-7 more.
GPT_TOL = 2e-6
STEPS = 3
GLOBAL_BATCH = 8
NUM_MICRO = 2

VARIANTS = {
    "allreduce": dict(),
    "overlap_buckets": dict(overlap_grad_reduce=True, bucket_size=100),
    "distopt": dict(use_distributed_optimizer=True),
    "distopt_overlap_param_gather": dict(
        use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=100
    ),
    "average_in_collective": dict(average_in_collective=True, overlap_grad_reduce=True, bucket_size=100),
    "distopt_average_in_collective": dict(use_distributed_optimizer=True, average_in_collective=True),
}


def _plain_torch_reference(batches, hidden, clip=True):
    """The same training without any Megatron code: loss.backward, clip, AdamW with Megatron's groups."""
    torch.manual_seed(0)
    model = dp_toy.ToyLM(dp_toy.ToyConfig(), hidden=hidden)
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim > 1]
    no_decay = [p for p in params if p.ndim <= 1]
    opt = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-2, weight_decay=0.01)
    losses = []
    for batch in batches:
        opt.zero_grad()
        total, count = dp_toy.microbatch_loss(model, batch["tokens"], batch["mask"])
        (total / count).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append((total / count).item())
    return losses, dp_toy.params_of(model)


def _compare(name, losses, params, ref_losses, ref_params, report):
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    param_diff = dp_toy.max_rel_diff(params, ref_params)
    report[name] = (loss_diff, param_diff)
    if loss_diff > TOL or param_diff > TOL:
        raise AssertionError(f"{name}: loss rel diff {loss_diff:.2e}, param rel diff {param_diff:.2e} > {TOL}")


def _run_variant(kwargs, batches, per_token=False, fused_wgrad=None, groups=None, hidden=16):
    config = dp_toy.ToyConfig(calculate_per_token_loss=per_token)
    model, ddp, opt = dp_toy.build(kwargs, config=config, fused_wgrad=fused_wgrad, groups=groups, hidden=hidden)
    losses = dp_toy.train_steps(ddp, opt, batches, NUM_MICRO, per_token=per_token, groups=groups)
    if ddp.use_forward_hook:
        # The last step's all-gather is waited for in the next forward; finish it before reading params.
        ddp.disable_forward_pre_hook(param_sync=True)
    return losses, dp_toy.params_of(model), ddp, opt


def _check_bf16_distopt(batches, report):
    """bf16 params with fp32 grad buffers at DP=2: the distributed optimizer (fp32 main shards, bf16
    all-gather) vs Float16OptimizerWithFloat16Params on the same DP=2 layout. Both see the same bf16
    forward/backward, so only the reduce-scatter vs all-reduce summation can differ."""
    ddp_kwargs = dict(grad_reduce_in_fp32=True, overlap_grad_reduce=True, bucket_size=100)
    ref_model, ref_ddp, ref_opt = dp_toy.build(ddp_kwargs, dtype=torch.bfloat16)
    ref_losses = dp_toy.train_steps(ref_ddp, ref_opt, batches, NUM_MICRO)
    model, ddp, opt = dp_toy.build(dict(ddp_kwargs, use_distributed_optimizer=True), dtype=torch.bfloat16)
    losses = dp_toy.train_steps(ddp, opt, batches, NUM_MICRO)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert ddp.buffers[0].grad_dtype == torch.float32 and ddp.buffers[0].param_data.dtype == torch.bfloat16
    main_shards = [t for group in opt.shard_fp32_from_float16_groups for t in group]
    assert main_shards and all(t.dtype == torch.float32 for t in main_shards)
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    param_diff = dp_toy.max_rel_diff(dp_toy.params_of(model), dp_toy.params_of(ref_model))
    report["bf16_distopt_vs_float16_optimizer"] = (loss_diff, param_diff)
    assert loss_diff <= TOL and param_diff <= TOL, report["bf16_distopt_vs_float16_optimizer"]


def _check_no_sync_and_overlap(batches, report):
    """With overlap, no collective may start inside no_sync; after the last backward all have started."""
    model, ddp, opt = dp_toy.build(dict(overlap_grad_reduce=True, bucket_size=100))
    seen = []

    def probe(step, micro):
        launched = [g.grad_reduce_handle is not None for g in ddp.bucket_groups]
        seen.append((micro, launched))

    dp_toy.train_steps(ddp, opt, batches[:1], NUM_MICRO, probe=probe)
    assert len(ddp.bucket_groups) > 2, f"bucket_size=100 should split the params over several buckets: {len(ddp.bucket_groups)}"
    for micro, launched in seen:
        if micro < NUM_MICRO - 1:
            assert not any(launched), f"a collective was launched inside no_sync (microbatch {micro})"
        else:
            assert all(launched), "with overlap_grad_reduce every bucket must be launched during the last backward"
    report["no_sync_overlap_buckets"] = len(ddp.bucket_groups)


def _check_nan_detection():
    model, ddp, opt = dp_toy.build(dict(check_for_nan_in_grad=True))
    ddp.zero_grad_buffer()
    total, _ = dp_toy.microbatch_loss(ddp, dp_toy.global_batches(1, 2)[0]["tokens"], torch.ones(2, dp_toy.SEQ))
    total.backward()
    model.final_scale.main_grad[0] = float("nan")
    with pytest.raises(RuntimeError, match=f"Rank {dist.get_rank()}: found NaN in local grad norm"):
        ddp.finish_grad_sync()

    deferred = get_deferred_checks()  # the CUDA behaviour: no host read until flush()
    deferred.enabled, deferred.device_types = True, ("cpu",)
    try:
        ddp.zero_grad_buffer()
        total, _ = dp_toy.microbatch_loss(ddp, dp_toy.global_batches(1, 2)[0]["tokens"], torch.ones(2, dp_toy.SEQ))
        total.backward()
        model.final_scale.main_grad[0] = float("inf")
        ddp.finish_grad_sync()
        assert deferred.pending() == len(ddp.bucket_groups)
        with pytest.raises(RuntimeError, match=r"found Inf in local grad norm for bucket #\d+ .*final_scale"):
            deferred.flush()
        assert deferred.pending() == 0
    finally:
        deferred.enabled, deferred.device_types = False, ("cuda",)
        deferred.clear()

    param_and_grad_buffer._LARGE_GRAD_WINDOW = 2
    model, ddp, _ = dp_toy.build(dict(check_for_large_grads=True))
    for scale in (1.0, 2.0, 1.5):
        ddp.zero_grad_buffer()
        model.final_scale.main_grad.fill_(scale)
        ddp.finish_grad_sync()
    ddp.zero_grad_buffer()
    model.final_scale.main_grad.fill_(100.0)
    with pytest.raises(RuntimeError, match=f"Rank {dist.get_rank()}: found unexpectedly large grad norm"):
        ddp.finish_grad_sync()


def _check_broadcast_params():
    model, ddp, _ = dp_toy.build(dict(), seed=dist.get_rank())
    ddp.broadcast_params()
    mine = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    assert all(torch.equal(g, gathered[0]) for g in gathered), "broadcast_params left ranks with different params"


def _memory_ratio(batches, report, dp):
    single = dp_toy.single_rank_groups()
    _, ddp_ref, opt_ref = dp_toy.build(dict(), hidden=64, groups=single)
    dp_toy.train_steps(ddp_ref, opt_ref, batches[:1], 1, groups=single)
    _, ddp, opt = dp_toy.build(dict(use_distributed_optimizer=True), hidden=64)
    dp_toy.train_steps(ddp, opt, batches[:1], 1)
    ref_bytes, shard_bytes = dp_toy.optimizer_state_bytes(opt_ref), dp_toy.optimizer_state_bytes(opt)
    ratio = shard_bytes / ref_bytes
    report["optimizer_state_bytes"] = (ref_bytes, shard_bytes, ratio)
    # Padding (param starts at 64 elements, bucket ends at lcm(DP,128)) adds a few percent.
    assert ratio <= 1.1 / dp, f"distributed optimizer state per rank is {ratio:.3f} of DP=1, expected ~{1 / dp:.3f}"


def _shared_tmpdir():
    path = [tempfile.mkdtemp(prefix="dp_ckpt_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return path[0]


def _check_distrib_optim_file(path, ddp):
    """distrib_optim.pt: Megatron's coalesced layout, params in buffer order without bucket padding."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    assert state["buckets_coalesced"] is True
    assert set(state) == {"buckets_coalesced", 0}, sorted(map(str, state))
    buffer = ddp.buffers[0]
    entry = state[0][(torch.float32, torch.float32)]
    assert entry["numel_unpadded"] == buffer.numel_unpadded
    expected = torch.zeros(buffer.numel_unpadded)
    offset = 0
    for bucket in buffer.buckets:
        for param in bucket.params_list:
            start, end, _ = buffer.param_index_map[param]
            expected[offset + start - bucket.offset : offset + end - bucket.offset] = param.detach().flatten()
        offset += bucket.numel_unpadded
    assert torch.equal(entry["param"], expected), "distrib_optim.pt 'param' is not the fp32 params in buffer order"
    for key in ("exp_avg", "exp_avg_sq"):
        assert entry[key].shape == expected.shape and entry[key].abs().sum() > 0, key


def _check_checkpoint_roundtrip(report):
    """Save at step 2 (model state, optimizer state_dict, distrib_optim.pt), load into a fresh DP=2 setup
    with a different init, continue: bit-exact with the uninterrupted run."""
    batches = dp_toy.global_batches(4, GLOBAL_BATCH, seed=99)
    kwargs = dict(use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=100)
    model, ddp, opt = dp_toy.build(kwargs)
    full_losses = dp_toy.train_steps(ddp, opt, batches, NUM_MICRO)
    ddp.disable_forward_pre_hook(param_sync=True)
    full_params = dp_toy.params_of(model)

    model, ddp, opt = dp_toy.build(kwargs)
    first = dp_toy.train_steps(ddp, opt, batches[:2], NUM_MICRO)
    ddp.disable_forward_pre_hook(param_sync=True)
    directory = _shared_tmpdir()
    rank_file = os.path.join(directory, f"model_optim_rng_{dist.get_rank()}.pt")
    torch.save({"model": ddp.state_dict_for_save_checkpoint(), "optimizer": opt.state_dict()}, rank_file)
    opt_file = os.path.join(directory, "distrib_optim.pt")
    opt.save_parameter_state(opt_file)
    dist.barrier()
    if dist.get_rank() == 0:
        _check_distrib_optim_file(opt_file, ddp)

    model, ddp, opt = dp_toy.build(kwargs, seed=7)
    saved = torch.load(rank_file, map_location="cpu", weights_only=True)
    ddp.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    opt.load_parameter_state(opt_file)
    rest = dp_toy.train_steps(ddp, opt, batches[2:], NUM_MICRO)
    ddp.disable_forward_pre_hook(param_sync=True)
    resumed = dp_toy.params_of(model)
    assert first + rest == full_losses, f"resumed losses {first + rest} != uninterrupted {full_losses}"
    for name, value in full_params.items():
        assert torch.equal(resumed[name], value), f"{name} differs after resume"
    report["distrib_optim_resume_bit_exact"] = True


def _check_bucket_layout(report):
    """Buffer layout rules: padding, bucket boundaries, views, dtypes, the tied embedding's own bucket."""
    model, ddp, _ = dp_toy.build(dict(use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=100))
    for buffer in ddp.buffers:
        for bucket in buffer.buckets:
            assert bucket.grad_data.numel() % 128 == 0 and bucket.param_data.numel() == bucket.grad_data.numel()
            for param in bucket.params_list:
                start, end, _ = buffer.param_index_map[param]
                assert start % 64 == 0, "params start at multiples of 64 elements with the distributed optimizer"
                assert bucket.offset <= start and end <= bucket.offset + bucket.numel_unpadded
                assert param.main_grad.data_ptr() == buffer.grad_data[start:].data_ptr()
                assert param.data_ptr() == buffer.param_data[start:].data_ptr()
    embedding_bucket = ddp.buffers[0].param_to_bucket[model.embedding.weight]
    assert embedding_bucket.params_list == [model.embedding.weight], "tied embedding must have its own bucket"
    last_registered = [p for p in model.parameters() if p.requires_grad][-1]
    assert last_registered in ddp.buffers[0].buckets[0].params, "bucket 0 holds the last registered params"
    assert model.frozen not in ddp.param_to_bucket_group and not hasattr(model.frozen, "main_grad")

    model, ddp, _ = dp_toy.build(dict())
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(ddp.buffers) == 1 and len(ddp.buffers[0].buckets) == 1
    assert ddp.buffers[0].numel == sum(p.numel() for p in trainable), "no padding without the distributed optimizer"

    _, ddp, _ = dp_toy.build(dict(use_distributed_optimizer=True, pad_buckets_for_high_nccl_busbw=True))
    assert all(b.grad_data.numel() % 2**16 == 0 for b in ddp.buffers[0].buckets)

    model, ddp, _ = dp_toy.build(dict(grad_reduce_in_fp32=True), dtype=torch.bfloat16)
    assert (ddp.buffers[0].param_dtype, ddp.buffers[0].grad_dtype) == (torch.bfloat16, torch.float32)
    assert model.embedding.weight.main_grad.dtype == torch.float32
    _, ddp, _ = dp_toy.build(dict(), dtype=torch.bfloat16)
    assert ddp.buffers[0].grad_dtype == torch.bfloat16
    report["bucket_layout"] = True


def _check_fsdp2(batches, report, ref_losses, ref_params, per_token=False):
    """torch FSDP2 wrapper vs the plain-torch reference (AdamW without clipping on both sides); with
    per_token, gradients are summed over DP and finalize_model_grads divides by the global token count."""
    torch.manual_seed(0)
    model = dp_toy.ToyLM(dp_toy.ToyConfig(calculate_per_token_loss=per_token))
    wrapped = TorchFullyShardedDataParallel(
        model.config, DistributedDataParallelConfig(), model, sub_modules_to_wrap={torch.nn.Linear}
    )
    assert getattr(model.embedding.weight, "shared_embedding", False), "Megatron param attributes must survive"
    params = [p for p in wrapped.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim > 1]}, {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.01)
    dp_size, dp_rank = dist.get_world_size(), dist.get_rank()
    losses = []
    for batch in batches:
        tokens, mask = batch["tokens"].chunk(dp_size)[dp_rank], batch["mask"].chunk(dp_size)[dp_rank]
        opt.zero_grad()
        wrapped.zero_grad_buffer()
        pieces = list(zip(tokens.chunk(NUM_MICRO), mask.chunk(NUM_MICRO)))
        loss_sum = torch.zeros(2)
        for micro, (tok, msk) in enumerate(pieces):
            context = wrapped.no_sync() if micro < NUM_MICRO - 1 else torch.enable_grad()
            with context:
                total, count = dp_toy.microbatch_loss(wrapped, tok, msk)
                (total if per_token else total * dp_size / batch["mask"].sum()).backward()
            loss_sum += torch.stack([total.detach(), count])
        dp_toy.finalize_model_grads([wrapped], num_tokens=mask.sum().clone() if per_token else None)
        opt.step()
        dist.all_reduce(loss_sum)
        losses.append((loss_sum[0] / loss_sum[1]).item())
    full = {name: p.full_tensor().detach().float() for name, p in model.named_parameters()}
    _compare(f"fsdp2{'_per_token' if per_token else ''}", losses, full, ref_losses, ref_params, report)


def _check_two_optimizer_instances(batches, report, ref_losses, ref_params):
    """num_distributed_optimizer_instances=2 at DP=4: shard over 2 ranks, all-reduce across instances."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, num_distributed_optimizer_instances=2)
    for average in (False, True):
        kwargs = dict(use_distributed_optimizer=True, num_distributed_optimizer_instances=2, average_in_collective=average)
        losses, params, ddp, _ = _run_variant(kwargs, batches)
        assert ddp.buffers[0].data_parallel_world_size == 2
        _compare(f"two_optimizer_instances_avg{int(average)}", losses, params, ref_losses, ref_params, report)


class _RecordingTimers:
    """Records (name, log_level) of every timer that was started and stopped."""

    def __init__(self):
        self.log = []

    def __call__(self, name, log_level=None):
        timers = self

        class _Timer:
            def start(self, barrier=False):
                self.running = True

            def stop(self, barrier=False):
                timers.log.append((name, log_level))

        return _Timer()


def _check_finalize_tp_pp(report):
    """TP=2 x PP=2 (x DP): SP-marked grads summed over TP, tied embedding summed over the first and last
    stage, num_tokens broadcast from the last stage, summed over DP and divided out."""
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    tp_rank, pp_rank = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    dp = parallel_state.get_data_parallel_world_size()
    config = dp_toy.ToyConfig(calculate_per_token_loss=True, sequence_parallel=True)
    model = dp_toy.ToyLM(config)
    model.final_scale.sequence_parallel = True
    ddp = dp_toy.DistributedDataParallel(config, dp_toy.DistributedDataParallelConfig(), model)

    def value(tp, pp):
        return 1.0 + tp + 10.0 * pp

    for param in ddp.params_with_grad:
        param.main_grad.fill_(value(tp_rank, pp_rank))
    num_tokens = torch.tensor(5.0 if parallel_state.is_pipeline_last_stage() else 0.0)
    config.timers = _RecordingTimers()
    dp_toy.finalize_model_grads([ddp], num_tokens=num_tokens)
    assert config.timers.log == [
        ("all-grads-sync", 1), ("conditional-embedder-grads-all-reduce", 1),
        ("non-tensor-parallel-grads-all-reduce", 1), ("embedding-grads-all-reduce", 1),
    ], config.timers.log
    total_tokens = 5.0 * dp
    expect = {
        "embedding.weight": dp * (value(tp_rank, 0) + value(tp_rank, 1)) / total_tokens,
        "final_scale": dp * (value(0, pp_rank) + value(1, pp_rank)) / total_tokens,
        "layers.0.weight": dp * value(tp_rank, pp_rank) / total_tokens,
    }
    for name, expected in expect.items():
        grad = dict(model.named_parameters())[name].main_grad
        assert torch.allclose(grad, torch.full_like(grad, expected)), f"{name}: {grad.flatten()[0].item()} != {expected}"
    assert num_tokens.item() == total_tokens
    report["finalize_tp2_pp2"] = True


def _check_gpt_tp_pp_dp(report):
    """Tiny GPTModel: TP=2 x PP=2 x DP=2 with the distributed optimizer (overlapped, bucketed, SP) vs DP=1."""
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel()
    initial, ref_losses, final = dp_gpt.reference(dp_toy.single_rank_groups())
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    kwargs = dict(use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=2000)
    losses, params = dp_gpt.parallel_run(initial, kwargs, tp=2, pp=2, sp=True)
    param_diff = dp_gpt.compare_params(params, final)
    loss_diff = 0.0 if losses is None else max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    report["gpt_tp2_pp2_dp2_distopt"] = (loss_diff, param_diff)
    assert loss_diff <= GPT_TOL and param_diff <= GPT_TOL, f"GPT TP2xPP2xDP2: loss {loss_diff:.2e}, params {param_diff:.2e}"


def _dp_suite(dp, variants, extra_checks, tp=1):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    batches = dp_toy.global_batches(STEPS, GLOBAL_BATCH)
    groups = dp_toy.single_rank_groups()
    report = {}
    ref_losses, ref_params, _, _ = _run_variant({}, batches, groups=groups)
    torch_losses, torch_params = _plain_torch_reference(batches, 16)
    _compare("dp1_ddp_vs_plain_torch", ref_losses, ref_params, torch_losses, torch_params, report)
    for name in variants:
        losses, params, _, _ = _run_variant(VARIANTS[name], batches)
        _compare(name, losses, params, ref_losses, ref_params, report)
    if "per_token" in extra_checks:
        losses, params, _, _ = _run_variant(dict(use_distributed_optimizer=True), batches, per_token=True)
        _compare("distopt_per_token_loss", losses, params, ref_losses, ref_params, report)
    if "fused_wgrad" in extra_checks:
        for mode in ("dummy", "none"):
            losses, params, _, _ = _run_variant(dict(overlap_grad_reduce=True, bucket_size=100), batches, fused_wgrad=mode)
            _compare(f"grad_accumulation_fusion_{mode}", losses, params, ref_losses, ref_params, report)
    if "bf16" in extra_checks:
        _check_bf16_distopt(batches, report)
    if "no_sync" in extra_checks:
        _check_no_sync_and_overlap(batches, report)
    if "nan" in extra_checks:
        _check_nan_detection()
    if "broadcast" in extra_checks:
        _check_broadcast_params()
    if "checkpoint" in extra_checks:
        _check_checkpoint_roundtrip(report)
    if "layout" in extra_checks:
        _check_bucket_layout(report)
    if "fsdp2" in extra_checks:
        noclip_losses, noclip_params = _plain_torch_reference(batches, 16, clip=False)
        _check_fsdp2(batches, report, noclip_losses, noclip_params)
        _check_fsdp2(batches, report, noclip_losses, noclip_params, per_token=True)
    _memory_ratio(batches, report, dp)
    if "instances" in extra_checks:
        _check_two_optimizer_instances(batches, report, ref_losses, ref_params)
    if "finalize_tp_pp" in extra_checks:
        _check_finalize_tp_pp(report)
    if "gpt" in extra_checks:
        _check_gpt_tp_pp_dp(report)
    return report


def test_dp2_matches_single_process():
    """DP=2: every DDP / distributed-optimizer variant, per-token loss, fusion, no_sync, NaN check."""
    checks = ["per_token", "fused_wgrad", "bf16", "no_sync", "nan", "broadcast", "checkpoint", "layout", "fsdp2"]
    reports = run_on_ranks(_dp_suite, 2, 2, list(VARIANTS), checks, timeout=240)
    for name, value in reports[0].items():
        print(f"DP=2 {name}: {value}")


def test_dp4_tp2_and_gpt_tp2_pp2_dp2():
    """World 8. TP=2 x DP=4 with the toy model: main variants, 1/4 optimizer state, two optimizer instances.
    Then finalize_model_grads at TP=2 x PP=2 x DP=2, and a tiny GPTModel at TP=2 x PP=2 x DP=2 with the
    distributed optimizer through the 1F1B schedule vs its DP=1 run."""
    variants = ["allreduce", "distopt_overlap_param_gather", "distopt_average_in_collective"]
    reports = run_on_ranks(_dp_suite, 8, 4, variants, ["instances", "finalize_tp_pp", "gpt"], tp=2, timeout=300)
    merged = {}
    for report in reports:
        for name, value in report.items():
            if isinstance(value, tuple) and isinstance(merged.get(name), tuple) and len(value) == 2:
                value = tuple(max(a, b) for a, b in zip(value, merged[name]))
            merged[name] = value
    for name, value in merged.items():
        print(f"world 8 {name}: {value}")
