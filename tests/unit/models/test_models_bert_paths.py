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
def test_bf16_cuda_bert_with_fused_kernels_matches_fp32_cpu(padded):
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
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        got, _ = gpu(tokens.cuda(), pad.cuda(), tokentype_ids=types.cuda(), lm_labels=labels.cuda())
        got.float().sum().backward()
    rows = pad.bool()
    torch.testing.assert_close(got.float().cpu()[rows], want[rows].detach(), rtol=0.05, atol=0.05)
    names = " ".join(event.name.lower() for event in prof.key_averages())
    if not padded:
        assert "flash" in names or "cudnn" in names, names[:2000]
