"""Upcycling a dense GPT into an MoE model (`upcycling_utils`), checked against the rule written in the test
(arXiv 2410.07524 as Megatron 0.13.1 applies it): granularity 1 copies the dense MLP into every expert and gives the
dense model's logits exactly (top-k probabilities sum to 1); granularity 2 splits the gated fc1 and fc2 into two
slices, scales them by a^(1/3), repeats them over the experts and repeats the first E/g router rows g times; both
for SequentialMLP and GroupedMLP."""
import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.moe.upcycling_utils import upcycle_state_dict
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit.transformer.model_setup import init_single_rank

VOCAB, SEQ, HIDDEN, FFN, EXPERTS = 64, 8, 16, 24, 4


def _model(experts=None, ffn=FFN, grouped=False, pre_softmax=False):
    config = TransformerConfig(
        num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=ffn, moe_ffn_hidden_size=FFN,
        num_moe_experts=experts, moe_router_topk=2, moe_grouped_gemm=grouped, moe_router_pre_softmax=pre_softmax,
        add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm",
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True, moe_token_dispatcher_type="alltoall")
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    return GPTModel(config, spec, VOCAB, SEQ, position_embedding_type="rope",
                    share_embeddings_and_output_weights=False).eval()


def _logits(model):
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model(tokens, torch.arange(SEQ).unsqueeze(0).expand(2, SEQ), None)


def _expert_weights(model, layer, grouped):
    """[(fc1 [2f, h], fc2 [h, f])] per expert of `layer`, from either layout."""
    experts = model.decoder.layers[layer].mlp.experts
    if not grouped:
        return [(e.linear_fc1.weight.detach(), e.linear_fc2.weight.detach()) for e in experts.local_experts]
    w1 = experts.weight1.detach().view(EXPERTS, HIDDEN, -1)
    w2 = experts.weight2.detach().view(EXPERTS, -1, HIDDEN)
    return [(w1[e].t(), w2[e].t()) for e in range(EXPERTS)]


@pytest.mark.parametrize("grouped", [False, True])
def test_granularity_1_copies_the_dense_mlp_and_keeps_the_logits(grouped):
    init_single_rank(seed=5)
    dense, moe = _model(), _model(EXPERTS, grouped=grouped)
    fresh_router = moe.decoder.layers[0].mlp.router.weight.detach().clone()
    moe.load_state_dict(upcycle_state_dict(moe, dense, granularity=1))
    for layer in range(2):
        mlp = dense.decoder.layers[layer].mlp
        for fc1, fc2 in _expert_weights(moe, layer, grouped):
            assert torch.equal(fc1, mlp.linear_fc1.weight) and torch.equal(fc2, mlp.linear_fc2.weight)
    assert torch.equal(moe.decoder.layers[0].mlp.router.weight, fresh_router)
    torch.testing.assert_close(_logits(moe), _logits(dense), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("grouped,pre_softmax", [(False, False), (True, True)])
def test_granularity_2_slices_scales_and_repeats(grouped, pre_softmax):
    init_single_rank(seed=6)
    granularity = 2
    dense, moe = _model(ffn=FFN * granularity), _model(EXPERTS, grouped=grouped, pre_softmax=pre_softmax)
    router = moe.decoder.layers[1].mlp.router.weight.detach().clone()
    moe.load_state_dict(upcycle_state_dict(moe, dense, granularity=granularity))
    expansion = EXPERTS // granularity
    a = expansion * granularity * granularity / 2 if pre_softmax else granularity
    scale = a ** (1 / 3)
    mlp = dense.decoder.layers[1].mlp
    gate, up = mlp.linear_fc1.weight.detach()[:FFN * granularity], mlp.linear_fc1.weight.detach()[FFN * granularity:]
    down = mlp.linear_fc2.weight.detach()
    for e, (fc1, fc2) in enumerate(_expert_weights(moe, 1, grouped)):
        piece = e % granularity
        rows = slice(piece * FFN, (piece + 1) * FFN)
        torch.testing.assert_close(fc1, torch.cat([gate[rows], up[rows]]) * scale, rtol=0, atol=0)
        torch.testing.assert_close(fc2, down[:, rows] * scale, rtol=0, atol=0)
    upcycled_router = moe.decoder.layers[1].mlp.router.weight.detach()
    for e in range(EXPERTS):
        assert torch.equal(upcycled_router[e], router[e // granularity])
