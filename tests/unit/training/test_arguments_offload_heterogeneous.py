"""Command-line rules of `--optimizer-cpu-offload` (and the precision-aware optimizer it needs) and of
`--heterogeneous-layers-config-path` / `-encoded-json` (the command line must match the model's config.json),
and the configs built from them."""
import json

import pytest

from megatron.core.transformer.heterogeneous.heterogeneous_config import HeterogeneousTransformerConfig
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.arguments import ArgumentsError, _parse, core_transformer_config_from_args, validate_args
from megatron.training.arguments.to_configs import optimizer_config_from_args

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --max-position-embeddings 64 "
        "--seq-length 32 --micro-batch-size 2 --train-iters 10 --lr 1e-3").split()
OFFLOAD = "--use-distributed-optimizer --use-precision-aware-optimizer --optimizer-cpu-offload"
LLAMA = ("--swiglu --normalization RMSNorm --group-query-attention --num-query-groups 2 --position-embedding-type rope "
         "--use-rope-scaling --use-rotary-position-embeddings --untie-embeddings-and-output-weights --rotary-base 10000 "
         "--rope-scaling-factor 8.0 --disable-bias-linear")


def hf_config(blocks=None, **overrides):
    """A Llama-Nemotron style config.json matching BASE + LLAMA."""
    blocks = blocks or [
        {"attention": {"n_heads_in_group": 2, "no_op": False, "replace_with_linear": False},
         "ffn": {"ffn_mult": 1.0, "no_op": False, "replace_with_linear": False}},
        {"attention": {"n_heads_in_group": None, "no_op": True, "replace_with_linear": False},
         "ffn": {"ffn_mult": None, "no_op": False, "replace_with_linear": True}},
    ]
    config = {"hidden_act": "silu", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
              "tie_word_embeddings": False, "rope_theta": 10000.0, "rope_scaling": {"factor": 8.0},
              "block_configs": blocks}
    config.update(overrides)
    return config


def _validated(extra):
    args = _parse(BASE + extra.split())
    args.world_size, args.rank = 1, 1
    return validate_args(args)


def _problems(extra):
    with pytest.raises(ArgumentsError) as err:
        _validated(extra)
    return str(err.value)


def test_cpu_offload_rules_and_optimizer_config():
    text = _problems("--optimizer-cpu-offload")
    assert "--optimizer-cpu-offload needs --use-precision-aware-optimizer" in text
    text = _problems("--use-precision-aware-optimizer --optimizer sgd")
    for needle in ("needs --optimizer adam (got --optimizer sgd)", "needs --use-distributed-optimizer",
                   "without --optimizer-cpu-offload needs Transformer Engine's FusedAdam"):
        assert needle in text, text
    assert "--exp-avg-dtype (bf16) is a Megatron-LM flag" in _problems(OFFLOAD + " --exp-avg-dtype bf16")
    args = _validated(OFFLOAD + " --optimizer-offload-fraction 0.25 --overlap-cpu-optimizer-d2h-h2d --no-pin-cpu-grads")
    config = optimizer_config_from_args(args)
    assert (config.optimizer_cpu_offload, config.optimizer_offload_fraction, config.overlap_cpu_optimizer_d2h_h2d,
            config.pin_cpu_grads, config.pin_cpu_params, config.use_precision_aware_optimizer) == (
        True, 0.25, True, False, True, True)
    assert _parse(BASE).optimizer_offload_fraction == 1.0


def test_heterogeneous_command_line_must_match_the_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf_config()))
    text = _problems(f"--heterogeneous-layers-config-path {path} --normalization RMSNorm --rotary-base 500")
    for needle in ("the command line differs from the model's config.json", "--swiglu (missing)",
                   "--group-query-attention (missing)", "--position-embedding-type rope (given: learned_absolute)",
                   "--num-query-groups 2 (given: 1)", "--rotary-base 10000.0 (given: 500)"):
        assert needle in text, text
    assert "--normalization" not in text
    args = _validated(f"--heterogeneous-layers-config-path {path} {LLAMA}")
    assert json.loads(args.heterogeneous_layers_config_encoded_json) == hf_config()
    config = core_transformer_config_from_args(args)
    assert isinstance(config, HeterogeneousTransformerConfig)
    assert [b.mlp.replace_with_linear for b in config.per_block_parameters] == [False, True]
    assert config.get_config_for_layer(1).ffn_hidden_size == 256

    inconsistent = hf_config(blocks=[{"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 1.0}},
                                     {"attention": {"n_heads_in_group": 4}, "ffn": {"ffn_mult": 1.0}}])
    path.write_text(json.dumps(inconsistent))
    assert "n_heads_in_group differs between blocks ([2, 4])" in _problems(
        f"--heterogeneous-layers-config-path {path} {LLAMA}")
    path.write_text(json.dumps(hf_config(hidden_act="gelu", rope_scaling={})))
    assert "lacks rope_scaling.factor" in _problems(f"--heterogeneous-layers-config-path {path} {LLAMA}")
    assert "cannot be read" in _problems(f"--heterogeneous-layers-config-path {tmp_path / 'missing.json'} {LLAMA}")


def test_encoded_json_alone_builds_the_ordinary_model(capsys):
    """Megatron selects the heterogeneous model by the path only; the encoded JSON is checked and kept."""
    args = _parse(BASE + LLAMA.split() + ["--heterogeneous-layers-config-encoded-json", json.dumps(hf_config())])
    args.world_size, args.rank = 1, 0
    validate_args(args)
    assert "builds the ordinary (homogeneous) model" in capsys.readouterr().out
    assert type(core_transformer_config_from_args(args)) is TransformerConfig
