"""Inference engines on tiny CPU models: greedy static and dynamic generation equal a full-recompute reference
token for token; log-probabilities equal one full forward's; the dynamic engine gives each request the same
tokens as running it alone while requests of different lengths (one longer than the step's token budget:
chunked prefill) join mid-flight; sampling filters; TP=2 equals TP=1 (gloo, one launch; the launch also
generates with the multi-latent-attention model of `test_mla_mamba_inference.py`)."""
import pytest
import torch

from tests.harness import run_on_ranks
from tests.unit.inference import tiny_gpt as T
from tests.unit.inference.test_mla_mamba_inference import mla_tp_generate
from tests.unit.transformer.model_setup import init_single_rank

NEW = 10


def _greedy(num=NEW, **kw):
    from megatron.core.inference.sampling_params import SamplingParams

    return SamplingParams(top_k=1, num_tokens_to_generate=num, **kw)


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_static_greedy_equals_full_recompute(kind):
    init_single_rank()
    model, tok = T.build_model(kind), T.tokenizer()
    prompts = T.prompts(5, [3, 9, 5, 12, 1])
    engine = T.static_engine(model, max_requests=4)  # 5 prompts: a second batch from the waiting queue
    results = engine.generate(prompts=[tok.detokenize(p) for p in prompts],
                              sampling_params=_greedy(return_log_probs=True, return_segments=True))
    assert [r.request_id for r in results] == [str(i) for i in range(5)]
    for prompt, result in zip(prompts, results):
        assert result.generated_tokens == T.reference_greedy(model, prompt, NEW)
        reference = T.reference_log_probs(model, prompt + result.generated_tokens)
        got = result.prompt_log_probs + result.generated_log_probs
        assert len(result.prompt_log_probs) == len(prompt) - 1 and len(got) == len(reference)
        assert max((abs(a - b) for a, b in zip(got, reference)), default=0.0) < 1e-4
        assert result.generated_text == tok.detokenize(prompt + result.generated_tokens)[len(tok.detokenize(prompt)):]
        assert "".join(result.segments) == tok.detokenize(prompt + result.generated_tokens)


def test_dynamic_requests_joining_mid_flight_equal_running_alone():
    from megatron.core.inference.contexts.dynamic_context import MaxSequenceLengthOverflowError

    init_single_rank()
    model = T.build_model("llama")
    prompts = T.prompts(6, [5, 70, 2, 17, 9, 33])  # 70 > the 64-token step budget: chunked prefill
    budgets = [12, 6, 20, 3, 15, 9]
    expected = [T.reference_greedy(model, p, n) for p, n in zip(prompts, budgets)]
    alone = []
    for prompt, budget in zip(prompts, budgets):
        engine = T.dynamic_engine(model)
        engine.add_request(0, prompt, budget)
        while engine.has_unfinished_requests():
            finished, _ = engine.step(_greedy())
        alone.append(finished[0].generated_tokens)
    assert alone == expected
    engine = T.dynamic_engine(model, max_requests=4)  # 4 slots: later requests wait for finished ones
    arrivals = {0: [0, 1], 2: [2], 3: [3, 4], 6: [5]}  # step -> requests joining before it
    done, step, max_active, paused = {}, 0, 0, 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for rid in arrivals.get(step, []):
            engine.add_request(rid, torch.tensor(prompts[rid]), budgets[rid])
        finished, _ = engine.step(_greedy())
        max_active = max(max_active, engine.context.total_request_count)
        done.update((r.request_id, r.generated_tokens) for r in finished)
        step += 1
    assert [done[i] for i in range(6)] == expected
    assert max_active == 4 and engine.context.chunk_allocator.chunk_count_avail == \
        engine.context.chunk_allocator.chunk_count_total - 1  # every chunk back, the dummy never handed out
    with pytest.raises(MaxSequenceLengthOverflowError):
        engine.add_request(99, [1] * 100, T.MAX_SEQ)
    batch = engine.generate([prompts[0], prompts[2]], _greedy(num=12))
    assert [r.generated_tokens for r in batch] == [expected[0], T.reference_greedy(model, prompts[2], 12)]


def test_dynamic_context_sizes_follow_megatron():
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext

    ctx = DynamicInferenceContext(torch.bfloat16, num_layers=4, kv_channels=64, num_attention_heads=8,
                                  max_sequence_length=1024, buffer_size_gb=0.05, buffer_guaranteed_fraction=0.2,
                                  chunk_size_tokens=256, tensor_model_parallel_size=2, buffer_overflow_factor=1.5)
    chunk_bytes = 2 * 2 * 4 * 256 * 4 * 64
    assert ctx.chunk_size_bytes == chunk_bytes
    chunks = int(0.05 * 2 ** 30) // chunk_bytes
    assert ctx.memory_buffer.shape == (2, 4, chunks, 256, 4, 64) and bool((ctx.memory_buffer == -1).all())
    tokens = chunks * 256
    assert ctx.max_requests == min(-(-int(tokens // 1024 * 1.5) // 4) * 4, ctx.max_tokens)
    assert ctx.max_tokens == -(-int(tokens * 1.5 / 50) // 64) * 64
    assert ctx.gtd_chunk_count == ctx.gtd_request_count * 4 and ctx.gtd_request_count % 4 == 0


def test_sampling_filters():
    from megatron.core.inference.sampling import sample_from_logits

    logits = torch.tensor([[0.0, 5.0, 4.9, -1.0, 3.0]] * 400)
    g = torch.Generator().manual_seed(0)
    assert sample_from_logits(logits, top_k=1).tolist() == [1] * 400
    top2 = set(sample_from_logits(logits, top_k=2, generator=g).tolist())
    assert top2 == {1, 2}
    probs = torch.softmax(logits[0], -1)  # 0.46, 0.42, 0.06, ...: top_p 0.5 keeps the first two
    assert float(probs[1] + probs[2]) > 0.5 > float(probs[1])
    assert set(sample_from_logits(logits, top_p=0.5, generator=g).tolist()) == {1, 2}
    assert set(sample_from_logits(logits, temperature=100.0, generator=g).tolist()) == {0, 1, 2, 3, 4}
    assert set(sample_from_logits(logits, temperature=100.0, vocab_size=3, generator=g).tolist()) == {0, 1, 2}
    with pytest.raises(ValueError, match="cannot both be set"):
        sample_from_logits(logits, top_k=3, top_p=0.5)


def _tp_generate():
    """Static and dynamic greedy plus seeded top-k sampling, on this rank's TP shard."""
    import torch.distributed as dist

    from megatron.core import parallel_state
    from megatron.core.inference.sampling_params import SamplingParams

    tp = dist.get_world_size()
    if tp > 1:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model, tok = T.build_model("llama", tp=tp), T.tokenizer()
    prompts = T.prompts(3, [4, 11, 7])
    engine = T.static_engine(model)
    engine.random_seed = 5
    greedy = [r.generated_tokens for r in engine.generate([tok.detokenize(p) for p in prompts], sampling_params=_greedy())]
    sampled = [r.generated_tokens for r in engine.generate(
        [tok.detokenize(p) for p in prompts], sampling_params=SamplingParams(top_k=8, num_tokens_to_generate=NEW))]
    dynamic = [r.generated_tokens for r in T.dynamic_engine(model, tp=tp).generate(prompts, _greedy())]
    rows = model.decoder.layers[0].self_attention.linear_qkv.weight.shape[0]  # 4 q + 2 k + 2 v heads of 8, / TP
    mla, mla_rows = mla_tp_generate(tp)  # multi-latent attention + MoE in the same launch
    return {"greedy": greedy, "sampled": sampled, "dynamic": dynamic, **mla}, (tp, rows, mla_rows)


def test_tensor_parallel_generation_equals_single_rank():
    got = run_on_ranks(_tp_generate, 2)
    init_single_rank()
    want = _tp_generate()
    assert [shard for _, shard in got] == [(2, 32, 20), (2, 32, 20)] and want[1] == (1, 64, 40)
    assert got[0][0] == got[1][0] == want[0] and want[0]["hybrid_static_equals_dynamic"]
