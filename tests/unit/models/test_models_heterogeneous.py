"""Heterogeneous GPT models (single process): how the `block_configs` JSON is read, the per-layer configs, the
parameters each layer gets (shapes from the JSON), forward/backward, no-op layers being identities, the
distributed-checkpoint keys (global layer index, Megatron's renames of the local spec's norms), a torch_dist
round trip, and a local-spec checkpoint loaded into the Transformer Engine layout.
"""
import json

import pytest
import torch
import torch.nn.functional as F

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import StrictHandling
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs import get_gpt_heterogeneous_layer_spec
from megatron.core.transformer.heterogeneous.heterogeneous_config import HeterogeneousTransformerConfig, MLPConfig
from tests.unit.transformer.model_setup import init_single_rank, seed_all

HIDDEN, HEADS, VOCAB, SEQ, BATCH = 32, 8, 64, 16, 2
HEAD_DIM = HIDDEN // HEADS

# Every kind of block: own GQA groups and ffn_mult (HF keys), no-op attention with an explicit intermediate size,
# a linear in place of the MLP, a linear in place of the attention with no MLP, and a block on the model's values.
BLOCKS = [
    {"attention": {"n_heads_in_group": 2, "no_op": False, "replace_with_linear": False},
     "ffn": {"ffn_mult": 1.0, "no_op": False, "replace_with_linear": False}},
    {"attention": {"n_heads_in_group": None, "no_op": True, "replace_with_linear": False},
     "ffn": {"ffn_hidden_size": 48, "no_op": False, "replace_with_linear": False}},
    {"attention": {"num_query_groups": 2, "no_op": False, "replace_with_linear": False},
     "ffn": {"ffn_mult": None, "no_op": False, "replace_with_linear": True}},
    {"attention": {"n_heads_in_group": None, "no_op": False, "replace_with_linear": True},
     "ffn": {"ffn_mult": None, "no_op": True, "replace_with_linear": False}},
    {"attention": {"n_heads_in_group": None, "no_op": False, "replace_with_linear": False},
     "mlp": {"ffn_mult": None, "no_op": False, "replace_with_linear": False}},
]


def heterogeneous_config(blocks=BLOCKS, llama=True, **kwargs) -> HeterogeneousTransformerConfig:
    """A tiny heterogeneous config (Llama-style: RMSNorm, SwiGLU, no biases; else LayerNorm, GeLU, biases)."""
    base = dict(num_layers=len(blocks), hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=8,
                ffn_hidden_size=64, use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                heterogeneous_layers_config_encoded_json=json.dumps({"block_configs": blocks}))
    if llama:
        base.update(normalization="RMSNorm", activation_func=F.silu, gated_linear_unit=True, add_bias_linear=False)
    base.update(kwargs)
    return HeterogeneousTransformerConfig(**base)


def heterogeneous_model(config, use_te=False, seed=1234) -> GPTModel:
    """The GPT model of `config` (RoPE, untied output layer) with weights from `seed`."""
    seed_all(seed)
    return GPTModel(config, get_gpt_heterogeneous_layer_spec(config, use_te), vocab_size=VOCAB, max_sequence_length=SEQ,
                    position_embedding_type="rope", share_embeddings_and_output_weights=False)


def batch(seed=0):
    """(tokens, position ids, labels) of one micro-batch."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return tokens, torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ), torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)


def test_block_configs_are_read_like_megatron(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"block_configs": BLOCKS, "hidden_size": HIDDEN}))
    config = heterogeneous_config(heterogeneous_layers_config_encoded_json="", heterogeneous_layers_config_path=str(path))
    assert config.heterogeneous_block_specs and json.loads(config.heterogeneous_layers_config_encoded_json)
    attention = [(b.attention.no_op, b.attention.replace_with_linear, b.attention.num_query_groups)
                 for b in config.per_block_parameters]
    mlp = [(b.mlp.no_op, b.mlp.replace_with_linear, b.mlp.ffn_hidden_size) for b in config.per_block_parameters]
    assert attention == [(False, False, 4), (True, False, None), (False, False, 2), (False, True, None),
                         (False, False, None)]
    assert mlp == [(False, False, 256), (False, False, 48), (False, True, None), (True, False, None),
                   (False, False, None)]
    layer_configs = [config.get_config_for_layer(n) for n in range(1, 6)]
    assert [c.num_query_groups for c in layer_configs] == [4, 8, 2, 8, 8]
    assert [c.ffn_hidden_size for c in layer_configs] == [256, 48, 64, 64, 64]
    assert type(layer_configs[0]).__name__ == "TransformerConfig" and layer_configs[0].init_method is config.init_method
    # Llama-3.1-70B / Nemotron-Super: ffn_mult 2.625 at hidden 8192 -> 14336; Nemotron's 1.3125 -> 7168.
    assert MLPConfig.ffn_mult_to_intermediate_size(2.625, 8192) == 14336
    assert MLPConfig.ffn_mult_to_intermediate_size(1.3125, 8192) == 7168
    with pytest.raises(ValueError, match="Invalid layer number: 6"):
        config.get_config_for_layer(6)


def test_block_config_problems_are_collected():
    bad = [
        {"attention": {"n_heads_in_group": 3}, "ffn": {"ffn_mult": 1.0}},
        {"attention": {"n_heads_in_group": 2, "no_op": True}, "ffn": {"ffn_hidden_size": 48, "replace_with_linear": True}},
        {"attention": {"no_op": False}, "ffn": {}},
        {"attention": {"n_heads_in_group": 4}},
    ]
    with pytest.raises(ValueError) as error:
        heterogeneous_config(bad, num_layers=5, tensor_model_parallel_size=1)
    message = str(error.value)
    for needle in ("block_configs[0].attention: num_attention_heads (8) must be a multiple of n_heads_in_group (3)",
                   "block_configs[1].attention: num_query_groups (4) is set, but the block is no_op",
                   "block_configs[1].ffn: ffn_hidden_size (48) is set, but the block is replace_with_linear",
                   "block_configs[2].attention needs 'n_heads_in_group'", "block_configs[2].ffn needs 'ffn_mult'",
                   "block_configs[3] has no 'ffn' or 'mlp' object", "block_configs has 4 blocks but num_layers is 5"):
        assert needle in message, message
    with pytest.raises(ValueError, match="no 'block_configs' list"):
        heterogeneous_config(heterogeneous_layers_config_encoded_json=json.dumps({"blocks": []}))


def _expected_shapes():
    """Parameter shapes the JSON asks for, per layer (local spec: separate norms)."""
    def attention(groups):
        return {"input_layernorm.weight": (HIDDEN,), "self_attention.linear_qkv.weight": ((HEADS + 2 * groups) * HEAD_DIM,
                HIDDEN), "self_attention.linear_proj.weight": (HIDDEN, HIDDEN)}

    def mlp(ffn):
        return {"pre_mlp_layernorm.weight": (HIDDEN,), "mlp.linear_fc1.weight": (2 * ffn, HIDDEN),
                "mlp.linear_fc2.weight": (HIDDEN, ffn)}

    linear_mlp = {"pre_mlp_layernorm.weight": (HIDDEN,), "mlp.weight": (HIDDEN, HIDDEN)}
    linear_attention = {"input_layernorm.weight": (HIDDEN,), "self_attention.weight": (HIDDEN, HIDDEN)}
    return [{**attention(4), **mlp(256)}, mlp(48), {**attention(2), **linear_mlp}, linear_attention,
            {**attention(8), **mlp(64)}]


def test_parameters_match_the_json_and_forward_backward_runs():
    init_single_rank()
    model = heterogeneous_model(heterogeneous_config())
    for index, expected in enumerate(_expected_shapes()):
        got = {name: tuple(p.shape) for name, p in model.decoder.layers[index].named_parameters()}
        assert got == expected, f"layer {index}: {got}"
    tokens, position_ids, labels = batch()
    loss = model(tokens, position_ids, None, labels=labels).float().mean()
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())

    identity = heterogeneous_model(heterogeneous_config([{"attention": {"n_heads_in_group": None, "no_op": True},
                                                          "ffn": {"ffn_mult": None, "no_op": True}}]))
    layer = identity.decoder.layers[0]
    assert list(layer.parameters()) == []
    hidden = torch.randn(SEQ, BATCH, HIDDEN)
    assert torch.equal(layer(hidden)[0], hidden)


def test_torch_dist_keys_round_trip_and_te_layout(tmp_path):
    init_single_rank()
    model = heterogeneous_model(heterogeneous_config())
    sharded = model.sharded_state_dict()
    keys = {v.key: v for v in sharded.values() if hasattr(v, "global_shape")}
    # Per-layer keys with the global index, no stacked layer axis; the local norms under Megatron's TE names
    # where Megatron renames them (layers with their own groups / ffn size, linear replacements) only.
    assert keys["decoder.layers.0.self_attention.linear_qkv.weight"].global_shape == (16 * HEAD_DIM, HIDDEN)
    for key in ("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", "decoder.layers.0.mlp.linear_fc1.layer_norm_weight",
                "decoder.layers.1.mlp.linear_fc1.layer_norm_weight", "decoder.layers.2.mlp.layer_norm_weight",
                "decoder.layers.3.self_attention.layer_norm_weight", "decoder.layers.4.input_layernorm.weight",
                "decoder.layers.4.pre_mlp_layernorm.weight", "decoder.layers.2.mlp.weight"):
        assert key in keys, sorted(keys)
    assert not any(k.startswith("decoder.layers.self_attention") for k in keys)
    dist_checkpointing.save(sharded, str(tmp_path / "local"))

    loaded_model = heterogeneous_model(heterogeneous_config(), seed=99)
    loaded = dist_checkpointing.load(loaded_model.sharded_state_dict(), str(tmp_path / "local"))
    loaded_model.load_state_dict(loaded)
    tokens, position_ids, labels = batch(1)
    want = model(tokens, position_ids, None, labels=labels)
    assert torch.equal(loaded_model(tokens, position_ids, None, labels=labels), want)

    # The TE layout (norms fused into the next linear) has the same keys for the first four blocks, so the
    # local checkpoint loads into it and gives the same output (Megatron's renames exist for exactly this).
    blocks = BLOCKS[:4]
    local = heterogeneous_model(heterogeneous_config(blocks))
    dist_checkpointing.save(local.sharded_state_dict(), str(tmp_path / "te"))
    te_model = heterogeneous_model(heterogeneous_config(blocks), use_te=True, seed=5)
    assert "layer_norm_weight" in dict(te_model.decoder.layers[3].self_attention.named_parameters())
    # Only the TE layout's (empty) core-attention extra state is not in the local checkpoint.
    loaded = dist_checkpointing.load(te_model.sharded_state_dict(), str(tmp_path / "te"), strict=StrictHandling.RETURN_ALL)
    loaded, missing, unexpected = loaded
    assert sorted(missing) == [f"decoder.layers.{i}.self_attention.core_attention._extra_state/shard_0_1" for i in (0, 2)]
    assert not unexpected
    te_model.load_state_dict(loaded, strict=False)
    assert torch.allclose(te_model(tokens, position_ids, None, labels=labels),
                          local(tokens, position_ids, None, labels=labels), rtol=1e-5, atol=1e-5)
