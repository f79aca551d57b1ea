"""HF conversion of MoE models both ways: tiny random Mixtral and Qwen3-MoE models built by transformers in the
test (Qwen3-MoE with a dense layer through `mlp_only_layers` and without `norm_topk_prob`, i.e. Megatron's
`--moe-router-pre-softmax`) are saved with `save_pretrained`, imported by `hf_convert.py hf-to-megatron`, run in a
GPTModel built from the imported args (logits equal transformers' <= 1e-4 relative, fp32), exported back by
`megatron-to-hf` and loaded by transformers again (same logits; same tensors as the original HF model).
The import at TP=2 reads back (legacy reader, expert TP = TP) to the same full state dict; a Mixtral-shaped
model trained and saved here in torch_dist (experts stacked, as Megatron stores them) exports with its logits."""
import json
import os

import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit.transformer.model_setup import init_single_rank
from tools.checkpoint import hf_convert
from tools.checkpoint.legacy_layout import read_legacy_checkpoint
from tools.checkpoint.model_description import from_megatron_args

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 96, 10
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False, num_experts_per_tok=2,
              attention_dropout=0.0)


def _mixtral():
    config = transformers.MixtralConfig(**COMMON, intermediate_size=24, num_local_experts=4, rope_theta=1e6)
    return transformers.MixtralForCausalLM(config)


def _qwen3_moe():
    config = transformers.Qwen3MoeConfig(**COMMON, head_dim=8, intermediate_size=40, moe_intermediate_size=16,
                                         num_experts=4, norm_topk_prob=False, mlp_only_layers=[1],
                                         rope_theta=10000.0)
    return transformers.Qwen3MoeForCausalLM(config)


def _randomized(model):
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    return model.float().eval()


def _ours(args, state):
    """A local-spec GPTModel described by the imported `args`, holding `state`."""
    init_single_rank(seed=7)
    desc = from_megatron_args(args)
    config = TransformerConfig(
        num_layers=desc.num_layers, hidden_size=desc.hidden_size, ffn_hidden_size=desc.ffn_hidden_size,
        num_attention_heads=desc.num_attention_heads, num_query_groups=desc.num_query_groups,
        kv_channels=desc.kv_channels, normalization="RMSNorm", layernorm_epsilon=desc.norm_epsilon,
        activation_func=F.silu, gated_linear_unit=True, add_bias_linear=False, qk_layernorm=desc.qk_layernorm,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True, num_moe_experts=desc.num_experts,
        moe_router_topk=desc.moe_router_topk, moe_ffn_hidden_size=desc.moe_ffn_hidden_size,
        moe_router_pre_softmax=desc.moe_router_pre_softmax, moe_layer_freq=desc.moe_layer_freq or 1,
        moe_token_dispatcher_type="alltoall")
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    model = GPTModel(config, spec, VOCAB, SEQ, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False, rotary_base=int(desc.rotary_base))
    model.load_state_dict(state)
    return model.eval()


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("build,arch", [(_mixtral, "MixtralForCausalLM"), (_qwen3_moe, "Qwen3MoeForCausalLM")])
def test_moe_hf_import_and_export_keep_transformers_logits(tmp_path, build, arch):
    os.environ["HF_HUB_OFFLINE"] = "1"
    torch.manual_seed(0)
    hf_model = _randomized(build())
    hf_model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(2, SEQ)
    with torch.no_grad():
        reference = hf_model(input_ids=tokens).logits

    ckpt = tmp_path / "megatron"
    hf_convert.main(["hf-to-megatron", "--load-dir", str(tmp_path / "hf"), "--save-dir", str(ckpt)])
    imported = torch.load(ckpt / "release" / "mp_rank_00" / "model_optim_rng.pt", weights_only=True)
    model = _ours(imported["args"], imported["model"])
    with torch.no_grad():
        ours = model(tokens, position_ids, None)
    assert _rel(ours, reference) <= 1e-4, f"{arch} after import: relative error {_rel(ours, reference)}"

    hf_convert.main(["hf-to-megatron", "--load-dir", str(tmp_path / "hf"), "--save-dir", str(tmp_path / "tp2"),
                     "--target-tensor-parallel-size", "2"])
    full, _, _, _ = read_legacy_checkpoint(str(tmp_path / "tp2"), from_megatron_args)
    for key, value in imported["model"].items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(full[key], value), key

    hf_convert.main(["megatron-to-hf", "--load-dir", str(ckpt), "--save-dir", str(tmp_path / "back")])
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["architectures"] == [arch]
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), local_files_only=True)
    assert type(exported).__name__ == arch
    exported = exported.float().eval()
    original = hf_model.state_dict()
    assert set(exported.state_dict()) == set(original)
    for key, value in exported.state_dict().items():
        assert torch.equal(value, original[key]), key
    with torch.no_grad():
        again = exported(input_ids=tokens).logits
    assert _rel(again, reference) <= 1e-4 and _rel(again, ours) <= 1e-4


MIXTRAL_FLAGS = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
    "--seq-length 16 --max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 2 --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 4095 --log-interval 1 --eval-iters 0 --hidden-dropout 0 "
    "--attention-dropout 0 --seed 9 --lr 1e-3 --train-iters 1 --transformer-impl local --disable-bias-linear "
    "--swiglu --normalization RMSNorm --position-embedding-type rope --rotary-base 1000000 "
    "--untie-embeddings-and-output-weights --num-experts 4 --moe-router-topk 2 --ffn-hidden-size 24 "
    "--ckpt-format torch_dist --save-interval 1"
).split()


def _train_and_save(save_dir, tokens):
    from megatron.training.utils import unwrap_model
    from tests.compat import megatron_fixtures as mf
    from tests.functional.cli import reset_training_state

    code, _, _, built = mf.run([*MIXTRAL_FLAGS, "--save", save_dir])
    assert code is None
    model = unwrap_model(built["model"])[0].eval()
    with torch.no_grad():
        logits = model(tokens, torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens), None)
    reset_training_state()
    return logits


def test_torch_dist_moe_checkpoint_exports_to_mixtral(tmp_path):
    """A Mixtral-shaped model trained and saved here in torch_dist (experts stacked as Megatron stores them)
    exports to an HF Mixtral with the same logits."""
    from tests.harness import run_on_ranks

    os.environ["HF_HUB_OFFLINE"] = "1"
    tokens = torch.randint(0, 4000, (2, 16), generator=torch.Generator().manual_seed(2))
    ours = run_on_ranks(_train_and_save, 1, str(tmp_path / "dist"), tokens)[0]
    hf_convert.main(["megatron-to-hf", "--load-dir", str(tmp_path / "dist"), "--save-dir", str(tmp_path / "hf")])
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), local_files_only=True)
    assert type(hf_model).__name__ == "MixtralForCausalLM"
    with torch.no_grad():
        theirs = hf_model.float().eval()(input_ids=tokens).logits
    assert _rel(theirs[..., :ours.shape[-1]], ours) <= 1e-4
