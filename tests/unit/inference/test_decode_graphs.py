"""Static-shape (CUDA-graph) decode steps: on CPU the graph-safe step runs eagerly and must give the same tokens
as the ordinary eager step, for the static engine (batch padded to a power-of-two bucket) and for the dynamic
engine (requests joining mid-flight, prefills eager, decode-only steps through the bucket buffers); the graph
keys are the expected buckets. On CUDA the graphed engines must equal the eager ones (skipped without CUDA)."""
import pytest
import torch

from tests.unit.inference import tiny_gpt as T
from tests.unit.transformer.model_setup import init_single_rank

NEW = 12


def _greedy(num=NEW, **kw):
    from megatron.core.inference.sampling_params import SamplingParams

    return SamplingParams(top_k=1, num_tokens_to_generate=num, **kw)


def _static(model, graphs, max_requests=8):
    engine = T.static_engine(model, max_requests=max_requests)
    wrapper = engine.text_generation_controller.inference_wrapped_model
    wrapper.set_decode_graphs(graphs)
    return engine, wrapper


def _dynamic_run(model, prompts, budgets, graphs, arrivals):
    engine = T.dynamic_engine(model, max_requests=4)
    engine.controller.inference_wrapped_model.set_decode_graphs(graphs)
    done = T.run_with_arrivals(engine, prompts, budgets, arrivals, _greedy())
    return [done[i] for i in range(len(prompts))], engine


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_static_graph_safe_decode_equals_eager(kind):
    init_single_rank()
    model, tok = T.build_model(kind), T.tokenizer()
    prompts = T.prompts(3, [3, 9, 5])
    texts = [tok.detokenize(p) for p in prompts]
    eager, _ = _static(model, False)
    graphed, wrapper = _static(model, True)
    for params in (_greedy(), _greedy(return_log_probs=True)):
        want = eager.generate(prompts=texts, sampling_params=params)
        got = graphed.generate(prompts=texts, sampling_params=params)
        assert [r.generated_tokens for r in got] == [r.generated_tokens for r in want]
        assert [r.generated_tokens for r in got] == [T.reference_greedy(model, p, NEW) for p in prompts]
        if params.return_log_probs:
            diffs = [abs(a - b) for r, s in zip(got, want) for a, b in zip(r.generated_log_probs, s.generated_log_probs)]
            assert max(diffs) < 1e-5
    single = graphed.generate(prompts=texts[:1], sampling_params=_greedy())[0].generated_tokens
    assert single == T.reference_greedy(model, prompts[0], NEW)
    runner = wrapper.decode_graphs
    assert not runner.capture and runner.eager_calls > 0
    assert sorted({key[1] for key in runner.keys}) == [1, 4]  # 3 rows -> bucket 4; 1 row -> bucket 1


def test_dynamic_graph_safe_decode_equals_eager():
    init_single_rank()
    model = T.build_model("llama")
    prompts = T.prompts(6, [5, 70, 2, 17, 9, 33])  # 70 > the 64-token budget: chunked prefill stays eager
    budgets = [12, 6, 20, 3, 15, 9]
    arrivals = {0: [0, 1], 2: [2], 3: [3, 4], 6: [5]}
    want, _ = _dynamic_run(model, prompts, budgets, False, arrivals)
    got, engine = _dynamic_run(model, prompts, budgets, True, arrivals)
    assert got == want == [T.reference_greedy(model, p, n) for p, n in zip(prompts, budgets)]
    runner = engine.controller.inference_wrapped_model.decode_graphs
    keys = {key[1:3] for key in runner.keys}
    assert runner.eager_calls > 0 and all(r in (1, 2, 4) and c in (1, 2, 4, 8, 16) for r, c in keys)
    assert len({r for r, _ in keys}) > 1  # requests leaving move the step to smaller buckets


def test_batch_bucket():
    from megatron.core.inference.decode_graphs import batch_bucket

    assert [batch_bucket(n, 8) for n in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert batch_bucket(5, 6) == 6
    with pytest.raises(ValueError):
        batch_bucket(9, 8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_decode_equals_eager_on_gpu():
    init_single_rank()
    model = T.build_model("llama").cuda()
    tok = T.tokenizer()
    prompts = T.prompts(3, [3, 9, 5])
    texts = [tok.detokenize(p) for p in prompts]
    eager, _ = _static(model, False)
    graphed, wrapper = _static(model, True)
    want = [r.generated_tokens for r in eager.generate(prompts=texts, sampling_params=_greedy())]
    assert [r.generated_tokens for r in graphed.generate(prompts=texts, sampling_params=_greedy())] == want
    assert wrapper.decode_graphs.capture and wrapper.decode_graphs.replays > 0
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext

    budgets = [12, 6, 20]
    runs = []
    for graphs in (False, True):
        config = model.config
        context = DynamicInferenceContext(torch.float32, config.num_layers, config.kv_channels, config.num_query_groups,
                                          T.MAX_SEQ, buffer_size_gb=0.0005, buffer_guaranteed_fraction=0.1,
                                          chunk_size_tokens=8, max_requests_override=4, max_tokens_override=64,
                                          device=torch.device("cuda"))
        from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine
        from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
        from megatron.core.inference.text_generation_controllers.text_generation_controller import (
            TextGenerationController,
        )

        wrapped = GPTInferenceWrapper(model, T.wrapper_config(), inference_context=context)
        engine = DynamicInferenceEngine(TextGenerationController(wrapped, tok), context, termination_id=T.VOCAB - 1,
                                        enable_cuda_graph=graphs)
        for rid, (p, n) in enumerate(zip(prompts, budgets)):
            engine.add_request(rid, p, n)
        done = {}
        while engine.has_unfinished_requests():
            finished, _ = engine.step(_greedy())
            done.update((r.request_id, r.generated_tokens) for r in finished)
        runs.append([done[i] for i in range(3)])
        if graphs:
            assert wrapped.decode_graphs.replays > 0
    assert runs[0] == runs[1]


def test_static_decode_window_buckets():
    """A rope model with a 512-token cache: the decode window grows 128 -> 256 as the column passes 127."""
    from megatron.core.inference.engines.static_engine import StaticInferenceEngine
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    init_single_rank()
    model, tok = T.build_model("llama"), T.tokenizer()
    prompt = T.prompts(1, [120])[0]
    engines = []
    for graphs in (False, True):
        config = T.wrapper_config(max_requests=2, max_seq=512)
        config.enable_cuda_graph = graphs
        wrapper = GPTInferenceWrapper(model, config)
        engines.append((StaticInferenceEngine(TextGenerationController(wrapper, tok), max_batch_size=2), wrapper))
    params = _greedy(num=16)
    want = engines[0][0].generate(prompts=[tok.detokenize(prompt)], sampling_params=params)[0].generated_tokens
    got = engines[1][0].generate(prompts=[tok.detokenize(prompt)], sampling_params=params)[0].generated_tokens
    assert got == want and len(got) > 8
    assert sorted({key[2] for key in engines[1][1].decode_graphs.keys}) == [128, 256]
