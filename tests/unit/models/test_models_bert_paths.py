"""BERT's attention-mask path: a batch without padding reaches SDPA with no mask (non-causal), so the GPU runs
its flash/cuDNN kernel; a padded batch passes the broadcast [b, 1, 1, s] key mask, never a [b, 1, s, s] one.
Outputs of both paths equal the explicit-mask computation. The GPU test (skipped without CUDA) runs BERT in
bf16 under Float16Module with GPT's fused bias-GeLU and checks it against the fp32 CPU model."""
import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.bert.bert_layer_specs import get_bert_layer_with_transformer_engine_spec
from megatron.core.models.bert.bert_model import BertModel
from megatron.core.transformer import dot_product_attention
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit.transformer.model_setup import init_single_rank, seed_all

VOCAB, SEQ, BATCH = 128, 32, 2


def _model(**kwargs):
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
                               hidden_dropout=0.0, attention_dropout=0.0, **kwargs)
    return BertModel(config, 2, get_bert_layer_with_transformer_engine_spec(), VOCAB, SEQ,
                     share_embeddings_and_output_weights=True)


def _batch(padded: bool, device="cpu"):
    gen = torch.Generator().manual_seed(1)
    pad = torch.ones(BATCH, SEQ, dtype=torch.long)
    if padded:
        pad[1, 20:] = 0
    tokens = torch.randint(1, VOCAB, (BATCH, SEQ), generator=gen) * pad
    types = torch.randint(0, 2, (BATCH, SEQ), generator=gen) * pad
    return tokens.to(device), pad.to(device), types.to(device)


class _Recorder:
    def __init__(self, monkeypatch):
        self.calls = []
        real = F.scaled_dot_product_attention

        def record(q, k, v, attn_mask=None, is_causal=False, **kwargs):
            self.calls.append((None if attn_mask is None else tuple(attn_mask.shape), is_causal))
            return real(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kwargs)

        monkeypatch.setattr(dot_product_attention.F, "scaled_dot_product_attention", record)


def _explicit_mask_logits(model, tokens, pad, types, monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(BertModel, "encoder_attention_mask", staticmethod(BertModel.bert_extended_attention_mask))
        return model(tokens, pad, tokentype_ids=types)


@pytest.mark.parametrize("padded", [False, True])
def test_sdpa_gets_no_mask_without_padding_and_a_key_mask_with_it(padded, monkeypatch):
    init_single_rank()
    seed_all(2)
    model = _model().eval()
    tokens, pad, types = _batch(padded)
    with torch.no_grad():
        want_logits, want_binary = _explicit_mask_logits(model, tokens, pad, types, monkeypatch)
        recorder = _Recorder(monkeypatch)
        logits, binary = model(tokens, pad, tokentype_ids=types)
    expected = (BATCH, 1, 1, SEQ) if padded else None
    assert recorder.calls == [(expected, False)] * 2
    rows = pad.bool()  # padded query rows are never read
    torch.testing.assert_close(logits[rows], want_logits[rows], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(binary, want_binary, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("padded", [False, True])
def test_bf16_cuda_bert_with_fused_kernels_matches_fp32_cpu(padded, monkeypatch):
    """bf16 BERT (Float16Module, fused bias-GeLU / bias-dropout) on CUDA against fp32 on CPU. Without padding
    SDPA gets no mask (flash / cuDNN); with padding no SDPA call is made at all (the varlen kernel runs)."""
    init_single_rank()
    seed_all(4)
    cpu = _model()
    seed_all(4)
    gpu_kwargs = dict(bf16=True, params_dtype=torch.bfloat16, bias_activation_fusion=True, masked_softmax_fusion=True,
                      bias_dropout_fusion=True, persist_layer_norm=True)
    inner = _model(**gpu_kwargs).cuda()
    gpu = Float16Module(inner.config, inner)
    gpu.module.load_state_dict(cpu.state_dict(), strict=False)
    tokens, pad, types = _batch(padded)
    labels = torch.where(torch.rand(BATCH, SEQ) < 0.3, tokens, -1).clamp(min=0)
    want, _ = cpu(tokens, pad, tokentype_ids=types, lm_labels=labels)
    recorder = _Recorder(monkeypatch)
    got, _ = gpu(tokens.cuda(), pad.cuda(), tokentype_ids=types.cuda(), lm_labels=labels.cuda())
    got.float().sum().backward()
    rows = pad.bool()
    torch.testing.assert_close(got.float().cpu()[rows], want[rows].detach(), rtol=0.05, atol=0.05)
    assert recorder.calls == ([] if padded else [(None, False)] * 2)


def _reference_varlen_forward(q, k, v, plan, scale, dropout_p):
    """Per-row full attention over the packed segments (the test's stand-in for FlashAttention's kernel)."""
    outs = []
    cu = plan.cu_seqlens.tolist()
    for start, end in zip(cu[:-1], cu[1:]):
        qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))  # [L, n, hn] -> [n, L, hn]
        probs = torch.softmax(qs @ ks.transpose(1, 2) * scale, dim=-1)
        outs.append((probs @ vs).transpose(0, 1))  # [n, L, hn] -> [L, n, hn]
    return torch.cat(outs), None, None, None


def _reference_varlen_backward(dout, q, k, v, out, lse, plan, scale, dropout_p, rng_state, unused):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with torch.enable_grad():
        again, _, _, _ = _reference_varlen_forward(q, k, v, plan, scale, dropout_p)
        return torch.autograd.grad(again, (q, k, v), dout)


def test_packed_varlen_padding_attention_equals_masked_sdpa(monkeypatch):
    """The packing, kernel call and scatter of PaddingVarlenAttention (kernel swapped for a reference, on CPU):
    outputs of real tokens and the gradients of q, k, v equal masked SDPA's; padded query rows are zero."""
    from megatron.core.models.bert import padding_attention
    from megatron.core.transformer.enums import AttnMaskType

    init_single_rank()
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, attention_dropout=0.0)
    attention = padding_attention.PaddingVarlenAttention(config, 1, AttnMaskType.padding, "self")
    reference = dot_product_attention.DotProductAttention(config, 1, AttnMaskType.padding, "self")
    gen = torch.Generator().manual_seed(3)
    s, b, n, hn = 12, 3, 4, 16
    q, k, v = (torch.randn(s, b, n, hn, generator=gen, requires_grad=True) for _ in range(3))
    pad = torch.ones(b, s, dtype=torch.bool)
    pad[1, 7:] = False
    pad[2, 2:5] = False  # any key pattern, not only right padding
    mask = ~pad[:, None, None, :]
    monkeypatch.setattr(padding_attention.PaddingVarlenAttention, "kernel_forward",
                        staticmethod(_reference_varlen_forward))
    monkeypatch.setattr(padding_attention.PaddingVarlenAttention, "kernel_backward",
                        staticmethod(_reference_varlen_backward))
    monkeypatch.setattr(padding_attention.PaddingVarlenAttention, "uses_varlen", lambda self, *a: True)
    got = attention(q, k, v, mask)
    want = reference(q, k, v, mask)
    rows = pad.t()  # [b, s] -> [s, b]
    torch.testing.assert_close(got[rows], want[rows], rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(got[~rows]) == 0
    dout = torch.randn(got.shape, generator=gen) * rows[..., None]
    grads = torch.autograd.grad(got, (q, k, v), dout)
    want_grads = torch.autograd.grad(want, (q, k, v), dout)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    plan = padding_attention.padding_plan(mask)
    assert plan.cu_seqlens.tolist() == [0, 12, 19, 28] and plan.max_seqlen == 12


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_varlen_padding_attention_on_gpu_matches_masked_sdpa():
    """FlashAttention's varlen kernel (bf16) against masked SDPA: outputs of real tokens and q/k/v gradients."""
    from megatron.core.models.bert import padding_attention
    from megatron.core.transformer.enums import AttnMaskType

    init_single_rank()
    config = TransformerConfig(num_layers=1, hidden_size=1024, num_attention_heads=16, attention_dropout=0.0)
    attention = padding_attention.PaddingVarlenAttention(config, 1, AttnMaskType.padding, "self")
    reference = dot_product_attention.DotProductAttention(config, 1, AttnMaskType.padding, "self")
    gen = torch.Generator().manual_seed(3)
    s, b, n, hn = 512, 4, 16, 64
    q, k, v = (torch.randn(s, b, n, hn, generator=gen).cuda().bfloat16().requires_grad_() for _ in range(3))
    pad = torch.ones(b, s, dtype=torch.bool)
    pad[1, 300:] = False
    pad[3, 17:] = False
    mask = (~pad[:, None, None, :]).cuda()
    assert attention.uses_varlen(q, mask, AttnMaskType.padding, None, None)
    got = attention(q, k, v, mask)
    want = reference(q, k, v, mask)
    rows = pad.t().cuda()
    torch.testing.assert_close(got[rows].float(), want[rows].float(), rtol=2e-2, atol=2e-2)
    dout = torch.randn(got.shape, generator=gen).cuda().bfloat16() * rows[..., None]
    for g, w in zip(torch.autograd.grad(got, (q, k, v), dout), torch.autograd.grad(want, (q, k, v), dout)):
        torch.testing.assert_close(g.float(), w.float(), rtol=3e-2, atol=3e-2)
