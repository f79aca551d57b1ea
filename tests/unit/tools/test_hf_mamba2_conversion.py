"""HF `Mamba2ForCausalLM` (tiny random config built here) -> Megatron `MambaModel` -> HF: logits equal (fp32,
1e-4) after import and after export."""
import pytest
import torch

from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec
from megatron.core.models.mamba.mamba_model import MambaModel
from megatron.core.transformer.transformer_config import TransformerConfig
from tools.checkpoint import hf_mapping_mamba

transformers = pytest.importorskip("transformers")

HF_CONFIG = dict(vocab_size=96, hidden_size=32, num_hidden_layers=3, state_size=8, head_dim=8, num_heads=8,
                 n_groups=2, expand=2, conv_kernel=4, chunk_size=8, layer_norm_epsilon=1e-5,
                 tie_word_embeddings=False, use_bias=False, use_conv_bias=True, residual_in_fp32=False)


def _hf_model(tied=False):
    torch.manual_seed(0)
    config = transformers.Mamba2Config(**{**HF_CONFIG, "tie_word_embeddings": tied})
    model = transformers.Mamba2ForCausalLM(config).eval()
    with torch.no_grad():  # make every tensor matter (norm weights, D, dt_bias start at constants)
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "norm_f.weight", ".D", "dt_bias")):
                param.add_(0.3 * torch.randn_like(param))
    return model


def _megatron_model(args):
    config = TransformerConfig(num_layers=args["num_layers"], hidden_size=args["hidden_size"], num_attention_heads=4,
                               mamba_state_dim=args["mamba_state_dim"], mamba_head_dim=args["mamba_head_dim"],
                               mamba_num_groups=args["mamba_num_groups"], mamba_num_heads=args["mamba_num_heads"],
                               normalization="RMSNorm", layernorm_epsilon=args["norm_epsilon"],
                               add_bias_linear=False, use_cpu_initialization=True, hidden_dropout=0.0)
    return MambaModel(config, mamba_stack_spec, args["padded_vocab_size"], 64,
                      hybrid_override_pattern=args["hybrid_override_pattern"],
                      share_embeddings_and_output_weights=not args["untie_embeddings_and_output_weights"],
                      position_embedding_type="none").eval()


@pytest.fixture(autouse=True)
def _single_process():
    parallel_state.destroy_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    yield


@pytest.mark.parametrize("tied", [False, True])
def test_mamba2_logits_equal_after_import_and_export(tied):
    hf = _hf_model(tied)
    hf_config = hf.config.to_dict()
    args = hf_mapping_mamba.megatron_args_from_hf_config(hf_config)
    model = _megatron_model(args)
    state = hf_mapping_mamba.hf_to_megatron(hf.state_dict(), hf_config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
    ids = torch.randint(0, HF_CONFIG["vocab_size"], (2, 21))
    with torch.no_grad():
        want = hf(ids).logits
        got = model(ids, torch.arange(21)[None].expand(2, -1), None)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)

    exported = hf_mapping_mamba.megatron_to_hf(model.state_dict(), args["num_layers"], tied)
    config_back = hf_mapping_mamba.hf_config_from_megatron_args(args)
    back = transformers.Mamba2ForCausalLM(transformers.Mamba2Config(**{**config_back, "chunk_size": 8})).eval()
    missing, unexpected = back.load_state_dict(exported, strict=True), None
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, want, rtol=1e-4, atol=1e-4)


def test_unsupported_hf_configs_are_named():
    with pytest.raises(ValueError, match="use_bias=True.*conv_kernel=3"):
        hf_mapping_mamba.megatron_args_from_hf_config({**HF_CONFIG, "use_bias": True, "conv_kernel": 3})
    with pytest.raises(ValueError, match="Mamba layers only"):
        hf_mapping_mamba.hf_config_from_megatron_args({"num_layers": 2, "hybrid_override_pattern": "M*",
                                                       "hidden_size": 32, "mamba_head_dim": 8})


def test_hf_convert_cli_round_trip_through_directories(tmp_path):
    from megatron.core.dist_checkpointing.safe_load import safe_torch_load
    from tools.checkpoint import hf_convert

    hf = _hf_model()
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    hf_convert.main(["hf-to-megatron", "--load-dir", str(tmp_path / "hf"), "--save-dir", str(tmp_path / "meg")])
    state = safe_torch_load(str(tmp_path / "meg" / "release" / "mp_rank_00" / "model_optim_rng.pt"))
    model = _megatron_model(state["args"])
    model.load_state_dict(state["model"], strict=False)
    ids = torch.randint(0, HF_CONFIG["vocab_size"], (1, 13))
    with torch.no_grad():
        want = hf(ids).logits
        torch.testing.assert_close(model(ids, torch.arange(13)[None], None), want, rtol=1e-4, atol=1e-4)
    hf_convert.main(["megatron-to-hf", "--load-dir", str(tmp_path / "meg"), "--save-dir", str(tmp_path / "back")])
    back = transformers.Mamba2ForCausalLM.from_pretrained(str(tmp_path / "back")).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, want, rtol=1e-4, atol=1e-4)


def test_tp_shards_follow_megatron_per_rank_layout():
    args = hf_mapping_mamba.megatron_args_from_hf_config(HF_CONFIG)
    rows = 2 * 64 + 2 * 2 * 8 + 8
    full = torch.arange(rows, dtype=torch.float32)[:, None].expand(rows, 32)
    shards = [hf_mapping_mamba.shard_for_tp("decoder.layers.0.mixer.in_proj.weight", full, r, 2, args)
              for r in range(2)]
    z0, x0 = shards[0][:32, 0], shards[0][32:64, 0]
    assert z0.tolist() == list(range(32)) and x0.tolist() == list(range(64, 96))
    assert shards[1][:32, 0].tolist() == list(range(32, 64))
    dt1 = shards[1][-4:, 0]
    assert dt1.tolist() == list(range(rows - 4, rows))
