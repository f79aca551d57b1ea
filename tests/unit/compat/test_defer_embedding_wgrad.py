"""`defer_embedding_wgrad_compute` (`--defer-embedding-wgrad-compute`): on the last pipeline stage the output
layer keeps its microbatches' inputs and output gradients and the schedule computes the weight gradients in
the pipeline flush (`clear_embedding_activation_buffer` / `finish_embedding_wgrad_compute` /
`drain_embedding_wgrad_compute`). On 4 gloo ranks, a tiny GPT trained two iterations through the 1F1B and the
interleaved schedules must get the gradients of the same run without deferral: bit for bit when every
microbatch is deferred (the GEMMs add into main_grad in the order the backward would have), to 1e-6 of the
largest entry with a deferral limit below the microbatch count (the microbatches past the limit are added
first). PP=2 with tied and untied embeddings, TP=2 + SP (the kept inputs are all-gathered in the flush).
"""
import pytest
import torch

from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func, schedules
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.harness import run_on_ranks
from tests.parity.test_pp_gpt_parity import HEADS, HIDDEN, _reference_state, _stage_chunks, _train

CASES = [
    dict(name="pp2-untied", pp=2, layers=2, m=3, tied=False),
    dict(name="pp2-tied-limit2", pp=2, layers=2, m=3, tied=True, limit=2),
    dict(name="tp2-sp-pp2-untied", tp=2, pp=2, layers=2, m=3, tied=False, sp=True),
    dict(name="pp2-vp2-tied", pp=2, vp=2, layers=4, m=4, tied=True),
]


def _config(case, defer):
    return TransformerConfig(
        num_layers=case["layers"], hidden_size=HIDDEN, num_attention_heads=HEADS, use_cpu_initialization=True,
        pipeline_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0, gradient_accumulation_fusion=True,
        tensor_model_parallel_size=case.get("tp", 1), pipeline_model_parallel_size=case["pp"],
        virtual_pipeline_model_parallel_size=case.get("vp"), sequence_parallel=case.get("sp", False),
        defer_embedding_wgrad_compute=defer, wgrad_deferral_limit=case.get("limit", 0),
    )


def _grads(case, state, defer, kept):
    parallel_state.initialize_model_parallel(case.get("tp", 1), case["pp"], case.get("vp"),
                                             create_gloo_process_groups=False)
    model_parallel_cuda_manual_seed(11)
    config = _config(case, defer)
    chunks = _stage_chunks(case, config, state)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = [c.no_sync for c in chunks] if case.get("vp") else chunks[0].no_sync
    losses = _train(case, chunks, config, get_forward_backward_func())
    grads = {f"{i}.{name}": p.main_grad.clone() for i, c in enumerate(chunks) for name, p in c.module.named_parameters()}
    last = chunks[-1].module
    if parallel_state.is_pipeline_last_stage() and defer:
        assert last.embedding_activation_buffer == [] and last.grad_output_buffer == []
    parallel_state.destroy_model_parallel()
    return losses, grads, list(kept)


def _worker(cases, states):
    kept = []
    real_drain = schedules.drain_embedding_wgrad_compute

    def counting_drain(config, activations, grads, weight, tp_group=None):
        kept.append(len(activations))
        return real_drain(config, activations, grads, weight, tp_group)

    schedules.drain_embedding_wgrad_compute = counting_drain
    try:
        results = []
        for case, state in zip(cases, states):
            kept.clear()
            plain = _grads(case, state, False, kept)
            kept.clear()
            deferred = _grads(case, state, True, kept)
            results.append((plain, deferred))
        return results
    finally:
        schedules.drain_embedding_wgrad_compute = real_drain


def test_deferred_output_layer_wgrad_equals_the_plain_run():
    results = run_on_ranks(_worker, 4, CASES, [_reference_state(c) for c in CASES], timeout=400)
    for index, case in enumerate(CASES):
        drained = False
        for rank, per_case in enumerate(results):
            (losses, grads, plain_kept), (d_losses, d_grads, kept) = per_case[index]
            assert plain_kept == []  # without deferral nothing is drained
            if case.get("limit"):
                flat, d_flat = sum(losses, []), sum(d_losses, [])
                assert d_flat == pytest.approx(flat, rel=1e-6), (case["name"], rank)
            else:
                assert d_losses == losses, (case["name"], rank)
            assert set(d_grads) == set(grads)
            for name, grad in grads.items():
                if case.get("limit"):
                    scale = grad.abs().max().item()
                    assert (d_grads[name] - grad).abs().max().item() <= 1e-6 * scale, (case["name"], rank, name)
                else:
                    assert torch.equal(d_grads[name], grad), (case["name"], rank, name)
            if kept:
                drained = True
                expected = min(case["m"], case.get("limit") or case["m"])
                assert kept == [expected, expected], (case["name"], rank, kept)  # one flush per iteration
        assert drained, case["name"]
