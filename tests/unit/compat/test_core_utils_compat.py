"""`megatron.core.config`, the additions to `megatron.core.utils`, `fp8_utils`, `PackedSeqParams`, the
probability-weighted SwiGLU and the GPT-2 tokenizer tables: behaviour, not just presence."""
import dataclasses
import logging

import pytest
import torch
from packaging.version import Version

from megatron.core import config as mcore_config
from megatron.core import utils
from megatron.core.enums import Fp8Recipe
from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl
from megatron.core.packed_seq_params import PackedSeqParams


@pytest.fixture
def experimental_off():
    yield
    mcore_config.set_experimental_flag(False)


def test_experimental_flag_gates_experimental_fn_and_cls(experimental_off):
    assert mcore_config.ENABLE_EXPERIMENTAL is False and mcore_config.is_experimental_enabled() is False

    @utils.experimental_fn(introduced_with_version="0.13.0")
    def double(x):
        """Doc kept."""
        return 2 * x

    @utils.experimental_cls(introduced_with_version="0.13.0")
    class Thing:
        def __init__(self, value):
            self.value = value

    assert double.__doc__ == "Doc kept."
    with pytest.raises(utils.ExperimentalNotEnabledError, match="set_experimental_flag"):
        double(3)
    with pytest.raises(utils.ExperimentalNotEnabledError):
        Thing(1)
    mcore_config.set_experimental_flag(True)
    assert mcore_config.ENABLE_EXPERIMENTAL is True and mcore_config.is_experimental_enabled()
    assert double(3) == 6 and Thing(4).value == 4 and isinstance(Thing(1), Thing)
    mcore_config.set_experimental_flag(False)
    with pytest.raises(utils.ExperimentalNotEnabledError):
        double(1)


def test_experimental_end_of_life_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="megatron.core.utils"):
        utils.experimental_fn("0.9.0")(lambda: None)  # 0.9 + 3 < 0.13: past its lifetime
        utils.experimental_fn("0.12.0")(lambda: None)
    assert sum("reached end of life" in r.getMessage() for r in caplog.records) == 1


def test_version_checks():
    installed = Version(Version(torch.__version__).base_version)
    assert utils.get_torch_version().base_version == installed.base_version
    assert utils.is_torch_min_version(str(installed)) and not utils.is_torch_min_version(str(installed), False)
    assert not utils.is_torch_min_version("999.0")
    te = utils.get_te_version()
    if utils.module_available("transformer_engine"):
        assert isinstance(te, Version) and utils.is_te_min_version(str(te))
    else:
        assert te is None and utils.is_te_min_version("0.0.1") is False


def test_local_multi_tensor_ops_match_torch():
    torch.manual_seed(0)
    tensors = [torch.randn(5, 7), torch.randn(13).bfloat16(), torch.randn(2, 3, 4)]
    noop = torch.zeros(1, dtype=torch.int)
    norm, per_tensor = utils.local_multi_tensor_applier(utils.local_multi_tensor_l2_norm, noop, [tensors], True)
    expected = torch.norm(torch.stack([torch.norm(t.float()) for t in tensors]))
    assert norm.shape == (1,) and norm.dtype == torch.float32
    torch.testing.assert_close(norm[0], expected)
    torch.testing.assert_close(per_tensor, torch.stack([torch.norm(t.float()) for t in tensors]))
    # Several lists are one norm over all of them; no per-tensor norms unless asked.
    total, none = utils.local_multi_tensor_l2_norm(2048, noop, [tensors[:1], tensors[1:]], False)
    torch.testing.assert_close(total, norm)
    assert none is None
    empty, _ = utils.local_multi_tensor_l2_norm(2048, noop, [[]], False)
    assert empty.tolist() == [0.0]

    sources = [t.clone() for t in tensors]
    destinations = [torch.empty_like(t, dtype=torch.float32) for t in tensors]
    utils.local_multi_tensor_applier(utils.local_multi_tensor_scale, noop, [sources, destinations], 0.5)
    for src, dst in zip(sources, destinations):
        torch.testing.assert_close(dst, src.float() * 0.5)
    in_place = [t.clone() for t in tensors]
    utils.local_multi_tensor_scale(2048, noop, [in_place, in_place], 3.0)
    for before, after in zip(tensors, in_place):
        torch.testing.assert_close(after, before * 3.0)
    with pytest.raises(ValueError, match="2 sources but 1 destinations"):
        utils.local_multi_tensor_scale(2048, noop, [tensors[:2], tensors[:1]], 1.0)


def test_viewless_and_module_helpers():
    base = torch.randn(4, 4)
    view = base[:2]
    assert utils.assert_viewless_tensor(base) is base
    assert utils.assert_viewless_tensor([base, 3]) == [base, 3]
    with pytest.raises(AssertionError, match="_base"):
        utils.assert_viewless_tensor(view)
    target = torch.zeros(2)
    utils.safely_set_viewless_tensor_data(target, torch.ones(3))
    assert target.tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(AssertionError):
        utils.safely_set_viewless_tensor_data(view, torch.ones(1))

    inner = torch.nn.Linear(2, 2)
    outer = torch.nn.Sequential(torch.nn.Sequential(inner))
    assert utils.is_submodule(inner, outer) and not utils.is_submodule(outer, outer)
    assert utils.is_submodule(outer, outer, strict=False) and not utils.is_submodule(torch.nn.Linear(1, 1), outer)
    assert utils.get_model_xattn(outer) is False
    outer.xattn_needed = True
    assert utils.get_model_xattn(_wrapped(outer)) is True
    plain = torch.ones(2)
    assert utils.to_local_if_dtensor(plain) is plain and utils.get_data_parallel_group_if_dtensor(plain) is None
    assert utils.deprecate_inference_params(None, "old") == "old"
    assert utils.deprecate_inference_params("new", "old") == "new"


def _wrapped(module):
    wrapper = torch.nn.Module()
    wrapper.module = module
    return wrapper


def test_log_single_rank_and_nvtx(caplog):
    log = logging.getLogger("compat-test")
    with caplog.at_level(logging.INFO, logger="compat-test"):
        utils.log_single_rank(log, logging.INFO, "only rank 0 says this")
    assert "only rank 0 says this" in caplog.text  # no process group: every process is rank 0

    calls = []

    @utils.nvtx_decorator()
    def work(x):
        calls.append(x)
        return x + 1

    assert work(1) == 2  # profiling off: no NVTX call at all (works without CUDA)
    utils.nvtx_range_push("a")
    utils.nvtx_range_pop("b")  # off: mismatches are not checked either
    utils.configure_nvtx_profiling(True)
    try:
        pushed = []
        torch_nvtx = torch.cuda.nvtx
        original = (torch_nvtx.range_push, torch_nvtx.range_pop)
        torch_nvtx.range_push, torch_nvtx.range_pop = pushed.append, lambda: pushed.append("pop")
        try:
            utils.nvtx_range_push("step", suffix="fwd")
            utils.nvtx_range_pop("step", suffix="fwd")
            utils.nvtx_range_push("outer")
            with pytest.raises(ValueError, match="does not match"):
                utils.nvtx_range_pop("other")
            utils.nvtx_range_pop("outer")
            assert work(2) == 3
        finally:
            torch_nvtx.range_push, torch_nvtx.range_pop = original
        assert pushed == ["step.fwd", "pop", "outer", "pop", "test_log_single_rank_and_nvtx.<locals>.work", "pop"]
        assert calls == [1, 2]
    finally:
        utils.configure_nvtx_profiling(False)


def test_packed_seq_params_fields():
    fields = [f.name for f in dataclasses.fields(PackedSeqParams)]
    assert fields == ["qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded",
                      "max_seqlen_q", "max_seqlen_kv"]
    assert all(value is None for value in dataclasses.astuple(PackedSeqParams()))
    lengths = torch.tensor([3, 5, 2])
    cu = torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)).to(torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=5, max_seqlen_kv=5)
    assert params.cu_seqlens_q.tolist() == [0, 3, 8, 10] and params.qkv_format == "thd"


def _weighted_swiglu_formula(y, w):
    gate, up = torch.chunk(y, 2, -1)
    return (torch.nn.functional.silu(gate) * up * w).to(y.dtype)


@pytest.mark.parametrize("dtype,w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("three_dim", [False, True])
def test_weighted_bias_swiglu_forward_backward_against_autograd(dtype, w_dtype, three_dim):
    torch.manual_seed(0)
    shape = (3, 4, 16) if three_dim else (12, 16)
    y = torch.randn(shape, dtype=dtype)
    w = torch.rand(12, 1, dtype=w_dtype)
    g = torch.randn(shape[:-1] + (8,), dtype=dtype)

    y1, w1 = y.clone().requires_grad_(), w.clone().requires_grad_()
    out = weighted_bias_swiglu_impl(y1, None, w1)
    assert out.shape == shape[:-1] + (8,) and out.dtype == dtype
    out.backward(g)

    y2, w2 = y.double().requires_grad_(), w.double().requires_grad_()
    ref = _weighted_swiglu_formula(y2.reshape(12, 16), w2).reshape(shape[:-1] + (8,))
    ref.backward(g.double())
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(out.double(), ref, **tol)
    assert y1.grad.dtype == dtype and w1.grad.dtype == w_dtype
    torch.testing.assert_close(y1.grad.double(), y2.grad, **tol)
    torch.testing.assert_close(w1.grad.double(), w2.grad, **tol)


def test_weighted_bias_swiglu_fp8_store_and_errors():
    torch.manual_seed(1)
    y = torch.randn(6, 8, dtype=torch.bfloat16)
    w = torch.rand(6, 1)
    plain = y.clone().requires_grad_()
    stored = y.clone().requires_grad_()
    weighted_bias_swiglu_impl(plain, None, w).sum().backward()
    weighted_bias_swiglu_impl(stored, None, w, fp8_input_store=True).sum().backward()
    # the backward reads the E4M3 copy of the input: the same gradient up to FP8 rounding of y
    torch.testing.assert_close(stored.grad.float(), plain.grad.float(), atol=0.15, rtol=0.15)
    assert not torch.equal(stored.grad, plain.grad)
    with pytest.raises(ValueError, match="bias is not supported"):
        weighted_bias_swiglu_impl(y, torch.zeros(8), w)
    with pytest.raises(ValueError, match=r"\[tokens, 2f\]"):
        weighted_bias_swiglu_impl(y.view(1, 1, 6, 8), None, w)


def test_fp8_utils_native_semantics():
    from megatron.core import fp8_utils
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.layernorm_linear import LayerNormColumnParallelLinear

    assert fp8_utils.get_fp8_align_size(Fp8Recipe.mxfp8) == 32
    assert fp8_utils.get_fp8_align_size(Fp8Recipe.delayed) == 16
    assert fp8_utils.get_fp8_align_size(Fp8Recipe.tensorwise) == 16
    fp8_values = torch.randn(4, 4).to(torch.float8_e4m3fn)
    assert not fp8_utils.is_float8tensor(fp8_values) and not fp8_utils.is_mxfp8tensor(fp8_values)
    with pytest.raises(ValueError, match="not a Transformer Engine FP8 tensor"):
        fp8_utils.dequantize_fp8_tensor(torch.ones(2))
    with pytest.raises(ValueError, match="only Transformer Engine FP8 tensors"):
        fp8_utils.modify_underlying_storage(torch.ones(2), torch.ones(2))
    params = [torch.nn.Parameter(torch.ones(3))]
    fp8_utils.quantize_param_shard(params, [torch.ones(3)], [0], None)
    fp8_utils.post_all_gather_processing(params)
    assert fp8_utils.correct_amax_history_if_needed([torch.nn.Linear(2, 2)]) is None
    assert params[0].tolist() == [1.0, 1.0, 1.0]

    assert issubclass(LayerNormColumnParallelLinear, ColumnParallelLinear)
    column = ColumnParallelLinear.__new__(ColumnParallelLinear)
    row = RowParallelLinear.__new__(RowParallelLinear)
    assert fp8_utils.is_column_parallel_linear(column) and not fp8_utils.is_row_parallel_linear(column)
    assert fp8_utils.is_row_parallel_linear(row) and not fp8_utils.is_column_parallel_linear(row)
    assert not fp8_utils.is_column_parallel_linear(torch.nn.Linear(2, 2))


def test_fp8_context_and_bf16_layers():
    from types import SimpleNamespace

    from megatron.core import fp8_utils
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = SimpleNamespace(fp8="hybrid", num_layers=6, first_last_layers_bf16=True, num_layers_at_start_in_bf16=2,
                             num_layers_at_end_in_bf16=1)
    assert [fp8_utils.is_first_last_bf16_layer(config, i) for i in range(6)] == [True, True, False, False, False, True]
    assert not fp8_utils.is_first_last_bf16_layer(config, -1)
    config.first_last_layers_bf16 = False
    assert not any(fp8_utils.is_first_last_bf16_layer(config, i) for i in range(6))

    base = dict(num_layers=2, hidden_size=16, num_attention_heads=2, bf16=True, params_dtype=torch.bfloat16)
    no_fp8 = TransformerConfig(**base)
    with fp8_utils.get_fp8_context(no_fp8, 0):
        pass
    fp8 = TransformerConfig(**base, fp8="hybrid", fp8_recipe="tensorwise")
    with fp8_utils.get_fp8_context(fp8, 1), fp8_utils.get_fp8_context(fp8, is_init=True):
        pass
    bad = dataclasses.replace(fp8)
    object.__setattr__(bad, "fp8_recipe", "mxfp8")
    with pytest.raises(ValueError, match="mxfp8"):
        fp8_utils.get_fp8_context(bad, 0)


def test_gpt2_tokenization_tables():
    from megatron.training.tokenizer import gpt2_tokenization as gpt2

    assert set(gpt2.PRETRAINED_VOCAB_ARCHIVE_MAP) == {"gpt2"} == set(gpt2.PRETRAINED_MERGES_ARCHIVE_MAP)
    assert gpt2.PRETRAINED_VOCAB_ARCHIVE_MAP["gpt2"].endswith("gpt2-vocab.json")
    assert gpt2.PRETRAINED_MERGES_ARCHIVE_MAP["gpt2"].endswith("gpt2-merges.txt")
    assert gpt2.PRETRAINED_VOCAB_POSITIONAL_EMBEDDINGS_SIZE_MAP == {"gpt2": 1024}
    assert (gpt2.VOCAB_NAME, gpt2.MERGES_NAME) == ("vocab.json", "merges.txt")
    assert gpt2.get_pairs(("h", "e", "l", "l", "o")) == {("h", "e"), ("e", "l"), ("l", "l"), ("l", "o")}
