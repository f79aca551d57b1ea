"""The fast-path pieces against their plain reference implementations (CPU, single process).

Covers the memory-lean cross-entropy (loss and gradient vs the reference vocab-parallel CE and vs
F.cross_entropy, fp32 exact and bf16 close, chunking, targets owned by other TP ranks), the
bias-dropout-add shortcut at p=0, RoPE through its fused entry point, the CPU fallback of
`CudaCompiled`, and the SDPA backend context being a no-op on CPU.
"""
import pytest
import torch
import torch.nn.functional as F

from megatron.core.fusions import _compile, fused_cross_entropy
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.fusions.fused_cross_entropy import _FusedVocabParallelCrossEntropy, fused_vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.core.transformer import rope_utils
from megatron.core.transformer.dot_product_attention import sdpa_backend_priority
from tests.unit.transformer.model_setup import init_single_rank, teardown_single_rank

_REAL_COMPILE = torch.compile


class _OneRank:
    """A stand-in process group of size 1 (no communication happens at size 1)."""

    def size(self):
        return 1

    def rank(self):
        return 0


def _reference(logits, target):
    """F.cross_entropy on fp32 logits: loss [s, b] and d(sum(loss * w))/d logits."""
    ref = logits.detach().float().requires_grad_(True)
    loss = F.cross_entropy(ref.reshape(-1, ref.shape[-1]), target.reshape(-1), reduction="none").view_as(target)
    return loss, ref


def test_fused_cross_entropy_matches_reference_fp32_and_bf16(monkeypatch):
    torch.manual_seed(0)
    s, b, vocab = 7, 3, 53
    logits = (torch.randn(s, b, vocab) * 4).requires_grad_(True)
    target = torch.randint(0, vocab, (s, b))
    weights = torch.rand(s, b)
    # Chunks of 4 rows: 21 tokens -> 6 chunks, the last one partial.
    monkeypatch.setattr(fused_cross_entropy, "_CHUNK_ELEMENTS", 4 * vocab)
    loss = _FusedVocabParallelCrossEntropy.apply(logits, target, _OneRank())
    ref_loss, ref_logits = _reference(logits, target)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    (loss * weights).sum().backward()
    (ref_loss * weights).sum().backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad, rtol=1e-6, atol=1e-7)

    # bf16 logits: fp32 loss from the bf16 values (as the reference upcast), bf16 gradient.
    half = logits.detach().bfloat16().requires_grad_(True)
    loss = _FusedVocabParallelCrossEntropy.apply(half, target, _OneRank())
    ref_loss, ref_logits = _reference(half, target)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    (loss * weights).sum().backward()
    (ref_loss * weights).sum().backward()
    assert half.grad.dtype == torch.bfloat16
    torch.testing.assert_close(half.grad.float(), ref_logits.grad, rtol=1e-2, atol=1e-3)

    # No gradient wanted (evaluation): the loss alone, nothing stored.
    with torch.no_grad():
        torch.testing.assert_close(_FusedVocabParallelCrossEntropy.apply(logits, target, _OneRank()), ref_loss.detach(),
                                   rtol=1e-2, atol=1e-2)


def test_fused_cross_entropy_equals_vocab_parallel_reference_and_foreign_targets(monkeypatch):
    init_single_rank()
    try:
        torch.manual_seed(1)
        logits = torch.randn(5, 2, 40, requires_grad=True)
        target = torch.randint(0, 40, (5, 2))
        fused = fused_vocab_parallel_cross_entropy(logits, target)
        ref_logits = logits.detach().clone().requires_grad_(True)
        ref = vocab_parallel_cross_entropy(ref_logits, target)
        torch.testing.assert_close(fused, ref, rtol=1e-6, atol=1e-6)
        grad = torch.rand(5, 2)
        fused.backward(grad)
        ref.backward(grad)
        torch.testing.assert_close(logits.grad, ref_logits.grad, rtol=1e-6, atol=1e-7)
    finally:
        teardown_single_rank()

    # Rank 1 of TP=2 owns vocab [40, 80); with the all-reduces removed it sees only its own slice, so a
    # target outside it contributes no target logit (loss = local lse - local max) and no -1.
    monkeypatch.setattr(fused_cross_entropy, "all_reduce_tensor", lambda tensor, group, op=None: None)
    monkeypatch.setattr(fused_cross_entropy, "get_pg_size", lambda group: 2)
    monkeypatch.setattr(fused_cross_entropy, "get_pg_rank", lambda group: 1)
    local = torch.randn(3, 1, 40, requires_grad=True)
    target = torch.tensor([[5], [45], [79]])
    loss = _FusedVocabParallelCrossEntropy.apply(local, target, _OneRank())
    values = local.detach()
    lse = torch.logsumexp(values, -1)
    picked = torch.stack([values[0, 0].max(), values[1, 0, 5], values[2, 0, 39]]).view(3, 1)  # [3] -> [3, 1]
    torch.testing.assert_close(loss, lse - picked)
    loss.sum().backward()
    softmax = torch.softmax(local.detach(), -1)
    softmax[1, 0, 5] -= 1
    softmax[2, 0, 39] -= 1
    torch.testing.assert_close(local.grad, softmax)


def test_bias_dropout_add_shortcut_and_dropout_path():
    torch.manual_seed(2)
    x, bias, residual = torch.randn(4, 2, 8), torch.randn(8), torch.randn(4, 2, 8)
    for training in (True, False):
        bda = get_bias_dropout_add(training, fused=True)
        torch.testing.assert_close(bda((x.clone(), bias), residual, 0.0), residual + (x + bias))
        torch.testing.assert_close(bda((x.clone(), None), residual, 0.0), residual + x)
    out = get_bias_dropout_add(True, fused=False)((x, bias), residual, 0.5)
    kept = (out - residual) != 0
    assert 0 < kept.float().mean() < 1
    torch.testing.assert_close((out - residual)[kept], ((x + bias) * 2)[kept])
    torch.testing.assert_close(get_bias_dropout_add(False, fused=False)((x.clone(), bias), residual, 0.5),
                               residual + (x + bias))


def test_bias_dropout_add_eval_mode_megatron_semantics():
    """Megatron's bias_dropout_add: in eval mode with no input needing a gradient, x itself receives
    x + bias + residual and is returned (no dropout, no new tensor); when an input needs a gradient the
    result is a new tensor and x is untouched; the residual is cast to x's dtype, so a bf16 branch output
    with an fp32 residual gives a bf16 result; in training mode dropout is applied to x + bias only."""
    torch.manual_seed(3)
    for fused in (True, False):
        x, bias, residual = torch.randn(4, 2, 8), torch.randn(8), torch.randn(4, 2, 8)
        expected = residual + (x + bias)
        original = x.clone()
        out = get_bias_dropout_add(False, fused)((x, bias), residual, 0.5)
        assert out is x and torch.equal(x, expected)
        expected = original + residual
        out = get_bias_dropout_add(False, fused)((original, None), residual, 0.5)
        assert out is original and torch.equal(out, expected)
        y = torch.randn(4, 2, 8, requires_grad=True)
        kept = y.detach().clone()
        out = get_bias_dropout_add(False, fused)((y, bias), residual, 0.5)
        assert out is not y and torch.equal(y.detach(), kept) and out.requires_grad
        torch.testing.assert_close(out, residual + (kept + bias))
        half = torch.randn(4, 2, 8, dtype=torch.bfloat16)
        for training in (True, False):
            out = get_bias_dropout_add(training, fused)((half.clone(), bias.bfloat16()), residual, 0.0)
            assert out.dtype == torch.bfloat16
            torch.testing.assert_close(out, residual.bfloat16() + (half + bias.bfloat16()))


def test_rope_entry_point_and_cpu_fallbacks():
    class _Config:
        rotary_interleaved = False

    torch.manual_seed(3)
    t = torch.randn(6, 2, 3, 8, requires_grad=True)
    freqs = torch.randn(6, 1, 1, 8)
    out = rope_utils.apply_rotary_pos_emb(t, freqs, _Config())
    x1, x2 = t[..., :4], t[..., 4:]
    expected = torch.cat((x1 * freqs.cos()[..., :4] - x2 * freqs.sin()[..., :4],
                          x2 * freqs.cos()[..., 4:] + x1 * freqs.sin()[..., 4:]), -1)
    torch.testing.assert_close(out, expected)

    calls = []
    compiled = _compile.CudaCompiled(lambda a, b: calls.append(1) or a + b)
    torch.testing.assert_close(compiled(torch.ones(2), torch.ones(2)), torch.full((2,), 2.0))
    assert calls == [1] and not compiled._specialised  # CPU tensors never compile

    q = torch.randn(1, 2, 4, 8)
    with sdpa_backend_priority(q):
        torch.testing.assert_close(F.scaled_dot_product_attention(q, q, q, is_causal=True),
                                   F.scaled_dot_product_attention(q, q, q, is_causal=True))


def test_cuda_compiled_specialises_per_signature_then_runs_eagerly(monkeypatch):
    """Each new (shape, stride, dtype, grad mode, scalar) signature gets its own compilation with constant sizes
    (never `dynamic=True`), each on its own code object; past the cap new signatures run the eager function."""
    made = []

    def fake_compile(fn, dynamic):
        made.append((fn, dynamic))
        return fn

    monkeypatch.setattr(_compile.torch, "compile", fake_compile)

    def add(a, b):
        return a + b

    compiled = _compile.CudaCompiled(add)
    x = torch.ones(2, 3)
    entry = compiled._compiled_for((x, 1.0))
    assert compiled._compiled_for((torch.zeros(2, 3), 1.0)) is entry  # same signature, other values
    assert compiled._compiled_for((x, 2.0)) is not entry  # another scalar
    assert compiled._compiled_for((x.t(), 1.0)) is not entry  # other strides
    with torch.no_grad():
        assert compiled._compiled_for((x, 1.0)) is not entry  # autograd not recording
    for rows in range(3, 3 + _compile._MAX_SPECIALISED):
        compiled._compiled_for((torch.ones(rows, 3), 1.0))
    assert len(compiled._specialised) == _compile._MAX_SPECIALISED
    assert compiled._compiled_for((torch.ones(50, 3), 1.0)) is None  # the caller runs `add` eagerly
    assert compiled._compiled_for((x, 1.0)) is entry  # known signatures keep their compilation
    assert [dynamic for _, dynamic in made] == [False] * _compile._MAX_SPECIALISED
    codes = {id(fn.__code__) for fn, _ in made}
    assert len(codes) == len(made) and id(add.__code__) not in codes
    assert all(fn(x, 1.0).equal(add(x, 1.0)) for fn, _ in made)

    # The plan's `--fusion-kernels` mode is read at every call: the CUDA branch (CPU tensors posing as CUDA
    # ones) runs eagerly while it is 'eager' and compiles once it is 'compiled'
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    switched = _compile.CudaCompiled(add)
    _compile.set_fusion_kernels("eager")
    assert switched(x, 1.0).equal(add(x, 1.0)) and not switched._specialised
    _compile.set_fusion_kernels("compiled")
    assert switched(x, 1.0).equal(add(x, 1.0)) and len(switched._specialised) == 1
    _compile.set_fusion_kernels("eager")
    made.clear()
    assert switched(x, 1.0).equal(add(x, 1.0)) and not made
    _compile.reset_fusion_kernels()
    with pytest.raises(ValueError, match="--fusion-kernels"):
        _compile.set_fusion_kernels("fast")

    # a compiler failure is an error naming the flag, not a silent switch to the eager function
    def broken_backend(graph_module, example_inputs):
        raise RuntimeError("no kernel")

    monkeypatch.setattr(_compile.torch, "compile",
                        lambda fn, dynamic: _REAL_COMPILE(fn, dynamic=dynamic, backend=broken_backend))
    with pytest.raises(RuntimeError, match="torch.compile of the fused add failed.*--fusion-kernels eager"):
        _compile.CudaCompiled(add)(x, 1.0)
