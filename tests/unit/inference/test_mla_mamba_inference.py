"""KV caches of multi-latent attention and Mamba states in the inference engines, on tiny CPU models.

A DeepSeek-V3-shaped GPT (MLA with q LoRA and with full-rank queries, YaRN rotary with mscale, 4 experts top-2
plus a shared expert): greedy generation with the static and the dynamic engine equals step-by-step full
recompute token for token, and the dynamic engine gives every request the tokens it gets alone while requests
of different lengths (one longer than the step's token budget: chunked prefill) join mid-flight. A hybrid
Mamba model ("M*M-") does the same under the dynamic engine (per-request conv/SSM state slots). MLA with TP=2
equals TP=1 in `test_engines.py`'s TP launch (`tests/unit/inference/test_engines.py::_tp_generate`)."""
import pytest
import torch
import torch.nn.functional as F

from tests.unit.inference import tiny_gpt as T
from tests.unit.transformer.model_setup import init_single_rank

NEW = 8
MLA = dict(kv_lora_rank=8, qk_head_dim=6, qk_pos_emb_head_dim=4, v_head_dim=8, rotary_scaling_factor=4.0,
           mscale=1.0, mscale_all_dim=0.8, max_position_embeddings=32, qk_layernorm=True)
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_shared_expert_intermediate_size=16, moe_ffn_hidden_size=12,
           moe_layer_freq=[0, 1])


def _greedy(num=NEW):
    from megatron.core.inference.sampling_params import SamplingParams

    return SamplingParams(top_k=1, num_tokens_to_generate=num)


def build_mla_model(q_lora_rank=8, tp: int = 1):
    """A 2-layer DeepSeek-V3-shaped GPT: MLA + YaRN, the first layer dense, the second MoE (same weights at any TP)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    config = MLATransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, use_cpu_initialization=True,
        init_method_std=0.3, tensor_model_parallel_size=tp, hidden_dropout=0.0, attention_dropout=0.0,
        add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm",
        q_lora_rank=q_lora_rank, **MLA, **MOE)
    model_parallel_cuda_manual_seed(T.SEED)
    torch.manual_seed(T.SEED)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    model = GPTModel(config, spec, T.VOCAB, T.MAX_SEQ, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False)
    return model.eval()


def build_hybrid_model(mem_eff: bool = True):
    """A 4-layer hybrid Mamba model, pattern "M*M-" (Mamba, attention, Mamba, MLP)."""
    from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec
    from megatron.core.models.mamba.mamba_model import MambaModel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                               mamba_state_dim=8, mamba_head_dim=8, mamba_num_groups=2, use_cpu_initialization=True,
                               normalization="RMSNorm", add_bias_linear=False, hidden_dropout=0.0,
                               attention_dropout=0.0, init_method_std=0.3, use_mamba_mem_eff_path=mem_eff)
    model_parallel_cuda_manual_seed(T.SEED)
    torch.manual_seed(T.SEED)
    model = MambaModel(config, mamba_stack_spec, vocab_size=T.VOCAB, max_sequence_length=T.MAX_SEQ,
                       hybrid_override_pattern="M*M-", position_embedding_type="rope")
    for layer in model.decoder.layers:
        if hasattr(layer, "mixer"):
            layer.mixer.chunk_size = 8  # several scan chunks per prompt
    return model.eval()


def static_engine(model, cache_mla_latents: bool = False):
    """A static engine whose context caches MLA latents when asked (`T.static_engine` builds the default one)."""
    from megatron.core.inference.contexts.static_context import StaticInferenceContext
    from megatron.core.inference.engines.static_engine import StaticInferenceEngine
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    config = T.wrapper_config()
    context = StaticInferenceContext(config.inference_max_requests, config.inference_max_seq_length,
                                     cache_mla_latents=cache_mla_latents)
    wrapped = GPTInferenceWrapper(model, config, inference_context=context)
    return StaticInferenceEngine(TextGenerationController(wrapped, T.tokenizer()))


def dynamic_engine(model, tp: int = 1, max_requests: int = 4, cache_mla_latents: bool = False, device=None):
    """A dynamic engine over `model` whose context is sized by `kv_cache_dims(model.config)` and holds keys/values
    for the model's attention layers only."""
    from megatron.core.inference.contexts.dynamic_context import (
        DynamicInferenceContext,
        attention_layer_numbers,
        kv_cache_dims,
    )
    from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    heads, key_channels, value_channels = kv_cache_dims(model.config, cache_mla_latents)
    context = DynamicInferenceContext(
        params_dtype=torch.float32, num_layers=model.config.num_layers, kv_channels=key_channels,
        num_attention_heads=heads, max_sequence_length=T.MAX_SEQ, buffer_size_gb=0.0005,
        buffer_guaranteed_fraction=0.1, chunk_size_tokens=8, max_requests_override=max_requests,
        max_tokens_override=64, tensor_model_parallel_size=tp, value_channels=value_channels,
        cache_mla_latents=cache_mla_latents, device=device, kv_layer_numbers=attention_layer_numbers(model),
    )
    wrapped = GPTInferenceWrapper(model, T.wrapper_config(), inference_context=context)
    return DynamicInferenceEngine(TextGenerationController(wrapped, T.tokenizer()), context,
                                  termination_id=T.VOCAB - 1, random_seed=T.SEED)


def _run_mid_flight(engine, prompts, budgets, arrivals):
    """Requests join before the steps `arrivals` names; returns {request id: generated tokens}."""
    return T.run_with_arrivals(engine, prompts, budgets, arrivals, _greedy())


def _check_dynamic(model, prompts, budgets, arrivals, **kw):
    expected = [T.reference_greedy(model, p, n) for p, n in zip(prompts, budgets)]
    alone = [dynamic_engine(model, **kw).generate([p], _greedy(n))[0].generated_tokens
             for p, n in zip(prompts, budgets)]
    assert alone == expected
    _check_mid_flight(model, prompts, budgets, arrivals, expected, **kw)


def _check_mid_flight(model, prompts, budgets, arrivals, expected, **kw):
    for graphs in (False, True):  # graphs: decode-only steps in the static-shape (CUDA-graph) layout, eager on CPU
        engine = dynamic_engine(model, max_requests=4, **kw)
        engine.controller.inference_wrapped_model.set_decode_graphs(graphs)
        done = _run_mid_flight(engine, prompts, budgets, arrivals)
        assert [done[i] for i in range(len(prompts))] == expected
        context = engine.context
        assert context.chunk_allocator.chunk_count_avail == context.chunk_allocator.chunk_count_total - 1
        assert sorted(context._free_mamba_slots) == list(range(context.max_requests))  # every slot back
        assert context.memory_buffer.shape[1] == len(context.kv_layer_numbers)  # hybrid: the one '*' layer
    runner = engine.controller.inference_wrapped_model.decode_graphs
    assert (runner.replays if runner.capture else runner.eager_calls) > 0  # CUDA: captured graphs replayed


@pytest.mark.parametrize("q_lora_rank,latents", [(8, False), (None, False), (8, True), (None, True)])
def test_mla_static_and_dynamic_greedy_equal_full_recompute(q_lora_rank, latents):
    init_single_rank()
    model, tok = build_mla_model(q_lora_rank), T.tokenizer()
    prompts = T.prompts(3, [3, 11, 6])
    static = static_engine(model, latents)
    results = static.generate(prompts=[tok.detokenize(p) for p in prompts], sampling_params=_greedy())
    key, value = static.text_generation_controller.inference_wrapped_model.inference_context.key_value_memory_dict[1]
    assert (key.shape[2:], value.shape[2:]) == (((1, 12), (1, 8)) if latents else ((4, 10), (4, 8)))
    expected = [T.reference_greedy(model, p, NEW) for p in prompts]
    assert [r.generated_tokens for r in results] == expected
    static.text_generation_controller.inference_wrapped_model.set_decode_graphs(True)  # graph-safe decode, eager
    results = static.generate(prompts=[tok.detokenize(p) for p in prompts], sampling_params=_greedy())
    assert [r.generated_tokens for r in results] == expected
    engine = dynamic_engine(model, cache_mla_latents=latents)
    assert [r.generated_tokens for r in engine.generate(prompts, _greedy())] == expected
    # per token and layer: one head of key [latent 8 | k_pe 4] (the value: its latent), or 4 heads of 10 and 8
    shape = engine.context.memory_buffer.shape
    assert (shape[0],) + tuple(shape[-2:]) == ((1, 1, 12) if latents else (2, 4, 10))
    if q_lora_rank is not None:  # requests joining mid-flight, one in chunked prefill (70 > 64 tokens a step)
        _check_dynamic(model, T.prompts(5, [5, 70, 2, 13, 9]), [9, 4, 12, 3, 7], {0: [0, 1], 2: [2], 3: [3, 4]},
                       cache_mla_latents=latents)


@pytest.mark.parametrize("mem_eff", [True, False])
def test_hybrid_mamba_dynamic_equals_full_recompute(mem_eff):
    init_single_rank()
    model = build_hybrid_model(mem_eff)
    prompts = T.prompts(5, [5, 70, 1, 19, 9], seed=3)  # a one-token prompt; 70 > 64: chunked prefill
    _check_dynamic(model, prompts, [9, 4, 12, 3, 7], {0: [0, 1], 2: [2], 3: [3, 4]})


def mla_tp_generate(tp: int):
    """Static and dynamic greedy tokens of the DeepSeek-V3-shaped model on this rank's TP shard, and the shard's
    query up-projection rows (run by `test_engines.py`'s TP launch against TP=1); plus whether the hybrid Mamba
    model's static and dynamic tokens agree (its SSM parameters are drawn per TP shard, so the tokens
    themselves differ from TP=1's)."""
    model, tok = build_mla_model(tp=tp), T.tokenizer()
    prompts = T.prompts(3, [4, 11, 7], seed=5)
    static = [r.generated_tokens for r in T.static_engine(model).generate([tok.detokenize(p) for p in prompts],
                                                                          sampling_params=_greedy())]
    dynamic = [r.generated_tokens for r in dynamic_engine(model, tp=tp).generate(prompts, _greedy())]
    latent = [r.generated_tokens for r in dynamic_engine(model, tp=tp, cache_mla_latents=True).generate(
        prompts, _greedy())]
    rows = model.decoder.layers[0].self_attention.linear_q_up_proj.weight.shape[0]  # 4 heads of 10, / TP
    hybrid = build_hybrid_model()
    hybrid_static = [r.generated_tokens for r in T.static_engine(hybrid).generate(
        [tok.detokenize(p) for p in prompts], sampling_params=_greedy())]
    hybrid_dynamic = [r.generated_tokens for r in dynamic_engine(hybrid, tp=tp).generate(prompts, _greedy())]
    return {"mla_static": static, "mla_dynamic": dynamic, "mla_latent": latent,
            "hybrid_static_equals_dynamic": hybrid_static == hybrid_dynamic}, rows


def test_kv_cache_dims_and_value_channels():
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext, kv_cache_dims

    init_single_rank()
    model = build_mla_model()
    assert kv_cache_dims(model.config) == (4, 10, 8) and kv_cache_dims(model.config, True) == (1, 12, 8)
    from megatron.core.inference.contexts.dynamic_context import attention_layer_numbers

    assert attention_layer_numbers(model) == [1, 2] and attention_layer_numbers(build_hybrid_model()) == [2]
    ctx = DynamicInferenceContext(torch.float32, num_layers=2, kv_channels=10, num_attention_heads=4,
                                  max_sequence_length=64, buffer_size_gb=0.001, buffer_guaranteed_fraction=0.1,
                                  chunk_size_tokens=16, value_channels=6)
    assert ctx.memory_buffer.shape[-1] == 10 and ctx.chunk_size_bytes == 4 * 2 * 2 * 16 * 4 * 10


def test_latent_contexts_keep_values_inside_keys():
    from megatron.core.inference.contexts.static_context import StaticInferenceContext

    init_single_rank()
    ctx = StaticInferenceContext(max_batch_size=2, max_sequence_length=8, cache_mla_latents=True)
    key = torch.randn(3, 2, 1, 6)
    query = torch.randn(3, 2, 4, 6)
    ctx.attend(1, query, key, key[..., :4], None, 0.5, None)
    cached_key, cached_value = ctx.key_value_memory_dict[1]
    assert cached_value.data_ptr() == cached_key.data_ptr() and cached_value.shape[-1] == 4
    ctx.swap_key_value_dict(torch.tensor([1, 0]))
    cached_key, cached_value = ctx.key_value_memory_dict[1]
    assert cached_value.data_ptr() == cached_key.data_ptr() and torch.equal(cached_key[:3, 0], key[:, 1])
    with pytest.raises(ValueError, match="cache_mla_latents"):  # ordinary attention: values are not in keys
        ctx.attend(1, query, key, key[..., :4].clone(), None, 0.5, None)
    llama = T.build_model("llama")
    engine = T.dynamic_engine(llama)
    engine.context.cache_mla_latents = True
    with pytest.raises(ValueError, match="cache_mla_latents"):
        engine.generate([[1, 2, 3]], _greedy(2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["mla", "mla-latent", "hybrid"])
def test_cuda_graph_dynamic_steps_equal_reference_on_gpu(kind):
    """On CUDA (Triton SSD kernels for Mamba), eager and graphed dynamic steps give the CPU reference's tokens."""
    init_single_rank()
    model = build_hybrid_model() if kind == "hybrid" else build_mla_model()
    prompts = T.prompts(5, [5, 70, 1, 13, 9], seed=3)
    budgets = [9, 4, 12, 3, 7]
    expected = [T.reference_greedy(model, p, n) for p, n in zip(prompts, budgets)]
    model.cuda()
    _check_mid_flight(model, prompts, budgets, {0: [0, 1], 2: [2], 3: [3, 4]}, expected,
                      cache_mla_latents=kind == "mla-latent", device=torch.device("cuda"))
