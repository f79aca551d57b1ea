"""HF DeepseekV3 <-> Megatron (MLA + MoE) conversion: logits equal transformers' after import and after export.

A tiny random DeepseekV3 config is built here (YaRN with mscale = mscale_all_dim != 1, q LoRA, 2 dense + MoE
layers, grouped routing with a non-zero correction bias, a shared expert, routed scaling), fp32.
"""
import pytest
import torch

from tests.unit.transformer.model_setup import init_single_rank

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 96, 12


def _hf_model(q_lora_rank):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
        routed_scaling_factor=2.5, kv_lora_rank=12, q_lora_rank=q_lora_rank, qk_rope_head_dim=8, v_head_dim=10,
        qk_nope_head_dim=6, n_group=4, topk_group=2, num_experts_per_tok=4, first_k_dense_replace=1,
        norm_topk_prob=True, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1, "mscale": 0.8,
                         "mscale_all_dim": 0.8},
        attention_dropout=0.0, initializer_range=0.2)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.uniform_(-0.3, 0.3)
            layer.mlp.gate.weight.normal_(0, 0.3)
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.6, 1.4)
    return config, model


def _megatron_model(megatron_kwargs):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    config = MLATransformerConfig(**megatron_kwargs, use_cpu_initialization=True, attention_dropout=0.0,
                                  hidden_dropout=0.0, activation_func=torch.nn.functional.silu)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    return config, GPTModel(config, spec, VOCAB, SEQ, position_embedding_type="rope",
                            share_embeddings_and_output_weights=False).eval()


@pytest.mark.parametrize("q_lora_rank", [20, None])
def test_deepseek_v3_import_and_export_match_transformers(q_lora_rank):
    from tools.checkpoint import hf_deepseek_v3 as conv

    init_single_rank()
    hf_config, hf = _hf_model(q_lora_rank)
    kwargs = conv.megatron_config_from_hf(hf_config.to_dict())
    assert kwargs["moe_layer_freq"] == [0, 1, 1] and kwargs["mscale"] == kwargs["mscale_all_dim"] == 0.8
    config, model = _megatron_model(kwargs)
    state = conv.hf_to_megatron(hf.state_dict(), config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert all(k.endswith(("_extra_state", "local_tokens_per_expert")) for k in missing), missing
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(SEQ).unsqueeze(0).expand(2, SEQ)
    with torch.no_grad():
        want = hf(input_ids=tokens).logits
        got = model(tokens, positions, None)
    assert (got - want).abs().max().item() <= 1e-4 * max(1.0, want.abs().max().item())

    # export: a fresh HF model from the exported config and weights gives the same logits
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    exported_config = conv.hf_config_from_megatron(config, VOCAB, max_position_embeddings=64)
    back_config = DeepseekV3Config(**{k: v for k, v in exported_config.items() if k != "architectures"})
    back_config._attn_implementation = "eager"
    back = DeepseekV3ForCausalLM(back_config).eval()
    exported = conv.megatron_to_hf(model.state_dict(), config)
    missing, unexpected = back.load_state_dict(exported, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    with torch.no_grad():
        again = back(input_ids=tokens).logits
    assert (again - want).abs().max().item() <= 1e-4 * max(1.0, want.abs().max().item())
    for key, value in hf.state_dict().items():
        assert torch.equal(exported[key], value), key


def test_unrepresentable_configs_are_refused():
    from tools.checkpoint import hf_deepseek_v3 as conv

    hf_config, _ = _hf_model(20)
    bad = hf_config.to_dict()
    bad["rope_parameters"] = dict(bad["rope_parameters"], mscale=1.0)
    with pytest.raises(ValueError, match="mscale"):
        conv.megatron_config_from_hf(bad)
    bad = dict(hf_config.to_dict(), norm_topk_prob=False)
    with pytest.raises(ValueError, match="norm_topk_prob"):
        conv.megatron_config_from_hf(bad)


def test_hf_convert_directories_round_trip(tmp_path):
    """hf_convert.py both ways on directories: config.json + safetensors -> legacy checkpoint (PP=1) -> HF."""
    from tools.checkpoint import hf_convert

    hf_config, hf = _hf_model(20)
    config = {k: v for k, v in hf_config.to_dict().items() if not k.startswith("_")}
    hf_convert.write_hf_dir(str(tmp_path / "hf"), config, dict(hf.state_dict()))
    hf_convert.main(["hf-to-megatron", "--load-dir", str(tmp_path / "hf"), "--save-dir", str(tmp_path / "mg")])
    assert (tmp_path / "mg" / "release" / "mp_rank_00" / "model_optim_rng.pt").is_file()
    hf_convert.main(["megatron-to-hf", "--load-dir", str(tmp_path / "mg"), "--save-dir", str(tmp_path / "back")])
    back_config, back_state = hf_convert.read_hf_dir(str(tmp_path / "back"))
    assert back_config["model_type"] == "deepseek_v3" and back_config["first_k_dense_replace"] == 1
    assert back_config["rope_parameters"]["mscale_all_dim"] == 0.8
    for key, value in hf.state_dict().items():
        assert torch.equal(back_state[key], value), key


def _tp2_logits_error(ckpt_dir, kwargs, tokens, want):
    """On each of 2 ranks: a TP=2 MLA + MoE model loaded strictly from its legacy shard; max |logits - HF|."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.safe_load import safe_torch_load
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
    from tests.unit.transformer.model_setup import seed_all

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    seed_all(0)
    _, model = _megatron_model(dict(kwargs, tensor_model_parallel_size=2))
    rank = parallel_state.get_tensor_model_parallel_rank()
    shard = safe_torch_load(f"{ckpt_dir}/release/mp_rank_{rank:02d}/model_optim_rng.pt")
    missing, unexpected = model.load_state_dict(shard["model"], strict=False)
    assert not unexpected, unexpected
    assert all(k.endswith(("_extra_state", "local_tokens_per_expert")) for k in missing), missing
    positions = torch.arange(SEQ).unsqueeze(0).expand(tokens.shape[0], SEQ)
    with torch.no_grad():
        got = gather_from_tensor_model_parallel_region(model(tokens, positions, None))  # [b, s, V/2] -> [b, s, V]
    return shard["args"]["tensor_model_parallel_size"], (got - want).abs().max().item()


def test_hf_import_at_tp2_loads_into_a_tp2_model_with_transformers_logits(tmp_path):
    """hf-to-megatron --target-tensor-parallel-size 2: each rank's shard of the MLA projections, the experts
    (expert TP = TP) and the shared expert loads into a TP=2 model whose logits equal transformers'; converting
    back merges the shards into the original weights."""
    from tests.harness import run_on_ranks
    from tools.checkpoint import hf_convert
    from tools.checkpoint import hf_deepseek_v3 as conv

    hf_config, hf = _hf_model(20)
    config = {k: v for k, v in hf_config.to_dict().items() if not k.startswith("_")}
    hf_convert.write_hf_dir(str(tmp_path / "hf"), config, dict(hf.state_dict()))
    hf_convert.main(["hf-to-megatron", "--load-dir", str(tmp_path / "hf"), "--save-dir", str(tmp_path / "mg"),
                     "--target-tensor-parallel-size", "2"])
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(input_ids=tokens).logits
    kwargs = conv.megatron_config_from_hf(config)
    for tp, error in run_on_ranks(_tp2_logits_error, 2, str(tmp_path / "mg"), kwargs, tokens, want, timeout=120):
        assert tp == 2 and error <= 1e-4 * max(1.0, want.abs().max().item()), error
    hf_convert.main(["megatron-to-hf", "--load-dir", str(tmp_path / "mg"), "--save-dir", str(tmp_path / "back")])
    _, back_state = hf_convert.read_hf_dir(str(tmp_path / "back"))
    for key, value in hf.state_dict().items():
        assert torch.equal(back_state[key], value), key
