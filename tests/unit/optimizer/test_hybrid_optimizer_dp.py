"""The distributed optimizer with CPU offload (`--use-distributed-optimizer --use-precision-aware-optimizer
--optimizer-cpu-offload`) at DP=2 on gloo, one launch: every offload fraction (with and without the overlap
mode, and without the precision-aware path) against the same DP=2 run without offload and against the DP=1
reference, fp32 and bf16; then checkpoints: the legacy layout (state_dict + distrib_optim.pt scatter), the
distributed model-space layout (ShardedTensors, saved and loaded with dist_checkpointing), and a checkpoint
written without offload resumed with it.

Tolerances: with clipping off the offloaded run takes the same torch kernels on the same reduce-scattered
gradients, so it equals the plain DP=2 run bit for bit, and resumes bit for bit. Against DP=1 the gradients
differ by the order of the 2-way reduction: 1e-6 relative (fp32), as in tests/parity/test_dp_parity.py.
"""
import os
import tempfile

import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
from tests.harness import run_on_ranks
from tests.unit.distributed import dp_toy

TOL, STEPS, NUM_MICRO, GLOBAL_BATCH = 1e-6, 4, 2, 8
DISTOPT = dict(use_distributed_optimizer=True)


def _offload(fraction, overlap=False, precision_aware=True):
    return dict(optimizer_cpu_offload=True, optimizer_offload_fraction=fraction, overlap_cpu_optimizer_d2h_h2d=overlap,
                use_precision_aware_optimizer=precision_aware, clip_grad=0.0)


def _run(ddp_kwargs, opt_kwargs, batches, dtype=torch.float32, groups=None):
    model, ddp, opt = dp_toy.build(ddp_kwargs, dict(opt_kwargs), dtype=dtype, groups=groups)
    losses = dp_toy.train_steps(ddp, opt, batches, NUM_MICRO, groups=groups)
    return losses, dp_toy.params_of(model), opt


def _check_fractions(batches, report):
    reference = {dtype: _run({}, dict(clip_grad=0.0), batches, dtype, dp_toy.single_rank_groups())
                 for dtype in (torch.float32, torch.bfloat16)}
    plain = {dtype: _run(DISTOPT, dict(clip_grad=0.0), batches, dtype) for dtype in (torch.float32, torch.bfloat16)}
    variants = [("f0", _offload(0.0)), ("f0.5", _offload(0.5)), ("f1", _offload(1.0)),
                ("f0.5-overlap", _offload(0.5, overlap=True)), ("f0.5-not-precision-aware", _offload(0.5, False, False))]
    for dtype in (torch.float32, torch.bfloat16):
        for name, kwargs in variants:
            losses, params, opt = _run(DISTOPT, kwargs, batches, dtype)
            label = f"{name} {dtype}"
            assert isinstance(opt.optimizer, HybridDeviceOptimizer), label
            hosted = sum(slot.master.numel() for slot in opt.optimizer._slots.values() if slot.on_host)
            owned = sum(p.numel() for g in opt.optimizer.param_groups for p in g["params"])
            assert losses == plain[dtype][0], f"{label}: losses {losses} vs {plain[dtype][0]}"
            assert all(torch.equal(params[k], v) for k, v in plain[dtype][1].items()), f"{label} params differ"
            report[label] = f"{hosted}/{owned} elements stepped on the host"
        if dtype == torch.float32:
            diff = dp_toy.max_rel_diff(plain[dtype][1], reference[dtype][1])
            assert diff <= TOL, f"DP=2 vs DP=1: {diff}"
            report["dp2_vs_dp1_fp32"] = diff


def _shared_tmpdir():
    path = [tempfile.mkdtemp(prefix="offload_ckpt_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return path[0]


def _model_sharded_state_dict(model):
    """Every param as a replicated ShardedTensor (what a model's sharded_state_dict gives the optimizer)."""
    dp_rank = parallel_state.get_data_parallel_rank()
    return {name: ShardedTensor.from_rank_offsets(name, param, replica_id=(0, 0, dp_rank))
            for name, param in model.named_parameters() if param.requires_grad}


def _save(kind, model, opt, directory):
    if kind == "legacy":
        state = {"optimizer": opt.state_dict(), "param_state": opt.get_parameter_state_dp_zero()}
        torch.save(state, os.path.join(directory, f"rank{dist.get_rank()}.pt"))
    else:
        dist_checkpointing.save({"optimizer": opt.sharded_state_dict(_model_sharded_state_dict(model))}, directory)
    torch.save(dp_toy.params_of(model), os.path.join(directory, f"model{dist.get_rank()}.pt"))
    dist.barrier()


def _load(kind, model, opt, directory):
    saved_model = torch.load(os.path.join(directory, f"model{dist.get_rank()}.pt"), weights_only=True)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(saved_model[name])
    opt.reload_model_params()
    if kind == "legacy":
        saved = torch.load(os.path.join(directory, f"rank{dist.get_rank()}.pt"), weights_only=True)
        opt.load_state_dict(saved["optimizer"])
        opt.load_parameter_state_from_dp_zero(saved["param_state"])
    else:
        request = {"optimizer": opt.sharded_state_dict(_model_sharded_state_dict(model), is_loading=True)}
        opt.load_state_dict(dist_checkpointing.load(request, directory)["optimizer"])


def _check_resume(batches, report):
    """Two steps, save, load into a fresh setup (other init), two more steps == four uninterrupted steps."""
    dtype = torch.bfloat16
    cases = [("legacy", _offload(0.5, overlap=True), _offload(0.5, overlap=True)),
             ("dist", _offload(0.5), _offload(0.5)),
             ("dist-saved-without-offload", dict(clip_grad=0.0), _offload(1.0))]
    for kind_name, save_kwargs, load_kwargs in cases:
        kind = "legacy" if kind_name == "legacy" else "dist"
        full_losses, full_params, _ = _run(DISTOPT, save_kwargs, batches, dtype)
        model, ddp, opt = dp_toy.build(DISTOPT, dict(save_kwargs), dtype=dtype)
        first = dp_toy.train_steps(ddp, opt, batches[:2], NUM_MICRO)
        directory = _shared_tmpdir()
        _save(kind, model, opt, directory)
        model, ddp, opt = dp_toy.build(DISTOPT, dict(load_kwargs), dtype=dtype, seed=5)
        _load(kind, model, opt, directory)
        rest = dp_toy.train_steps(ddp, opt, batches[2:], NUM_MICRO)
        resumed = dp_toy.params_of(model)
        assert first + rest == full_losses, f"{kind_name}: resumed {first + rest} vs uninterrupted {full_losses}"
        assert all(torch.equal(resumed[k], v) for k, v in full_params.items()), f"{kind_name}: params differ"
        state = opt.optimizer.state[opt.optimizer.param_groups[0]["params"][0]]
        assert float(state["step"]) == STEPS and state["master_param"].dtype == torch.float32
        report[f"resume_{kind_name}"] = "bit exact"


def _suite():
    parallel_state.initialize_model_parallel()
    torch.manual_seed(0)
    batches = dp_toy.global_batches(STEPS, GLOBAL_BATCH)
    report = {}
    _check_fractions(batches, report)
    _check_resume(batches, report)
    return report


def test_distributed_optimizer_offload_dp2():
    report = run_on_ranks(_suite, 2, timeout=300)[0]
    for name, value in report.items():
        print(f"DP=2 offload {name}: {value}")
