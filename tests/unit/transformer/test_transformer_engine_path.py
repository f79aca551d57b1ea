"""The Transformer Engine path of `--transformer-impl transformer_engine`, checked without Transformer Engine.

TE cannot be installed here (it needs a CUDA toolkit build), so the tests that need it put a small
stand-in `transformer_engine` package into `sys.modules`: `transformer_engine.pytorch.Linear`,
`LayerNormLinear`, `LayerNorm`, `RMSNorm` and `DotProductAttention`, written with plain torch after TE's
documented constructors and forwards. The stand-in accepts only TE's documented keyword arguments, so a
wrapper passing anything else fails here; its tensor-parallel communication goes through our mapping
functions.

- (a) Without TE the spec builds the native TE-layout modules and says so in exactly one info line, and
  constructing a TE wrapper raises an ImportError naming `--transformer-impl local`.
- (b) With the stand-in, a tiny GPT (and a Llama-style model: RMSNorm, SwiGLU, GQA, qk-norm, RoPE) built
  from the same spec function is made of the TE wrappers and has the native TE-layout model's parameter
  names, state-dict keys, parameter attributes and, from the same seed, the same weights (with
  use_cpu_initialization from the CPU master weights; without it, TE initialises each shard inside the
  'model-parallel-rng' stream as the native layers do). After perturbing the native weights and loading them into the TE model, both give the same
  loss and gradients in fp32 on CPU; with gradient accumulation fusion the weight gradients go into DDP's
  `main_grad` (and into `.grad` without DDP, as with the native linears).
  The standalone column / row / duplicated linears match the native ones, sharded state dicts included.
- (c) The same model comparison at TP=2 over gloo, with and without sequence parallelism, on every rank.

Tolerances: the stand-in computes what the native layers compute with different kernels (plain F.linear /
F.layer_norm / F.rms_norm against the native custom autograd functions), so results agree to fp32
rounding: rtol 1e-5, atol 1e-6.
"""
import abc
import contextlib
import importlib.machinery
import logging
import math
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from megatron.core.extensions.transformer_engine import (
    TEColumnParallelLinear,
    TEDotProductAttention,
    TELayerNormColumnParallelLinear,
    TELinear,
    TENorm,
    TERowParallelLinear,
)
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec, get_mlp_module_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.dot_product_attention import TECompatibleDotProductAttention
from megatron.core.transformer.layernorm_linear import LayerNormColumnParallelLinear
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import module_available
from tests.harness import run_on_ranks
from tests.unit.transformer.model_setup import apply_plan, init_single_rank, seed_all

SEED, VOCAB, SEQ, BATCH = 1234, 64, 8, 2
RTOL, ATOL = 1e-5, 1e-6
# Megatron's parameter attributes and their values when a parameter does not carry one.
ATTRIBUTES = {"tensor_model_parallel": False, "partition_dim": -1, "partition_stride": 1, "sequence_parallel": False,
              "allreduce": True}


class _WgradIntoMainGrad(torch.autograd.Function):
    """y = x W^T (+ b); with fuse_wgrad_accumulation the weight gradient is added to `weight.main_grad`."""

    @staticmethod
    def forward(ctx, x, weight, bias, fuse_wgrad_accumulation):
        ctx.save_for_backward(x, weight)
        ctx.fuse, ctx.has_bias = fuse_wgrad_accumulation, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        grad_2d = grad_output.reshape(-1, grad_output.shape[-1])  # [s, b, out] -> [s*b, out]
        grad_weight = grad_2d.t() @ x.reshape(-1, x.shape[-1])  # [out, s*b] @ [s*b, in] -> [out, in]
        if ctx.fuse:
            weight.main_grad.add_(grad_weight)
            grad_weight = None
            if hasattr(weight, "grad_added_to_main_grad"):
                weight.grad_added_to_main_grad = True
                grad_weight = torch.zeros_like(weight)
        grad_bias = grad_2d.sum(0) if ctx.has_bias else None
        return grad_output @ weight, grad_weight, grad_bias, None


class _FakeTEModule(torch.nn.Module, abc.ABC):
    """Like TE's base module: an ABC whose state dict carries `_extra_state`."""

    @abc.abstractmethod
    def forward(self, *args, **kwargs):
        """Each module defines its own."""

    def get_extra_state(self):
        """No FP8 metadata in the stand-in."""
        return None

    def set_extra_state(self, state):
        """Nothing to restore."""


class _FakeParallelLinear(_FakeTEModule):
    """Parameters and tensor-parallel forward shared by the stand-in `Linear` and `LayerNormLinear`."""

    def _setup(self, in_features, out_features, *, bias, return_bias, parallel_mode, tp_group, tp_size,
               sequence_parallel, fuse_wgrad_accumulation, init_method, get_rng_state_tracker, params_dtype, device):
        if parallel_mode not in (None, "column", "row"):
            raise ValueError(f"parallel_mode {parallel_mode!r}")
        self.tp_group = tp_group
        self.tp_size = tp_size if tp_group is None else torch.distributed.get_world_size(tp_group)
        self.parallel_mode, self.use_bias, self.return_bias = parallel_mode, bias, return_bias
        self.sequence_parallel = sequence_parallel and self.tp_size > 1
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        out_features //= self.tp_size if parallel_mode == "column" else 1
        in_features //= self.tp_size if parallel_mode == "row" else 1
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
        self.bias = torch.Tensor()  # TE keeps an empty tensor, not a parameter, when there is no bias
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device))
        fork = get_rng_state_tracker().fork() if get_rng_state_tracker is not None else contextlib.nullcontext()
        with fork:
            (init_method or (lambda w: torch.nn.init.normal_(w, std=0.023)))(self.weight)

    def _project(self, x):
        """Column: all-gather x along the sequence (SP) or copy it into the TP region; row: reduce the output."""
        communicate = self.tp_size > 1
        if self.parallel_mode == "column" and communicate:
            if self.sequence_parallel:
                x = gather_from_sequence_parallel_region(x, group=self.tp_group)
            else:
                x = copy_to_tensor_model_parallel_region(x, group=self.tp_group)
        add_bias = self.use_bias and not self.return_bias
        gemm_bias = self.bias if add_bias and self.parallel_mode != "row" else None
        out = _WgradIntoMainGrad.apply(x, self.weight, gemm_bias, self.fuse_wgrad_accumulation)
        if self.parallel_mode == "row" and communicate:
            if self.sequence_parallel:
                out = reduce_scatter_to_sequence_parallel_region(out, group=self.tp_group)
            else:
                out = reduce_from_tensor_model_parallel_region(out, group=self.tp_group)
        if self.parallel_mode == "row" and add_bias:
            out = out + self.bias
        return (out, self.bias) if self.return_bias else out


class FakeLinear(_FakeParallelLinear):
    """Stand-in for `transformer_engine.pytorch.Linear` (documented arguments only)."""

    def __init__(self, in_features, out_features, sequence_parallel=False, fuse_wgrad_accumulation=False,
                 tp_group=None, tp_size=1, get_rng_state_tracker=None, init_method=None, bias=True,
                 return_bias=False, params_dtype=None, parallel_mode=None, device="cuda"):
        super().__init__()
        self._setup(in_features, out_features, bias=bias, return_bias=return_bias, parallel_mode=parallel_mode,
                    tp_group=tp_group, tp_size=tp_size, sequence_parallel=sequence_parallel,
                    fuse_wgrad_accumulation=fuse_wgrad_accumulation, init_method=init_method,
                    get_rng_state_tracker=get_rng_state_tracker, params_dtype=params_dtype, device=device)

    def forward(self, inp, is_first_microbatch=None):
        """[*, in] -> [*, out] (or (output, bias) with return_bias)."""
        return self._project(inp)


def _normalize(x, normalization, weight, bias, eps, zero_centered_gamma):
    """LayerNorm or RMSNorm over the last dimension (gamma stored zero-centred when asked)."""
    gamma = weight + 1 if zero_centered_gamma else weight
    if normalization == "RMSNorm":
        return F.rms_norm(x, (x.shape[-1],), gamma, eps)
    return F.layer_norm(x, (x.shape[-1],), gamma, bias, eps)


class FakeLayerNormLinear(_FakeParallelLinear):
    """Stand-in for `transformer_engine.pytorch.LayerNormLinear` (documented arguments only)."""

    def __init__(self, in_features, out_features, eps=1e-5, sequence_parallel=False, fuse_wgrad_accumulation=False,
                 tp_group=None, tp_size=1, get_rng_state_tracker=None, init_method=None, bias=True,
                 normalization="LayerNorm", return_bias=False, params_dtype=None, parallel_mode=None,
                 return_layernorm_output=False, zero_centered_gamma=False, device="cuda"):
        super().__init__()
        if return_layernorm_output:
            raise ValueError("the stand-in does not return the norm output")
        dtype = params_dtype or torch.get_default_dtype()
        self.eps, self.normalization, self.zero_centered_gamma = eps, normalization, zero_centered_gamma
        init = torch.zeros if zero_centered_gamma else torch.ones
        self.layer_norm_weight = torch.nn.Parameter(init(in_features, dtype=dtype, device=device))
        self.layer_norm_bias = None
        if normalization == "LayerNorm":
            self.layer_norm_bias = torch.nn.Parameter(torch.zeros(in_features, dtype=dtype, device=device))
        self._setup(in_features, out_features, bias=bias, return_bias=return_bias, parallel_mode=parallel_mode,
                    tp_group=tp_group, tp_size=tp_size, sequence_parallel=sequence_parallel,
                    fuse_wgrad_accumulation=fuse_wgrad_accumulation, init_method=init_method,
                    get_rng_state_tracker=get_rng_state_tracker, params_dtype=params_dtype, device=device)

    def forward(self, inp, is_first_microbatch=None):
        """norm(x) then the column-parallel linear (the norm runs on this rank's sequence shard under SP)."""
        normed = _normalize(inp, self.normalization, self.layer_norm_weight, self.layer_norm_bias, self.eps,
                            self.zero_centered_gamma)
        return self._project(normed)


class FakeLayerNorm(torch.nn.Module):
    """Stand-in for `transformer_engine.pytorch.LayerNorm` (documented arguments only)."""

    _normalization = "LayerNorm"

    def __init__(self, normalized_shape, eps=1e-5, sequence_parallel=None, params_dtype=None,
                 zero_centered_gamma=False, device=None):
        super().__init__()
        dtype = params_dtype or torch.get_default_dtype()
        self.eps, self.zero_centered_gamma = eps, zero_centered_gamma
        init = torch.zeros if zero_centered_gamma else torch.ones
        self.weight = torch.nn.Parameter(init(normalized_shape, dtype=dtype, device=device))
        self.bias = None
        if self._normalization == "LayerNorm":
            self.bias = torch.nn.Parameter(torch.zeros(normalized_shape, dtype=dtype, device=device))

    def forward(self, inp):
        """Normalise the last dimension."""
        return _normalize(inp, self._normalization, self.weight, self.bias, self.eps, self.zero_centered_gamma)


class FakeRMSNorm(FakeLayerNorm):
    """Stand-in for `transformer_engine.pytorch.RMSNorm` (documented arguments only)."""

    _normalization = "RMSNorm"


class FakeDotProductAttention(_FakeTEModule):
    """Stand-in for `transformer_engine.pytorch.DotProductAttention` ('sbhd' only), through SDPA."""

    def __init__(self, num_attention_heads, kv_channels, num_gqa_groups=None, attention_dropout=0.0,
                 qkv_format="sbhd", attn_mask_type="causal", window_size=None, sequence_parallel=False, tp_size=1,
                 get_rng_state_tracker=None, tp_group=None, layer_number=None, attention_type="self",
                 cp_group=None, cp_global_ranks=None, cp_stream=None, cp_comm_type="p2p", softmax_scale=None):
        super().__init__()
        if qkv_format != "sbhd" or window_size is not None:
            raise ValueError("the stand-in runs 'sbhd' without a window only")
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(kv_channels)
        self.attention_dropout, self.attn_mask_type = attention_dropout, attn_mask_type
        self.get_rng_state_tracker = get_rng_state_tracker

    def forward(self, query_layer, key_layer, value_layer, attention_mask=None, qkv_format=None,
                attn_mask_type=None, window_size=None, core_attention_bias_type="no_bias", core_attention_bias=None):
        """[s, b, np, hn] queries, [s, b, ng, hn] keys/values -> [s, b, np * hn]."""
        mask_type = attn_mask_type or self.attn_mask_type
        if mask_type in ("causal", "no_mask") and attention_mask is not None:
            raise ValueError(f"the stand-in takes no mask with attn_mask_type={mask_type!r}")
        if core_attention_bias is not None:
            raise ValueError("the stand-in has no attention bias")
        # [s, b, n, hn] -> [b, n, s, hn]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query_layer, key_layer, value_layer))
        dropout = self.attention_dropout if self.training else 0.0
        tracker = self.get_rng_state_tracker
        fork = tracker().fork() if tracker is not None and dropout > 0 else contextlib.nullcontext()
        with fork:
            context = F.scaled_dot_product_attention(
                q, k, v, attn_mask=None if attention_mask is None else ~attention_mask, dropout_p=dropout,
                is_causal=mask_type == "causal", scale=self.softmax_scale, enable_gqa=q.shape[1] != k.shape[1],
            )
        sq, b = query_layer.shape[0], query_layer.shape[1]
        return context.permute(2, 0, 1, 3).reshape(sq, b, -1)  # [b, np, sq, hn] -> [sq, b, np*hn]


def _fake_modules():
    """The stand-in package: `transformer_engine` and its `pytorch` submodule."""
    package = types.ModuleType("transformer_engine")
    package.__path__ = []
    package.__spec__ = importlib.machinery.ModuleSpec("transformer_engine", None, is_package=True)
    te_pytorch = types.ModuleType("transformer_engine.pytorch")
    te_pytorch.__spec__ = importlib.machinery.ModuleSpec("transformer_engine.pytorch", None)
    te_pytorch.Linear, te_pytorch.LayerNormLinear = FakeLinear, FakeLayerNormLinear
    te_pytorch.LayerNorm, te_pytorch.RMSNorm = FakeLayerNorm, FakeRMSNorm
    te_pytorch.DotProductAttention = FakeDotProductAttention
    package.pytorch = te_pytorch
    return {"transformer_engine": package, "transformer_engine.pytorch": te_pytorch}


@contextlib.contextmanager
def transformer_engine(stand_in: bool):
    """Inside the block `transformer_engine` is the stand-in (stand_in=True) or not importable."""
    modules = _fake_modules() if stand_in else {"transformer_engine": None, "transformer_engine.pytorch": None}
    try:
        with pytest.MonkeyPatch.context() as patch:
            for name, module in modules.items():
                patch.setitem(sys.modules, name, module)
            module_available.cache_clear()
            yield
    finally:
        module_available.cache_clear()


def _config(kind, **overrides):
    """A tiny GPT ('gpt': LayerNorm with zero-centred gamma, biases) or Llama-style ('llama') config."""
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.2)
    if kind == "llama":
        base.update(normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                    num_query_groups=2, qk_layernorm=True, ffn_hidden_size=48, bias_activation_fusion=True)
    else:
        base.update(layernorm_zero_centered_gamma=True)
    base.update(overrides)
    return TransformerConfig(**base)


def _gpt(config, kind, stand_in):
    """A GPT from `get_gpt_layer_with_transformer_engine_spec` with TE (the stand-in) present or absent."""
    with transformer_engine(stand_in):
        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
        seed_all(SEED)
        return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                        position_embedding_type="rope" if kind == "llama" else "learned_absolute")


def native_and_te_models(config, kind):
    """The native TE-layout model and the TE (stand-in) model, the TE one carrying perturbed copies of the
    native weights (identical noise on every rank, so a TP model stays consistent)."""
    native, te_model = _gpt(config, kind, stand_in=False), _gpt(config, kind, stand_in=True)
    check_same_layout(te_model, native)
    generator = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for param in native.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.1)
    te_model.load_state_dict(native.state_dict(), strict=True)
    return native, te_model


def check_same_layout(te_model, native):
    """Same parameter names (in order), state-dict keys, shapes, attributes and initial values."""
    te_params, native_params = dict(te_model.named_parameters()), dict(native.named_parameters())
    assert list(te_params) == list(native_params)
    assert list(te_model.state_dict()) == list(native.state_dict())
    for name, param in te_params.items():
        other = native_params[name]
        for attribute, default in ATTRIBUTES.items():
            assert getattr(param, attribute, default) == getattr(other, attribute, default), (name, attribute)
        torch.testing.assert_close(param, other, rtol=0, atol=0, msg=f"initial value of {name}")


def check_te_classes(model, kind):
    """The layers are the TE wrappers, bound to the stand-in's classes."""
    for layer in model.decoder.layers:
        attention, mlp = layer.self_attention, layer.mlp
        assert isinstance(attention.linear_qkv, TELayerNormColumnParallelLinear)
        assert isinstance(attention.linear_qkv, FakeLayerNormLinear)
        assert isinstance(attention.linear_proj, TERowParallelLinear) and isinstance(attention.linear_proj, FakeLinear)
        assert isinstance(attention.core_attention, TEDotProductAttention)
        assert isinstance(mlp.linear_fc1, TELayerNormColumnParallelLinear)
        assert isinstance(mlp.linear_fc2, TERowParallelLinear)
        if kind == "llama":
            assert type(attention.q_layernorm) is FakeRMSNorm and type(attention.k_layernorm) is FakeRMSNorm


def batch(seed=0):
    """Tokens, position ids and labels of one micro-batch."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    return tokens, torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ), labels


def loss_and_grads(model):
    """Mean loss and every parameter's gradient for one batch."""
    model.zero_grad(set_to_none=True)
    tokens, position_ids, labels = batch()
    loss = model(tokens, position_ids, None, labels=labels).mean()
    loss.backward()
    return loss.detach(), {name: param.grad.clone() for name, param in model.named_parameters()}


def compare_runs(te_model, native, label):
    """Same loss and same gradient of every parameter (fp32 rounding)."""
    te_loss, te_grads = loss_and_grads(te_model)
    loss, grads = loss_and_grads(native)
    torch.testing.assert_close(te_loss, loss, rtol=RTOL, atol=ATOL, msg=f"{label}: loss")
    for name, grad in grads.items():
        torch.testing.assert_close(te_grads[name], grad, rtol=RTOL, atol=ATOL, msg=f"{label}: gradient of {name}")


def test_without_transformer_engine_the_spec_builds_native_layers_with_one_info_line(caplog, monkeypatch):
    monkeypatch.setattr(gpt_layer_specs, "_te_notice_logged", False)
    config = _config("gpt")
    with transformer_engine(stand_in=False), caplog.at_level(logging.INFO, logger=gpt_layer_specs.__name__):
        spec = get_gpt_layer_with_transformer_engine_spec()
        get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True)
        mlp = get_mlp_module_spec(use_te=True)
        with pytest.raises(ImportError, match="--transformer-impl local"):
            TERowParallelLinear(8, 8, config=config, init_method=torch.nn.init.zeros_, bias=True,
                                input_is_parallel=True, skip_bias_add=True, is_expert=False)
        with pytest.raises(ImportError, match="--transformer-impl local"):
            TENorm(config, 8)
    records = [record for record in caplog.records if record.name == gpt_layer_specs.__name__]
    assert len(records) == 1 and records[0].levelno == logging.INFO
    assert "not installed" in records[0].getMessage() and "native layers" in records[0].getMessage()
    attention = spec.submodules.self_attention.submodules
    assert attention.linear_qkv is LayerNormColumnParallelLinear and attention.linear_proj is RowParallelLinear
    assert attention.core_attention is TECompatibleDotProductAttention
    assert spec.submodules.mlp.submodules.linear_fc1 is LayerNormColumnParallelLinear
    assert mlp.submodules.linear_fc1 is LayerNormColumnParallelLinear


@pytest.mark.parametrize("use_cpu_initialization", [True, False])
@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_te_model_matches_native_te_layout_model(kind, use_cpu_initialization):
    init_single_rank()
    native, te_model = native_and_te_models(_config(kind, use_cpu_initialization=use_cpu_initialization), kind)
    check_te_classes(te_model, kind)
    compare_runs(te_model, native, kind)


def test_te_weight_gradients_go_to_main_grad_under_ddp_and_to_grad_without():
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    init_single_rank()
    native, te_model = native_and_te_models(_config("llama", gradient_accumulation_fusion=True), "llama")
    compare_runs(te_model, native, "gradient_accumulation_fusion without main_grad")
    main_grads = []
    for model in (te_model, native):
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
        ddp.zero_grad_buffer()
        tokens, position_ids, labels = batch()
        ddp(tokens, position_ids, None, labels=labels).mean().backward()
        ddp.finish_grad_sync()
        main_grads.append({name: param.main_grad.clone() for name, param in model.named_parameters()})
    qkv_weight = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert te_model.get_parameter(qkv_weight).grad_added_to_main_grad
    for name, grad in main_grads[1].items():
        torch.testing.assert_close(main_grads[0][name], grad, rtol=RTOL, atol=ATOL, msg=f"main_grad of {name}")


def _standalone_linears(config, skip_bias_add, stand_in):
    """Column, row and duplicated linears (TE wrappers or their native counterparts) from one seed."""
    seed_all(SEED)
    init = torch.nn.init.xavier_normal_
    common = dict(config=config, init_method=init, bias=True, skip_bias_add=skip_bias_add, is_expert=False)
    if stand_in:
        column = TEColumnParallelLinear(16, 24, gather_output=False, **common)
        row = TERowParallelLinear(24, 16, input_is_parallel=True, **common)
        duplicated = TELinear(16, 8, parallel_mode="duplicated", skip_weight_param_allocation=False, **common)
    else:
        column = ColumnParallelLinear(16, 24, gather_output=False, **common)
        row = RowParallelLinear(24, 16, input_is_parallel=True, **common)
        duplicated = ColumnParallelLinear(16, 8, gather_output=False, **common)
    return column, row, duplicated


@pytest.mark.parametrize("skip_bias_add", [False, True])
def test_te_linears_match_native_linears(skip_bias_add):
    init_single_rank()
    config = _config("gpt")
    native = _standalone_linears(config, skip_bias_add, stand_in=False)
    with transformer_engine(stand_in=True):
        te_layers = _standalone_linears(config, skip_bias_add, stand_in=True)
    generator = torch.Generator().manual_seed(5)
    inputs = [torch.randn(SEQ, BATCH, size, generator=generator) for size in (16, 24, 16)]
    for te_layer, layer, x in zip(te_layers, native, inputs):
        torch.testing.assert_close(te_layer.weight, layer.weight, rtol=0, atol=0)
        (out, bias), (want, want_bias) = te_layer(x), layer(x)
        torch.testing.assert_close(out, want, rtol=RTOL, atol=ATOL)
        assert (bias is None) == (want_bias is None) and (bias is None or bias is te_layer.bias)
    column, row, duplicated = te_layers
    sharded = column.sharded_state_dict(prefix="column.")
    assert sharded["column.weight"].global_shape == (24, 16) and sharded["column.bias"].global_shape == (24,)
    assert "column._extra_state" in sharded
    assert row.sharded_state_dict(prefix="row.")["row.weight"].global_shape == (16, 24)
    assert not duplicated.weight.tensor_model_parallel and duplicated.weight.partition_dim == -1


def _tp2_rank():
    """One TP=2 rank: TE vs native model, GPT with and without SP and Llama-style with SP."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    torch.set_num_threads(1)
    for kind, sequence_parallel in (("gpt", False), ("gpt", True), ("llama", True)):
        config = _config(kind, tensor_model_parallel_size=2, sequence_parallel=sequence_parallel)
        native, te_model = native_and_te_models(config, kind)
        check_te_classes(te_model, kind)
        compare_runs(te_model, native, f"TP=2 {kind} sequence_parallel={sequence_parallel}")
    return True


def test_te_model_matches_native_model_at_tp2():
    assert run_on_ranks(_tp2_rank, 2, timeout=120) == [True, True]


def test_fp8_with_transformer_engine_modules_is_a_clear_error_and_native_fp8_without_te():
    from megatron.core.optimization_plan.resolve import PlanError

    with pytest.raises(PlanError, match="transformer-impl local"):
        apply_plan(_gpt(_config("gpt", fp8="hybrid"), "gpt", stand_in=True))
    native, _ = apply_plan(_gpt(_config("gpt", fp8="hybrid"), "gpt", stand_in=False))
    assert native.decoder.layers[0].self_attention.linear_qkv.fp8 is not None
