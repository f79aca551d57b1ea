"""Inference benchmark on one GPU; prints JSON.

Builds a Llama-1B-shaped HuggingFace checkpoint (random weights, bf16) in a temp dir, converts its weights into
this framework's GPTModel (fused QKV per query group, fused gate/up fc1), checks the greedy tokens agree, then
measures (1) batch-1 decode latency (ms/token) of the static engine, eager, with CUDA-graph decode steps and
with graphs of the `torch.compile`d step, vs the HBM bound (weights + KV bytes per token at `--hbm-gbps`) and
(2) the throughput of 64 requests (dynamic engine, eager and graphed; static engine graphed) vs
`transformers`' `generate` on the same weights. Without `transformers` the model keeps its own random weights,
says so, and skips the HF comparisons. `--smoke`: a 2-layer model on CPU (graph-safe steps run eagerly).

    python benchmarks/gpu/inference_bench.py [--prompt-len 128] [--new-tokens 128] [--hbm-gbps 4800] [--no-compile]
    python benchmarks/gpu/inference_bench.py --smoke
"""
import argparse
import json
import tempfile
import time

import torch
import torch.nn.functional as F

SHAPE = dict(hidden=2048, layers=16, heads=32, groups=8, ffn=8192, vocab=32000, max_seq=1024)
SMOKE_SHAPE = dict(hidden=64, layers=2, heads=4, groups=2, ffn=128, vocab=512, max_seq=96)
DEVICE, DTYPE = "cuda", torch.bfloat16


def make_hf(path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=SHAPE["hidden"], num_hidden_layers=SHAPE["layers"], num_attention_heads=SHAPE["heads"],
                      num_key_value_heads=SHAPE["groups"], intermediate_size=SHAPE["ffn"], vocab_size=SHAPE["vocab"],
                      max_position_embeddings=SHAPE["max_seq"], tie_word_embeddings=False, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(DTYPE).save_pretrained(path)
    return LlamaForCausalLM.from_pretrained(path, torch_dtype=DTYPE).to(DEVICE).eval()


def build_ours(compile_layers="off"):
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not torch.distributed.is_initialized():
        backend = "nccl" if torch.cuda.is_available() and DEVICE == "cuda" else "gloo"
        torch.distributed.init_process_group(backend, init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
        parallel_state.initialize_model_parallel()
    config = TransformerConfig(num_layers=SHAPE["layers"], hidden_size=SHAPE["hidden"], num_attention_heads=SHAPE["heads"],
                               num_query_groups=SHAPE["groups"], ffn_hidden_size=SHAPE["ffn"], normalization="RMSNorm",
                               gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                               bf16=DTYPE == torch.bfloat16, params_dtype=DTYPE, hidden_dropout=0.0, attention_dropout=0.0,
                               layernorm_epsilon=1e-5, compile_layers=compile_layers)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                     vocab_size=SHAPE["vocab"], max_sequence_length=SHAPE["max_seq"], position_embedding_type="rope",
                     share_embeddings_and_output_weights=False)
    return model.to(DEVICE).to(DTYPE).eval()


def convert(hf, ours):
    """HF Llama weights -> GPTModel state dict (Megatron's layout)."""
    sd, src = {}, hf.state_dict()
    hn = SHAPE["hidden"] // SHAPE["heads"]
    per = SHAPE["heads"] // SHAPE["groups"]
    sd["embedding.word_embeddings.weight"] = src["model.embed_tokens.weight"]
    sd["output_layer.weight"] = src["lm_head.weight"]
    sd["decoder.final_layernorm.weight"] = src["model.norm.weight"]
    for i in range(SHAPE["layers"]):
        p, q = f"model.layers.{i}.", f"decoder.layers.{i}."
        wq = src[p + "self_attn.q_proj.weight"].view(SHAPE["groups"], per * hn, -1)
        wk = src[p + "self_attn.k_proj.weight"].view(SHAPE["groups"], hn, -1)
        wv = src[p + "self_attn.v_proj.weight"].view(SHAPE["groups"], hn, -1)
        sd[q + "self_attention.linear_qkv.weight"] = torch.cat([wq, wk, wv], 1).reshape(-1, SHAPE["hidden"])  # [ng, (np/ng+2)*hn, h] -> [.., h]
        sd[q + "self_attention.linear_proj.weight"] = src[p + "self_attn.o_proj.weight"]
        sd[q + "mlp.linear_fc1.weight"] = torch.cat([src[p + "mlp.gate_proj.weight"], src[p + "mlp.up_proj.weight"]], 0)
        sd[q + "mlp.linear_fc2.weight"] = src[p + "mlp.down_proj.weight"]
        sd[q + "input_layernorm.weight"] = src[p + "input_layernorm.weight"]
        sd[q + "pre_mlp_layernorm.weight"] = src[p + "post_attention_layernorm.weight"]
    missing, unexpected = ours.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    return missing, unexpected


class _Tok:
    def __init__(self):
        self.vocab_size, self.eod = SHAPE["vocab"], SHAPE["vocab"] - 1

    def tokenize(self, text):
        return [int(x) for x in text.split()]

    def detokenize(self, ids):
        return " ".join(str(int(i)) for i in ids)


def _wrapper_config(max_requests, graphs, compile_step=False):
    from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import InferenceWrapperConfig

    return InferenceWrapperConfig(hidden_size=SHAPE["hidden"], params_dtype=DTYPE,
                                  inference_batch_times_seqlen_threshold=-1, padded_vocab_size=SHAPE["vocab"],
                                  inference_max_requests=max_requests, inference_max_seq_length=SHAPE["max_seq"],
                                  enable_cuda_graph=graphs, compile_decode_step=compile_step)


def static_engine(model, max_requests, graphs=False, compile_step=False):
    from megatron.core.inference.engines.static_engine import StaticInferenceEngine
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megatron.core.inference.text_generation_controllers.text_generation_controller import TextGenerationController

    wrapper = GPTInferenceWrapper(model, _wrapper_config(max_requests, graphs, compile_step))
    return StaticInferenceEngine(TextGenerationController(wrapper, _Tok()), max_requests)


def dynamic_engine(model, graphs=False):
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
    from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megatron.core.inference.text_generation_controllers.text_generation_controller import TextGenerationController

    ctx = DynamicInferenceContext(DTYPE, SHAPE["layers"], SHAPE["hidden"] // SHAPE["heads"], SHAPE["groups"],
                                  SHAPE["max_seq"], buffer_size_gb=8.0 if DEVICE == "cuda" else 0.01,
                                  buffer_guaranteed_fraction=0.1, chunk_size_tokens=64, max_requests_override=64,
                                  max_tokens_override=16384, device=torch.device(DEVICE))
    wrapper = GPTInferenceWrapper(model, _wrapper_config(64, False), inference_context=ctx)
    controller = TextGenerationController(wrapper, _Tok())
    return DynamicInferenceEngine(controller, ctx, termination_id=-1, enable_cuda_graph=graphs)


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _timed(fn):
    _sync()
    t0 = time.perf_counter()
    result = fn()
    _sync()
    return result, time.perf_counter() - t0


def batch1_decode_ms(model, prompt, new_tokens, graphs, compile_step=False):
    """ms per decoded token: (time of new_tokens - time of 8 tokens) / (new_tokens - 8), prefill cancels out."""
    from megatron.core.inference.sampling_params import SamplingParams

    engine = static_engine(model, 1, graphs, compile_step)
    text = _Tok().detokenize(prompt)
    run = lambda n: engine.generate([text], sampling_params=SamplingParams(top_k=1, num_tokens_to_generate=n))
    run(8)  # warm-up: captures (and compiles) the decode graph
    short = min(_timed(lambda: run(8))[1] for _ in range(2))
    results, long = _timed(lambda: run(new_tokens))
    return (long - short) / (new_tokens - 8) * 1e3, results[0].generated_tokens


def _try(out, name, fn):
    """out[name] = fn(), or the error (the other numbers still count)."""
    try:
        out[name] = fn()
    except Exception as error:
        out[name] = f"failed: {type(error).__name__}: {error}"[:600]
    print(json.dumps({name: out[name]}), flush=True)  # progress, in case the job is cut short


def _decode_check(out, name, eager_tokens, result):
    ms, tokens = result
    out[f"{name}_first32_tokens_equal_eager"] = tokens[:32] == eager_tokens[:32]
    return ms


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--hbm-gbps", type=float, default=4800.0)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--no-compiled-layers", action="store_true",
                        help="skip the --compile-layers on variant (its compilation takes minutes)")
    parser.add_argument("--compile-step", action="store_true", help="also time graphs of the torch.compile'd step")
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU: checks the script runs")
    args = parser.parse_args()
    global DEVICE, DTYPE
    if args.smoke:
        SHAPE.update(SMOKE_SHAPE)
        DEVICE, DTYPE = "cpu", torch.float32
        args.prompt_len, args.new_tokens, args.requests = 16, 24, 6
    run(args)


def _dynamic_throughput(engine, prompts, greedy):
    from megatron.core.inference.sampling_params import SamplingParams

    engine.generate(prompts[:2], SamplingParams(top_k=1, num_tokens_to_generate=4))
    engine.generate(prompts, SamplingParams(top_k=1, num_tokens_to_generate=4))
    results, seconds = _timed(lambda: engine.generate(prompts, greedy))
    return sum(len(r.generated_tokens) for r in results) / seconds


def _static_throughput(model, prompts, greedy):
    from megatron.core.inference.sampling_params import SamplingParams

    engine = static_engine(model, len(prompts), graphs=True)
    texts = [_Tok().detokenize(p) for p in prompts]
    engine.generate(texts, sampling_params=SamplingParams(top_k=1, num_tokens_to_generate=4))
    results, seconds = _timed(lambda: engine.generate(texts, sampling_params=greedy))
    return sum(len(r.generated_tokens) for r in results) / seconds


@torch.no_grad()
def _teacher_forced(hf, ours, ids):
    """Both models on the same tokens (HF's greedy continuation): argmax agreement per position, the largest
    logit difference, and HF's top-1 / top-2 gap where they disagree (bf16 near-ties explain a greedy split)."""
    n = ids.size(1)
    mask = torch.triu(torch.ones(n, n, dtype=torch.bool, device=ids.device), diagonal=1).view(1, 1, n, n)  # [s, s] -> [1, 1, s, s]
    theirs = hf(ids).logits.float()[0]
    mine = ours(ids, torch.arange(n, device=ids.device).unsqueeze(0), mask)[0].float()  # [n] -> [1, n]
    agree = theirs.argmax(-1) == mine.argmax(-1)
    top2 = theirs.topk(2, dim=-1).values
    gaps = (top2[:, 0] - top2[:, 1])[~agree]
    return {"argmax_agree": float(agree.float().mean()), "max_abs_logit_diff": float((theirs - mine).abs().max()),
            "hf_top2_gap_where_disagree_max": float(gaps.max()) if gaps.numel() else 0.0}


def _hf_throughput(hf, prompts, args):
    batch = torch.tensor(prompts).to(DEVICE)
    with torch.no_grad():
        hf.generate(batch[:2], max_new_tokens=4, do_sample=False)
        gen, seconds = _timed(lambda: hf.generate(batch, max_new_tokens=args.new_tokens,
                                                  min_new_tokens=args.new_tokens, do_sample=False))
    return (gen.shape[1] - args.prompt_len) * len(prompts) / seconds


def _summary(out, bound_ms):
    """Best batch-1 latency vs the bound, best throughput vs transformers, and whether the targets are met."""
    best = min(v for k, v in out.items() if k.startswith("batch1_decode_ms") and isinstance(v, float))
    out.update(ratio_to_bound_best=best / bound_ms, batch1_target_met=best <= 1.5 * bound_ms)
    ours = [v for k, v in out.items() if k.startswith("throughput_") and isinstance(v, float)]
    hf = out.get("hf_generate_tokens_per_s")
    if ours and isinstance(hf, float):
        out.update(throughput_ratio_best=max(ours) / hf, throughput_target_met=max(ours) >= 2 * hf)
    print(json.dumps({k: out[k] for k in ("ratio_to_bound_best", "throughput_ratio_best") if k in out}), flush=True)


def _hf_or_none(path, out):
    try:
        return make_hf(path)
    except ImportError as error:
        out["transformers"] = f"not installed ({error}): random weights, no HF comparison"
        return None


def run(args):
    from megatron.core.inference.sampling_params import SamplingParams

    out = {"shape": dict(SHAPE), "device": DEVICE}
    with tempfile.TemporaryDirectory() as path:
        hf = _hf_or_none(path, out)
    torch.manual_seed(0)
    ours = build_ours()
    if hf is not None:
        missing, unexpected = convert(hf, ours)
        out["convert"] = {"missing": missing, "unexpected": list(unexpected)}
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, SHAPE["vocab"] - 2, (args.prompt_len,), generator=g).tolist()
               for _ in range(args.requests)]
    eager_ms, eager_tokens = batch1_decode_ms(ours, prompts[0], args.new_tokens, graphs=False)
    out["batch1_decode_ms_eager"] = eager_ms
    print(json.dumps({"batch1_decode_ms_eager": eager_ms}), flush=True)
    _try(out, "batch1_decode_ms_graphed", lambda: _decode_check(out, "graphed", eager_tokens,
         batch1_decode_ms(ours, prompts[0], args.new_tokens, graphs=True)))
    if args.compile_step:
        _try(out, "batch1_decode_ms_graphed_compiled_step", lambda: _decode_check(
            out, "graphed_compiled_step", eager_tokens, batch1_decode_ms(ours, prompts[0], args.new_tokens, True, True)))
    if hf is not None:
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompts[0]]).to(DEVICE), max_new_tokens=16, do_sample=False)
        out["greedy_first16_match_hf"] = int(sum(a == b for a, b in zip(eager_tokens[:16],
                                                                         ref[0, args.prompt_len:].tolist())))
        _try(out, "teacher_forced_vs_hf", lambda: _teacher_forced(hf, ours, ref))
    weight_bytes = sum(p.numel() * p.element_size() for p in ours.parameters())
    weight_bytes -= ours.embedding.word_embeddings.weight.numel() * ours.embedding.word_embeddings.weight.element_size()
    kv_bytes = 2 * SHAPE["layers"] * SHAPE["groups"] * (SHAPE["hidden"] // SHAPE["heads"]) * DTYPE.itemsize * \
        (args.prompt_len + args.new_tokens / 2)
    bound_ms = (weight_bytes + kv_bytes) / (args.hbm_gbps * 1e9) * 1e3
    out.update(bytes_per_token=weight_bytes + kv_bytes, hbm_bound_ms=bound_ms, ratio_to_bound_eager=eager_ms / bound_ms)
    greedy = SamplingParams(top_k=1, num_tokens_to_generate=args.new_tokens)
    _try(out, "throughput_dynamic_graphed_tokens_per_s",
         lambda: _dynamic_throughput(dynamic_engine(ours, True), prompts, greedy))
    _try(out, "throughput_static_graphed_tokens_per_s", lambda: _static_throughput(ours, prompts, greedy))
    if hf is not None:
        _try(out, "hf_generate_tokens_per_s", lambda: _hf_throughput(hf, prompts, args))
    _try(out, "throughput_dynamic_eager_tokens_per_s",
         lambda: _dynamic_throughput(dynamic_engine(ours, False), prompts, greedy))
    _summary(out, bound_ms)
    compiled = None
    if DEVICE == "cuda" and not args.no_compiled_layers:  # the same weights with --compile-layers on: compiled layers inside the graphs
        compiled = build_ours("on")
        compiled.load_state_dict(ours.state_dict(), strict=False)
        _try(out, "batch1_decode_ms_graphed_compiled_layers", lambda: _decode_check(
            out, "graphed_compiled_layers", eager_tokens, batch1_decode_ms(compiled, prompts[0], args.new_tokens, True)))
    if compiled is not None:
        _try(out, "throughput_dynamic_graphed_compiled_layers_tokens_per_s",
             lambda: _dynamic_throughput(dynamic_engine(compiled, True), prompts, greedy))
    _summary(out, bound_ms)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
