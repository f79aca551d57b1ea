"""convert.py with Megatron's plugin protocol: HF dir -> (llama_mistral loader, core saver at TP=2/PP=2)
-> (core loader, hf saver) -> the same HF weights; plus plugin lookup errors."""
import os

import pytest
import torch

from tools.checkpoint import convert, hf_mapping
from tools.checkpoint.hf_convert import read_hf_dir, write_hf_dir
from tools.checkpoint.model_description import from_megatron_args, to_hf_config

ARGS = {
    "num_layers": 2, "hidden_size": 32, "ffn_hidden_size": 48, "num_attention_heads": 4,
    "group_query_attention": True, "num_query_groups": 2, "normalization": "RMSNorm", "norm_epsilon": 1e-6,
    "swiglu": True, "add_bias_linear": False, "add_qkv_bias": True, "position_embedding_type": "rope",
    "rotary_base": 1000000, "untie_embeddings_and_output_weights": False, "padded_vocab_size": 64,
    "max_position_embeddings": 32, "params_dtype": "torch.float32",
}


def _random_megatron_state(desc):
    g = torch.Generator().manual_seed(0)
    h, ffn = desc.hidden_size, desc.ffn_hidden_size
    qkv_rows = (desc.num_attention_heads + 2 * desc.num_query_groups) * desc.kv_channels
    sd = {"embedding.word_embeddings.weight": torch.randn(desc.vocab_size, h, generator=g),
          "decoder.final_layernorm.weight": torch.randn(h, generator=g)}
    for i in range(desc.num_layers):
        p = f"decoder.layers.{i}."
        shapes = {"input_layernorm.weight": (h,), "self_attention.linear_qkv.weight": (qkv_rows, h),
                  "self_attention.linear_qkv.bias": (qkv_rows,), "self_attention.linear_proj.weight": (h, h),
                  "pre_mlp_layernorm.weight": (h,), "mlp.linear_fc1.weight": (2 * ffn, h),
                  "mlp.linear_fc2.weight": (h, ffn)}
        sd.update({p + k: torch.randn(*s, generator=g) for k, s in shapes.items()})
    return sd


def test_convert_hf_to_core_tp2pp2_and_back(tmp_path):
    desc = from_megatron_args(ARGS)
    hf_state = hf_mapping.megatron_to_hf(_random_megatron_state(desc), desc)
    config = to_hf_config(desc)
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    write_hf_dir(str(tmp_path / "hf_in"), config, hf_state)

    convert.main(["--model-type", "GPT", "--loader", "llama_mistral", "--saver", "mcore",
                  "--load-dir", str(tmp_path / "hf_in"), "--save-dir", str(tmp_path / "mg"),
                  "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2"])
    assert (tmp_path / "mg" / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert sorted(os.listdir(tmp_path / "mg" / "release")) == [
        "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    last = torch.load(tmp_path / "mg" / "release" / "mp_rank_00_001" / "model_optim_rng.pt", weights_only=True)
    assert last["args"]["tensor_model_parallel_size"] == 2 and "output_layer.weight" in last["model"]

    convert.main(["--model-type", "GPT", "--loader", "core", "--saver", "hf",
                  "--load-dir", str(tmp_path / "mg"), "--save-dir", str(tmp_path / "hf_out")])
    out_config, out_state = read_hf_dir(str(tmp_path / "hf_out"))
    assert out_config["model_type"] == "qwen2" and out_config["num_key_value_heads"] == 2
    assert set(out_state) == set(hf_state)
    for key, value in hf_state.items():
        assert torch.equal(out_state[key], value), key


def test_plugin_lookup_errors(tmp_path):
    with pytest.raises(ValueError, match="--loader nosuch: no plugin found"):
        convert.load_plugin("loader", "nosuch")
    assert convert.load_plugin("saver", "megatron").__name__ == "tools.checkpoint.saver_legacy"
