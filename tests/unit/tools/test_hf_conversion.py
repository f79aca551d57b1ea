"""HF conversion: tiny random GPTModels (Llama-style GQA untied, GPT-2-style tied) saved in the legacy
layout, exported to HF, loaded by transformers offline (same logits), and imported back (same weights);
plus TP/PP resharding of the legacy layout and the QKV regrouping alone."""
import json
import os

import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit.transformer.model_setup import init_single_rank
from tools.checkpoint import hf_convert, hf_mapping
from tools.checkpoint.legacy_layout import read_legacy_checkpoint, write_legacy_checkpoint
from tools.checkpoint.model_description import from_megatron_args, hf_architecture

VOCAB, SEQ = 128, 12

LLAMA_ARGS = {
    "num_layers": 2, "hidden_size": 32, "ffn_hidden_size": 48, "num_attention_heads": 4,
    "group_query_attention": True, "num_query_groups": 2, "normalization": "RMSNorm", "norm_epsilon": 1e-5,
    "swiglu": True, "add_bias_linear": False, "position_embedding_type": "rope", "rotary_base": 10000,
    "untie_embeddings_and_output_weights": True, "padded_vocab_size": VOCAB, "max_position_embeddings": 32,
    "params_dtype": "torch.float32",
}
GPT2_ARGS = {
    "num_layers": 2, "hidden_size": 32, "ffn_hidden_size": 64, "num_attention_heads": 4, "normalization": "LayerNorm",
    "norm_epsilon": 1e-5, "add_bias_linear": True, "position_embedding_type": "learned_absolute",
    "untie_embeddings_and_output_weights": False, "padded_vocab_size": VOCAB, "max_position_embeddings": 32,
    "params_dtype": "torch.float32",
}


def _build(args):
    init_single_rank(seed=7)
    llama = args["swiglu"] if "swiglu" in args else False
    config = TransformerConfig(
        add_qkv_bias=args.get("add_qkv_bias", False), qk_layernorm=args.get("qk_layernorm", False),
        num_layers=args["num_layers"], hidden_size=args["hidden_size"], ffn_hidden_size=args["ffn_hidden_size"],
        num_attention_heads=args["num_attention_heads"], num_query_groups=args.get("num_query_groups") if args.get("group_query_attention") else None,
        normalization=args["normalization"], layernorm_epsilon=args["norm_epsilon"],
        activation_func=F.silu if llama else F.gelu, gated_linear_unit=llama, add_bias_linear=args["add_bias_linear"],
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
    )
    model = GPTModel(config, get_gpt_layer_local_spec(qk_layernorm=args.get("qk_layernorm", False),
                                                      normalization=args["normalization"]), vocab_size=VOCAB,
                     max_sequence_length=args["max_position_embeddings"],
                     share_embeddings_and_output_weights=not args["untie_embeddings_and_output_weights"],
                     position_embedding_type=args["position_embedding_type"])
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    return model.eval()


def _roundtrip(tmp_path, args, hf_class_name):
    from transformers import AutoModelForCausalLM

    model = _build(args)
    ckpt = tmp_path / "megatron"
    os.makedirs(ckpt / "iter_0000005" / "mp_rank_00")
    torch.save({"model": model.state_dict(), "args": args, "iteration": 5, "checkpoint_version": 3.0},
               ckpt / "iter_0000005" / "mp_rank_00" / "model_optim_rng.pt")
    (ckpt / "latest_checkpointed_iteration.txt").write_text("5")

    hf_dir = tmp_path / "hf"
    hf_convert.main(["megatron-to-hf", "--load-dir", str(ckpt), "--save-dir", str(hf_dir)])
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["architectures"] == [hf_class_name]
    hf_model = AutoModelForCausalLM.from_pretrained(str(hf_dir), local_files_only=True).eval()
    assert type(hf_model).__name__ == hf_class_name

    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(2, SEQ)
    with torch.no_grad():
        ours = model(tokens, position_ids, None)
        theirs = hf_model(input_ids=tokens).logits
    rel = ((ours - theirs).norm() / ours.norm()).item()
    assert rel <= 1e-4, f"logits differ: relative error {rel}"

    back = tmp_path / "back"
    hf_convert.main(["hf-to-megatron", "--load-dir", str(hf_dir), "--save-dir", str(back)])
    assert (back / "latest_checkpointed_iteration.txt").read_text() == "release"
    imported = torch.load(back / "release" / "mp_rank_00" / "model_optim_rng.pt", weights_only=True)
    original = model.state_dict()
    assert set(imported["model"]) == set(original)
    for key, value in original.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(imported["model"][key], value), key
    model.load_state_dict(imported["model"])
    got, want = from_megatron_args(imported["args"]), from_megatron_args(args)
    for field in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                  "kv_channels", "normalization", "swiglu", "add_bias_linear", "position_embedding_type",
                  "tie_embeddings", "vocab_size", "activation"):
        assert getattr(got, field) == getattr(want, field), field
    return model


def test_llama_style_gqa_untied_export_import(tmp_path):
    os.environ["HF_HUB_OFFLINE"] = "1"
    _roundtrip(tmp_path, LLAMA_ARGS, "LlamaForCausalLM")


@pytest.mark.parametrize("extra,hf_class", [
    ({"add_qkv_bias": True, "untie_embeddings_and_output_weights": False}, "Qwen2ForCausalLM"),
    ({"qk_layernorm": True, "group_query_attention": False, "num_query_groups": None}, "Qwen3ForCausalLM"),
])
def test_qwen_style_export_import(tmp_path, extra, hf_class):
    os.environ["HF_HUB_OFFLINE"] = "1"
    _roundtrip(tmp_path, dict(LLAMA_ARGS, **extra), hf_class)


def test_gpt2_style_tied_export_import(tmp_path):
    os.environ["HF_HUB_OFFLINE"] = "1"
    _roundtrip(tmp_path, GPT2_ARGS, "GPT2LMHeadModel")


def test_qkv_grouping_and_legacy_tp_pp_resharding(tmp_path):
    desc = from_megatron_args(dict(LLAMA_ARGS, num_attention_heads=8, hidden_size=32))
    hn, ng = desc.kv_channels, desc.num_query_groups
    q = torch.arange(8 * hn).float().unsqueeze(1)
    k, v = 1000 + torch.arange(ng * hn).float().unsqueeze(1), 2000 + torch.arange(ng * hn).float().unsqueeze(1)
    qkv = hf_mapping.merge_qkv(q, k, v, desc)
    # group 0 holds q heads 0..3, then k head 0, then v head 0
    assert torch.equal(qkv[: 4 * hn], q[: 4 * hn]) and torch.equal(qkv[4 * hn: 5 * hn], k[:hn])
    assert torch.equal(qkv[5 * hn: 6 * hn], v[:hn]) and torch.equal(qkv[6 * hn: 10 * hn], q[4 * hn: 8 * hn])
    for a, b in zip(hf_mapping.split_qkv(qkv, desc), (q, k, v)):
        assert torch.equal(a, b)

    model = _build(LLAMA_ARGS)
    full = {k: v for k, v in model.state_dict().items()}
    base = from_megatron_args(LLAMA_ARGS)
    write_legacy_checkpoint(str(tmp_path / "tp2pp2"), full, dict(LLAMA_ARGS), base, 9, tp=2, pp=2)
    names = sorted(os.listdir(tmp_path / "tp2pp2" / "iter_0000009"))
    assert names == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    shard = torch.load(tmp_path / "tp2pp2" / "iter_0000009" / "mp_rank_01_001" / "model_optim_rng.pt",
                       weights_only=True)["model"]
    gate, up = torch.chunk(full["decoder.layers.1.mlp.linear_fc1.weight"], 2)
    assert torch.equal(shard["decoder.layers.0.mlp.linear_fc1.weight"], torch.cat([gate[24:], up[24:]]))
    assert torch.equal(shard["decoder.layers.0.self_attention.linear_proj.weight"],
                       full["decoder.layers.1.self_attention.linear_proj.weight"][:, 16:])
    merged, _, iteration, _ = read_legacy_checkpoint(str(tmp_path / "tp2pp2"), from_megatron_args)
    assert iteration == 9 and set(merged) == set(full)
    for key, value in full.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(merged[key], value), key
    with pytest.raises(ValueError, match="GPT-2"):
        hf_architecture(from_megatron_args(dict(GPT2_ARGS, normalization="RMSNorm")))
