"""Pipeline schedules on gloo ranks vs the same toy layers run in one process.

One launch of 4 ranks runs many layouts in turn (1F1B and interleaved at PP=4 and at PP=2 x DP=2,
forward-only, deallocated outputs, unbatched p2p, variable sequence lengths, per-token loss) and
returns every stage's per-microbatch losses and layer gradients. Tolerance: 1e-6 relative; the
pipelined run does the same fp32 operations as the reference, only split across processes.
"""
import contextlib

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.timers import Timers
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel import p2p_communication as p2p
from tests.harness import run_on_ranks
from tests.unit.pipeline_parallel.toy_pipeline import (
    SEQ,
    ToyStage,
    Wrapper,
    all_layer_params,
    assert_close,
    forward_step_func,
    microbatches,
    reference,
    toy_config,
)

LAYERS = 8

CASES = [
    dict(name="pp4-1f1b", pp=4, m=6, config=dict(deallocate_pipeline_outputs=True), grad_scale=2.0, timers=True),
    dict(name="pp4-1f1b-few", pp=4, m=2, config={}),
    dict(name="pp4-1f1b-fwd", pp=4, m=5, config={}, forward_only=True),
    dict(name="pp4-vp2", pp=4, vp=2, m=8, config=dict(deallocate_pipeline_outputs=True)),
    dict(name="pp4-vp2-group5", pp=4, vp=2, m=9,
         config=dict(microbatch_group_size_per_vp_stage=5, overlap_p2p_comm=True, batch_p2p_comm=False)),
    dict(name="pp4-vp2-fwd", pp=4, vp=2, m=4, config={}, forward_only=True),
    dict(name="pp2-1f1b-unbatched-pertoken", pp=2, m=5, config=dict(batch_p2p_comm=False, calculate_per_token_loss=True)),
    dict(name="pp2-1f1b-varlen", pp=2, m=3, config=dict(variable_seq_lengths=True), varlen=True),
    dict(name="pp2-vp2", pp=2, vp=2, m=4, config=dict(deallocate_pipeline_outputs=True)),
    dict(name="pp2-vp2-group3-varlen", pp=2, vp=2, m=5, varlen=True,
         config=dict(microbatch_group_size_per_vp_stage=3, variable_seq_lengths=True)),
]


def _batches(case):
    batches = microbatches(case["m"])
    if case.get("varlen"):
        for i, batch in enumerate(batches):
            keep = SEQ - 2 * (i % 2)
            batch["x"], batch["mask"] = batch["x"][:keep], batch["mask"][:keep]
    return batches


def _build_chunks(case, config, pp_rank, params):
    pp, vp = case["pp"], case.get("vp") or 1
    per_stage = LAYERS // (pp * vp)
    chunks = []
    for chunk in range(vp):
        virtual_stage = chunk * pp + pp_rank
        layer_ids = range(virtual_stage * per_stage, (virtual_stage + 1) * per_stage)
        first, last = virtual_stage == 0, virtual_stage == pp * vp - 1
        chunks.append(Wrapper(ToyStage(config, layer_ids, params, first, last)))
    return chunks


def _run_case(case, device="cpu"):
    pp, vp = case["pp"], case.get("vp")
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp, create_gloo_process_groups=False
    )
    config = toy_config(
        num_layers=LAYERS, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp, **case["config"]
    )
    events, finalize_calls = [], []

    @contextlib.contextmanager
    def no_sync():
        events.append("enter")
        yield
        events.append("exit")

    config.no_sync_func = no_sync
    config.finalize_model_grads_func = lambda models, n: finalize_calls.append((len(models), None if n is None else int(n)))
    if case.get("timers"):
        config.timers = Timers(2, "minmax")
    if case.get("grad_scale"):
        config.grad_scale_func = lambda loss: loss * case["grad_scale"]
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    chunks = _build_chunks(case, config, pp_rank, all_layer_params(LAYERS))
    chunks = [chunk.to(device) for chunk in chunks]
    batches = [{k: v.to(device) for k, v in batch.items()} for batch in _batches(case)]
    iterators = [iter(batches) for _ in chunks]
    losses = get_forward_backward_func()(
        forward_step_func=forward_step_func,
        data_iterator=iterators if vp else iterators[0],
        model=chunks if vp else chunks[0],
        num_microbatches=case["m"],
        seq_length=SEQ,
        micro_batch_size=2,
        forward_only=case.get("forward_only", False),
    )
    assert all(next(it, None) is None for it in iterators), "every microbatch is read exactly once per chunk"
    assert events.count("enter") == events.count("exit") >= 1, events
    grads = {}
    if not case.get("forward_only"):
        for chunk in chunks:
            grads.update({i: (w.cpu().numpy(), b.cpu().numpy()) for i, (w, b) in chunk.module.grads().items()})
    parallel_state.destroy_model_parallel()
    return dict(
        losses=[[float(v) for v in l["lm loss"]] for l in losses],
        grads=grads,
        finalize=finalize_calls,
        last=pp_rank == pp - 1,
        chunks=len(chunks),
        timers=sorted(config.timers._timers) if config.timers is not None else [],
    )


def _check_p2p_functions():
    """Megatron's module-level p2p helpers at PP=4; each received value identifies its sender."""
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=4, create_gloo_process_groups=False)
    config = toy_config(num_layers=LAYERS, pipeline_model_parallel_size=4)
    rank = parallel_state.get_pipeline_model_parallel_rank()
    first, last = rank == 0, rank == 3
    shape = (3, 2, 4)

    def mine(offset=0.0):
        return torch.full(shape, float(rank + offset))

    got = p2p.recv_forward(shape, config)
    p2p.send_forward(mine(), config)
    assert got is None if first else torch.equal(got, torch.full(shape, rank - 1.0))
    got = p2p.recv_backward(shape, config)
    p2p.send_backward(mine(10), config)
    assert got is None if last else torch.equal(got, torch.full(shape, rank + 11.0))
    got = p2p.send_forward_recv_forward(None if last else mine(), not first, shape, config)
    assert got is None if first else torch.equal(got, torch.full(shape, rank - 1.0))
    got = p2p.send_backward_recv_backward(None if first else mine(20), not last, shape, config)
    assert got is None if last else torch.equal(got, torch.full(shape, rank + 21.0))
    fwd, bwd = p2p.send_forward_backward_recv_forward_backward(
        None if last else mine(30), None if first else mine(40), not first, not last, shape, config
    )
    assert fwd is None if first else torch.equal(fwd, torch.full(shape, rank + 29.0))
    assert bwd is None if last else torch.equal(bwd, torch.full(shape, rank + 41.0))
    if rank % 2 == 0:
        got = p2p.send_forward_recv_backward(mine(50), shape, config, is_last_stage=False)
        assert torch.equal(got, torch.full(shape, rank + 61.0)) and got.requires_grad
    else:
        got = p2p.send_backward_recv_forward(mine(60), shape, config, is_first_stage=False)
        assert torch.equal(got, torch.full(shape, rank + 49.0))
    parallel_state.destroy_model_parallel()


def _worker():
    _check_p2p_functions()
    return [_run_case(case) for case in CASES]


def _check_case(case, per_rank, rtol=1e-6):
    batches = _batches(case)
    per_token = case["config"].get("calculate_per_token_loss", False)
    sums, counts, ref_grads = reference(
        all_layer_params(LAYERS), batches, per_token=per_token, grad_scale=case.get("grad_scale", 1.0)
    )
    if case.get("timers"):
        for result in per_rank:
            assert {"forward-backward", "forward-compute", "backward-compute"} <= set(result["timers"])
        middle = {"forward-recv", "forward-send", "forward-send-backward-recv", "backward-send-forward-recv",
                  "backward-recv", "backward-send"}
        assert middle <= set(per_rank[1]["timers"]), per_rank[1]["timers"]
    seen_layers = set()
    for rank, result in enumerate(per_rank):
        if result["last"]:
            assert [l[0] for l in result["losses"]] == pytest.approx(sums, rel=rtol), (case["name"], rank)
            assert [int(l[1]) for l in result["losses"]] == counts
        else:
            assert result["losses"] == [], (case["name"], rank)
        if case.get("forward_only"):
            assert result["finalize"] == [] and result["grads"] == {}
            continue
        expected_tokens = sum(counts) if (per_token and result["last"]) else (0 if per_token else None)
        assert result["finalize"] == [(result["chunks"], expected_tokens)], (case["name"], rank, result["finalize"])
        for layer, (w, b) in result["grads"].items():
            w, b = torch.from_numpy(w), torch.from_numpy(b)
            assert_close(w, ref_grads[layer][0], rtol=rtol, atol=rtol / 10, what=f"{case['name']} layer {layer} weight")
            assert_close(b, ref_grads[layer][1], rtol=rtol, atol=rtol / 10, what=f"{case['name']} layer {layer} bias")
            seen_layers.add(layer)
    if not case.get("forward_only"):
        assert seen_layers == set(range(LAYERS)), case["name"]


def test_pipeline_schedules_match_single_process():
    results = run_on_ranks(_worker, 4, timeout=240)
    for index, case in enumerate(CASES):
        _check_case(case, [results[rank][index] for rank in range(4)])
