"""GPTModel end to end (single process, TP=PP=1): parameter count, shapes, loss, tying, Llama-style
configs, Float16Module, and activation recompute reproducing the no-recompute run bit for bit."""
import pytest
import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.torch_norm import RMSNorm
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit.transformer.model_setup import init_single_rank, seed_all

VOCAB, SEQ, BATCH = 128, 16, 2


def _batch(seed=0):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    return tokens, position_ids, labels


def _gpt_config(**kwargs):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True)
    base.update(kwargs)
    return TransformerConfig(**base)


def _llama_config(**kwargs):
    return _gpt_config(
        normalization="RMSNorm", activation_func=F.silu, gated_linear_unit=True, add_bias_linear=False,
        num_query_groups=2, qk_layernorm=True, ffn_hidden_size=48, hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=True, **kwargs,
    )


def test_megatron_parameter_count():
    init_single_rank()
    config = TransformerConfig(num_layers=2, hidden_size=12, num_attention_heads=4, use_cpu_initialization=True)
    model = GPTModel(config, get_gpt_layer_with_transformer_engine_spec(), vocab_size=100, max_sequence_length=4)
    assert sum(p.numel() for p in model.parameters()) == 6240
    local = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=100, max_sequence_length=4)
    assert sum(p.numel() for p in local.parameters()) == 6240


def test_gpt_forward_logits_loss_and_backward():
    init_single_rank()
    model = GPTModel(_gpt_config(), get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ)
    model.eval()
    tokens, position_ids, labels = _batch()
    logits = model(tokens, position_ids, None)
    assert logits.shape == (BATCH, SEQ, VOCAB)
    loss = model(tokens, position_ids, None, labels=labels)
    assert loss.shape == (BATCH, SEQ)
    expected = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none").view(BATCH, SEQ)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    causal_mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    torch.testing.assert_close(model(tokens, position_ids, causal_mask), logits, rtol=1e-5, atol=1e-5)
    tokens_changed = tokens.clone()
    tokens_changed[:, -1] = (tokens[:, -1] + 1) % VOCAB
    torch.testing.assert_close(model(tokens_changed, position_ids, None)[:, :-1], logits[:, :-1])
    model.train()
    model(tokens, position_ids, None, labels=labels).mean().backward()
    assert all(p.grad is not None for p in model.parameters())
    assert model.output_layer.weight.is_embedding_or_output_parameter


def test_gpt_tied_embeddings_and_pipeline_stages():
    init_single_rank()
    config = _gpt_config(hidden_dropout=0.0, attention_dropout=0.0)
    tied = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ,
                    share_embeddings_and_output_weights=True)
    assert tied.output_layer.weight is None
    assert tied.shared_embedding_or_output_weight() is tied.embedding.word_embeddings.weight
    assert tied.embedding.word_embeddings.weight.zero_out_wgrad
    tokens, position_ids, labels = _batch()
    hidden = tied.decoder(tied.embedding(tokens, position_ids), None)
    expected = (hidden @ tied.embedding.word_embeddings.weight.t()).transpose(0, 1)
    torch.testing.assert_close(tied(tokens, position_ids, None), expected)
    seed_all(5)
    first = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ, post_process=False)
    assert not hasattr(first, "output_layer")
    last = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ, pre_process=False)
    assert not hasattr(last, "embedding") and last.decoder.final_layernorm is not None
    assert first.decoder.final_layernorm is None
    hidden = first(tokens, position_ids, None)
    assert hidden.shape == (SEQ, BATCH, 32)
    last.set_input_tensor(hidden)
    loss = last(None, None, None, labels=labels)
    assert loss.shape == (BATCH, SEQ)


def test_llama_style_gpt_and_block_spec():
    init_single_rank()
    config = _llama_config()
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope",
                     rotary_base=10000)
    attention = model.decoder.layers[0].self_attention
    assert isinstance(model.decoder.layers[0].input_layernorm, RMSNorm)
    assert isinstance(attention.q_layernorm, RMSNorm) and attention.q_layernorm.weight.shape == (8,)
    assert attention.linear_qkv.weight.shape == ((4 + 2 * 2) * 8, 32)
    assert attention.linear_qkv.bias is None and model.decoder.layers[0].mlp.linear_fc1.weight.shape == (96, 32)
    assert not hasattr(model.embedding, "position_embeddings")
    assert "rotary_pos_emb.inv_freq" not in model.state_dict()
    assert model.decoder.layers[1].layer_number == 2
    tokens, position_ids, labels = _batch()
    logits = model(tokens, position_ids, None)
    assert logits.shape == (BATCH, SEQ, VOCAB) and torch.isfinite(logits).all()
    loss = model(tokens, position_ids, None, labels=labels)
    loss.mean().backward()
    assert model.output_layer.weight.grad is not None
    assert model.decoder.layers[0].self_attention.k_layernorm.weight.grad.abs().sum() > 0
    shuffled = tokens.clone()
    shuffled[:, 1:] = tokens[:, 1:].flip(1)
    assert not torch.allclose(model(shuffled, position_ids, None)[:, -1], logits[:, -1])


def test_float16_module_casts_inputs_and_outputs():
    init_single_rank()
    config = _gpt_config(bf16=True, hidden_dropout=0.0, attention_dropout=0.0)
    model = Float16Module(config, GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ))
    assert model.module.embedding.word_embeddings.weight.dtype == torch.bfloat16
    tokens, position_ids, labels = _batch()
    logits = model(tokens, position_ids, None)
    assert logits.dtype == torch.float32 and logits.shape == (BATCH, SEQ, VOCAB)
    assert set(model.state_dict()) == set(model.module.state_dict())
    with pytest.raises(ValueError, match="fp16 or config.bf16"):
        Float16Module(_gpt_config(), torch.nn.Linear(2, 2))


RECOMPUTE_MODES = [
    dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
    dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    dict(recompute_granularity="selective"),
    dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp", "layernorm"]),
]


def _loss_and_grads(config_kwargs, llama, dropout_seed=23):
    seed_all(11)
    config = _llama_config(**config_kwargs) if llama else _gpt_config(num_layers=3, **config_kwargs)
    if llama:
        config.hidden_dropout = config.attention_dropout = 0.2
    model = GPTModel(config, get_gpt_layer_local_spec(qk_layernorm=llama), vocab_size=VOCAB, max_sequence_length=SEQ,
                     position_embedding_type="rope" if llama else "learned_absolute")
    tokens, position_ids, labels = _batch()
    seed_all(dropout_seed)
    loss = model(tokens, position_ids, None, labels=labels).sum()
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("llama", [False, True])
def test_recompute_is_bitwise_identical_with_dropout(llama):
    init_single_rank()
    reference_loss, reference_grads = _loss_and_grads({}, llama)
    other_seed_loss = _loss_and_grads({}, llama, dropout_seed=24)[0]
    assert not torch.equal(reference_loss, other_seed_loss), "dropout must be active for this test to mean anything"
    for mode in RECOMPUTE_MODES:
        loss, grads = _loss_and_grads(mode, llama)
        assert torch.equal(loss, reference_loss), mode
        for name, grad in reference_grads.items():
            assert torch.equal(grads[name], grad), (mode, name)


def test_transformer_engine_spec_has_te_keys_and_equals_local_spec():
    init_single_rank()
    config = _gpt_config(hidden_dropout=0.0, attention_dropout=0.0, layernorm_zero_centered_gamma=True)
    te_model = GPTModel(config, get_gpt_layer_with_transformer_engine_spec(), vocab_size=VOCAB, max_sequence_length=SEQ)
    local = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ)
    te_keys = list(te_model.state_dict())
    prefix = "decoder.layers.0."
    layer_keys = [k[len(prefix):] for k in te_keys if k.startswith(prefix)]
    assert layer_keys == [
        "self_attention.core_attention._extra_state",
        "self_attention.linear_proj.weight", "self_attention.linear_proj.bias", "self_attention.linear_proj._extra_state",
        "self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.layer_norm_bias",
        "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias", "self_attention.linear_qkv._extra_state",
        "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.layer_norm_bias", "mlp.linear_fc1.weight",
        "mlp.linear_fc1.bias", "mlp.linear_fc1._extra_state",
        "mlp.linear_fc2.weight", "mlp.linear_fc2.bias", "mlp.linear_fc2._extra_state",
    ]
    renames = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_", "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
    with torch.no_grad():
        for param in local.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    converted = {k: v for k, v in local.state_dict().items()}
    for key in list(converted):
        for old, new in renames.items():
            if old in key:
                converted[key.replace(old, new)] = converted.pop(key)
    missing, unexpected = te_model.load_state_dict(converted, strict=False)
    assert all(k.endswith("_extra_state") for k in missing) and not unexpected
    tokens, position_ids, labels = _batch()
    torch.testing.assert_close(te_model(tokens, position_ids, None), local(tokens, position_ids, None))
    llama = _llama_config()
    te_llama = GPTModel(llama, get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True), vocab_size=VOCAB,
                        max_sequence_length=SEQ, position_embedding_type="rope")
    qkv = te_llama.decoder.layers[0].self_attention.linear_qkv
    assert qkv.layer_norm_bias is None and qkv.bias is None and isinstance(
        te_llama.decoder.layers[0].self_attention.q_layernorm, RMSNorm)
    te_llama(tokens, position_ids, None, labels=labels).sum().backward()
    assert qkv.layer_norm_weight.grad is not None


def test_sharded_state_dict_round_trip_local_to_te_spec(tmp_path):
    from megatron.core import dist_checkpointing

    init_single_rank()
    config = _gpt_config(hidden_dropout=0.0, attention_dropout=0.0, gated_linear_unit=True, activation_func=F.silu,
                         ffn_hidden_size=48)
    local = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ)
    with torch.no_grad():
        for param in local.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    sharded = local.sharded_state_dict()
    norm = sharded["decoder.layers.1.input_layernorm.weight"]
    assert norm.key == "decoder.layers.self_attention.linear_qkv.layer_norm_weight"
    assert norm.global_shape == (2, 32) and norm.global_offset == (1, 0)
    fc1 = sharded["decoder.layers.0.mlp.linear_fc1.weight"].build()
    assert [t.global_offset for t in fc1] == [(0, 0, 0), (0, 48, 0)] and fc1[0].global_shape == (2, 96, 32)
    dist_checkpointing.save(sharded, str(tmp_path))
    te_model = GPTModel(config, get_gpt_layer_with_transformer_engine_spec(), vocab_size=VOCAB, max_sequence_length=SEQ)
    loaded = dist_checkpointing.load(te_model.sharded_state_dict(), str(tmp_path), strict="log_all")
    te_model.load_state_dict(loaded, strict=False)
    tokens, position_ids, _ = _batch()
    torch.testing.assert_close(te_model(tokens, position_ids, None), local(tokens, position_ids, None))
