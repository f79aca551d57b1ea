"""Inference benchmark on one GPU; prints JSON.

Builds a Llama-1B-shaped HuggingFace checkpoint (random weights, bf16) in a temp dir, converts its weights into
this framework's GPTModel (fused QKV per query group, fused gate/up fc1), checks the greedy tokens agree, then
measures (1) batch-1 decode latency of the static engine vs the HBM bound (weights + KV bytes per token at
`--hbm-gbps`) and (2) the throughput of 64 requests (dynamic engine) vs `transformers`' `generate` on the same weights.

    python benchmarks/gpu/inference_bench.py [--prompt-len 128] [--new-tokens 128] [--hbm-gbps 4800]
"""
import argparse
import json
import tempfile
import time

import torch
import torch.nn.functional as F

SHAPE = dict(hidden=2048, layers=16, heads=32, groups=8, ffn=8192, vocab=32000, max_seq=1024)


def make_hf(path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=SHAPE["hidden"], num_hidden_layers=SHAPE["layers"], num_attention_heads=SHAPE["heads"],
                      num_key_value_heads=SHAPE["groups"], intermediate_size=SHAPE["ffn"], vocab_size=SHAPE["vocab"],
                      max_position_embeddings=SHAPE["max_seq"], tie_word_embeddings=False, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16).cuda().eval()


def build_ours():
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    config = TransformerConfig(num_layers=SHAPE["layers"], hidden_size=SHAPE["hidden"], num_attention_heads=SHAPE["heads"],
                               num_query_groups=SHAPE["groups"], ffn_hidden_size=SHAPE["ffn"], normalization="RMSNorm",
                               gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, bf16=True,
                               params_dtype=torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0,
                               layernorm_epsilon=1e-5)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                     vocab_size=SHAPE["vocab"], max_sequence_length=SHAPE["max_seq"], position_embedding_type="rope",
                     share_embeddings_and_output_weights=False)
    return model.cuda().to(torch.bfloat16).eval()


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
    vocab_size, eod = SHAPE["vocab"], SHAPE["vocab"] - 1

    def tokenize(self, text):
        return [int(x) for x in text.split()]

    def detokenize(self, ids):
        return " ".join(str(int(i)) for i in ids)


def static_engine(model, max_requests):
    from megatron.core.inference.engines.static_engine import StaticInferenceEngine
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import InferenceWrapperConfig
    from megatron.core.inference.text_generation_controllers.text_generation_controller import TextGenerationController

    cfg = InferenceWrapperConfig(hidden_size=SHAPE["hidden"], params_dtype=torch.bfloat16,
                                 inference_batch_times_seqlen_threshold=-1, padded_vocab_size=SHAPE["vocab"],
                                 inference_max_requests=max_requests, inference_max_seq_length=SHAPE["max_seq"])
    return StaticInferenceEngine(TextGenerationController(GPTInferenceWrapper(model, cfg), _Tok()), max_requests)


def dynamic_engine(model):
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
    from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import InferenceWrapperConfig
    from megatron.core.inference.text_generation_controllers.text_generation_controller import TextGenerationController

    ctx = DynamicInferenceContext(torch.bfloat16, SHAPE["layers"], SHAPE["hidden"] // SHAPE["heads"], SHAPE["groups"],
                                  SHAPE["max_seq"], buffer_size_gb=8.0, buffer_guaranteed_fraction=0.1,
                                  chunk_size_tokens=64, max_requests_override=64, max_tokens_override=16384,
                                  device=torch.device("cuda"))
    cfg = InferenceWrapperConfig(hidden_size=SHAPE["hidden"], params_dtype=torch.bfloat16,
                                 inference_batch_times_seqlen_threshold=-1, padded_vocab_size=SHAPE["vocab"])
    controller = TextGenerationController(GPTInferenceWrapper(model, cfg, inference_context=ctx), _Tok())
    return DynamicInferenceEngine(controller, ctx, termination_id=-1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--hbm-gbps", type=float, default=4800.0)
    args = parser.parse_args()
    from megatron.core.inference.sampling_params import SamplingParams

    out = {"shape": SHAPE}
    with tempfile.TemporaryDirectory() as path:
        hf = make_hf(path)
    ours = build_ours()
    missing, unexpected = convert(hf, ours)
    out["convert"] = {"missing": missing, "unexpected": list(unexpected)}
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, SHAPE["vocab"] - 2, (args.prompt_len,), generator=g).tolist() for _ in range(64)]
    greedy = SamplingParams(top_k=1, num_tokens_to_generate=args.new_tokens)
    engine = static_engine(ours, 1)
    text = _Tok().detokenize(prompts[0])
    engine.generate([text], sampling_params=SamplingParams(top_k=1, num_tokens_to_generate=8))  # warm-up
    torch.cuda.synchronize()
    t0 = time.time()
    mine = engine.generate([text], sampling_params=greedy)[0].generated_tokens
    torch.cuda.synchronize()
    decode_s = (time.time() - t0) / args.new_tokens
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompts[0]]).cuda(), max_new_tokens=16, do_sample=False)[0, args.prompt_len:]
    out["greedy_first16_match_hf"] = int(sum(a == b for a, b in zip(mine[:16], ref.tolist())))
    weight_bytes = sum(p.numel() * p.element_size() for p in ours.parameters())
    kv_bytes = 2 * SHAPE["layers"] * SHAPE["groups"] * (SHAPE["hidden"] // SHAPE["heads"]) * 2 * \
        (args.prompt_len + args.new_tokens / 2)
    bound = (weight_bytes + kv_bytes) / (args.hbm_gbps * 1e9)
    out["batch1_decode_ms"] = decode_s * 1e3
    out["hbm_bound_ms"] = bound * 1e3
    out["ratio_to_bound"] = decode_s / bound
    dyn = dynamic_engine(ours)
    dyn.generate(prompts[:2], SamplingParams(top_k=1, num_tokens_to_generate=4))
    torch.cuda.synchronize()
    t0 = time.time()
    results = dyn.generate(prompts, greedy)
    torch.cuda.synchronize()
    ours_tps = sum(len(r.generated_tokens) for r in results) / (time.time() - t0)
    batch = torch.tensor(prompts).cuda()
    with torch.no_grad():
        hf.generate(batch[:2], max_new_tokens=4, do_sample=False)
        torch.cuda.synchronize()
        t0 = time.time()
        gen = hf.generate(batch, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
        torch.cuda.synchronize()
    hf_tps = (gen.shape[1] - args.prompt_len) * 64 / (time.time() - t0)
    out.update(throughput_64_tokens_per_s=ours_tps, hf_generate_tokens_per_s=hf_tps, throughput_ratio=ours_tps / hf_tps)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
