"""Transformer Engine layers behind the interfaces of the native layers (Megatron Core's TE wrappers).

`TEColumnParallelLinear`, `TERowParallelLinear`, `TELayerNormColumnParallelLinear` and
`TEDotProductAttention` take the constructor arguments of the native `ColumnParallelLinear`,
`RowParallelLinear`, `LayerNormColumnParallelLinear` and `DotProductAttention` and return what those
return (`(output, bias)` from a linear, `[sq, b, np * hn]` from attention). Their parameters carry the
native names (`weight`, `bias`, `layer_norm_weight`, `layer_norm_bias`) and attributes
(`tensor_model_parallel`, `partition_dim`, `partition_stride`, `sequence_parallel`, `allreduce`), so a
model built from the TE spec and one built from the native TE-layout spec load each other's checkpoints.
`TENorm` returns TE's own `LayerNorm` / `RMSNorm`.

Lazy base class: Transformer Engine is optional and touches CUDA, so this module never imports it.
Each wrapper is declared over `torch.nn.Module` and is bound to its TE base class
(`transformer_engine.pytorch.Linear`, ...) the first time it is constructed: `TELinear(...)` returns an
instance of a class derived from both `TELinear` and TE's `Linear`, so `isinstance(m, TELinear)` and
`isinstance(m, transformer_engine.pytorch.Linear)` both hold. Without TE, construction raises an
ImportError that names `--transformer-impl local`.

Design notes.
- Initialisation: with `use_cpu_initialization` the wrapper fills each weight from the full CPU master
  weight with the same random draws as the native layer (TE's own init is skipped), so the TE and native
  models of one seed are equal at every TP size. Otherwise TE initialises this rank's shard with
  `init_method` inside the 'model-parallel-rng' stream, as the native GPU path does.
- Gradient accumulation fusion: with `gradient_accumulation_fusion`, TE's `fuse_wgrad_accumulation` is
  switched on for a forward pass only when the weight has DDP's `main_grad` (TE reads the attribute at
  each forward), so TE adds the weight gradient into `main_grad` under DDP and returns it to autograd
  elsewhere, as the native linears do (TE alone would fail on a weight without `main_grad`). TE is called
  with `is_first_microbatch=None`, so it adds into `main_grad` on every microbatch; the flag's other use,
  FP8 weight caching, does not arise (FP8 training is not implemented).
- Attention dropout under sequence parallelism: the transformer block already runs inside the
  'model-parallel-rng' fork, and a second fork would replay the same random numbers, so TE then gets no
  RNG tracker and draws from the stream it is called in (the native attention does the same).
"""
import importlib
import types
from typing import Callable, Dict, NamedTuple, Optional, Tuple

import torch

from megatron.core.process_groups_config import get_pg_rank, get_pg_size
from megatron.core.tensor_parallel.layers import _initialize_affine_weight_cpu, set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.tensor_parallel.utils import make_sharded_state_dict_for_layer
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import get_model_comm_pgs_tp, get_tp_group
from megatron.core.utils import module_available

HAVE_TE = module_available("transformer_engine")
"""Whether `transformer_engine` could be found when this module was imported (it is not imported here)."""

_INSTEAD = "use --transformer-impl local (the native layers) instead"
_NORMS = ("LayerNorm", "RMSNorm")


def import_transformer_engine() -> types.ModuleType:
    """Import and return `transformer_engine.pytorch`.

    Raises ImportError when Transformer Engine is not installed or fails to import; the cause is kept.
    """
    if not module_available("transformer_engine"):
        raise ImportError("Transformer Engine (transformer_engine) is not installed")
    try:
        return importlib.import_module("transformer_engine.pytorch")
    except Exception as error:  # a broken install also raises OSError/RuntimeError from its CUDA libraries
        raise ImportError(f"Transformer Engine is installed but failed to import ({error})") from error


def _te_module_for(name: str) -> types.ModuleType:
    """`transformer_engine.pytorch` for building `name`; an ImportError naming the alternative without it."""
    try:
        return import_transformer_engine()
    except ImportError as error:
        raise ImportError(f"{name} needs Transformer Engine: {error}; {_INSTEAD}.") from error


# (wrapper class, TE base class) -> the class derived from both, created on first construction.
_BOUND_CLASSES: Dict[Tuple[type, type], type] = {}


def _bound_class(cls: type) -> type:
    """`cls` combined with its Transformer Engine base class `cls._te_base_name`."""
    if cls.__dict__.get("_te_bound", False):
        return cls
    te_base = getattr(_te_module_for(cls.__name__), cls._te_base_name)
    key = (cls, te_base)
    if key not in _BOUND_CLASSES:
        namespace = {"_te_bound": True, "__module__": cls.__module__, "__qualname__": cls.__qualname__,
                     "__doc__": cls.__doc__}
        # types.new_class picks the right metaclass (TE's base module is an ABC).
        _BOUND_CLASSES[key] = types.new_class(cls.__name__, (cls, te_base), exec_body=lambda ns: ns.update(namespace))
    return _BOUND_CLASSES[key]


class _TransformerEngineModule(torch.nn.Module):
    """Base of the wrappers: constructing one binds its class to the TE base class (see the module notes)."""

    _te_base_name = ""

    def __new__(cls, *args, **kwargs):
        return super().__new__(_bound_class(cls))


def _param_device(config: TransformerConfig) -> torch.device:
    """Where parameters are allocated: the CPU with use_cpu_initialization (or without a GPU), else the GPU."""
    if config.use_cpu_initialization or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _skip_init(tensor: torch.Tensor) -> torch.Tensor:
    """An init_method that leaves the tensor as it is (the wrapper fills it, or a checkpoint will)."""
    return tensor


def _rng_tracker_getter() -> Optional[Callable]:
    """Megatron's RNG-tracker getter for TE, or None while no stream is registered."""
    return get_cuda_rng_tracker if get_cuda_rng_tracker().is_initialized() else None


class _Split(NamedTuple):
    """How a linear's full [output_size, input_size] weight is split over the TP ranks."""

    output_size: int
    input_size: int
    partition_dim: int  # 0: column-parallel, 1: row-parallel, -1: not split
    stride: int
    rank: int
    size: int


_PARTITION_DIMS = {"column": 0, "row": 1, "duplicated": -1}
_TE_PARALLEL_MODES = {"column": "column", "row": "row", "duplicated": None}
_TP_AXIS_MAPS = {"column": {"weight": 0, "bias": 0}, "row": {"weight": 1}, "duplicated": {}}


def _split_of(mode: str, input_size: int, output_size: int, stride: int, tp_group) -> _Split:
    """The split of a `mode` ('column', 'row', 'duplicated') linear over `tp_group`."""
    split_over_tp = mode != "duplicated"
    size = get_pg_size(tp_group) if split_over_tp else 1
    rank = get_pg_rank(tp_group) if split_over_tp else 0
    return _Split(output_size, input_size, _PARTITION_DIMS[mode], stride if split_over_tp else 1, rank, size)


def _check_linear_arguments(name: str, mode: Optional[str], skip_weight_param_allocation: bool, is_expert: bool):
    """Raise one ValueError listing every argument the TE linears do not support."""
    problems = []
    if mode not in _PARTITION_DIMS:
        problems.append(f"parallel_mode ({mode!r}) must be 'column', 'row' or 'duplicated'")
    if skip_weight_param_allocation:
        problems.append("skip_weight_param_allocation=True is not supported (a TE linear owns its weight)")
    if is_expert:
        problems.append("is_expert=True: mixture-of-experts layers are not supported yet")
    if problems:
        raise ValueError(f"{name}: " + "; ".join(problems) + ".")


def _te_linear_kwargs(config: TransformerConfig, init_method: Callable, tp_group, split: _Split) -> dict:
    """Arguments every TE linear gets (documented `transformer_engine.pytorch.Linear` parameters)."""
    te_initialises = config.perform_initialization and not config.use_cpu_initialization
    return dict(
        sequence_parallel=bool(config.sequence_parallel) and split.size > 1,
        fuse_wgrad_accumulation=config.gradient_accumulation_fusion,
        tp_group=tp_group,
        tp_size=split.size,
        get_rng_state_tracker=_rng_tracker_getter(),
        init_method=init_method if te_initialises else _skip_init,
        params_dtype=config.params_dtype,
        device=_param_device(config),
    )


def _finish_linear(layer: torch.nn.Module, config: TransformerConfig, init_method: Callable, split: _Split) -> None:
    """Fill the weight from the CPU master weight when asked; set Megatron's parameter attributes."""
    params = dict(layer.named_parameters(recurse=False))
    weight, bias = params["weight"], params.get("bias")
    is_split = split.partition_dim >= 0
    if config.perform_initialization and config.use_cpu_initialization:
        dim = split.partition_dim if is_split else 0
        _initialize_affine_weight_cpu(
            weight, split.output_size, split.input_size, weight.shape[dim], dim, init_method, stride=split.stride,
            params_dtype=config.params_dtype, rank=split.rank, world_size=split.size,
            skip_set_tensor_parallel_attributes=True,
        )
    set_tensor_model_parallel_attributes(weight, is_split, split.partition_dim, split.stride)
    if bias is not None and split.partition_dim == 0:
        set_tensor_model_parallel_attributes(bias, True, 0, split.stride)
    elif bias is not None and split.partition_dim == 1:
        # The bias is added after the reduce-scatter: under SP each rank's gradient covers its sequence shard.
        setattr(bias, "sequence_parallel", bool(config.sequence_parallel) and split.size > 1)
    for param in params.values():
        setattr(param, "allreduce", True)


def _sharded_state_dict(module: torch.nn.Module, prefix: str, tp_axis_map: dict, sharded_offsets) -> dict:
    """Every tensor of `module` as a ShardedTensor (TP-split per `tp_axis_map`), extra state as ShardedObjects."""
    state_dict = module.state_dict(prefix="", keep_vars=True)
    return make_sharded_state_dict_for_layer(state_dict, prefix, tp_axis_map, sharded_offsets)


class _TransformerEngineLinear(_TransformerEngineModule):
    """Forward and checkpoint hooks shared by the TE linear wrappers."""

    def forward(self, x: torch.Tensor):
        """Run TE's linear; return `(output, bias)` with the bias only under skip_bias_add (else None)."""
        self.fuse_wgrad_accumulation = self.config.gradient_accumulation_fusion and hasattr(self.weight, "main_grad")
        output = super().forward(x)
        if self.te_return_bias:
            return output
        return output, None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """Weight and bias TP-split as the native layer's, `_extra_state` as a ShardedObject."""
        return _sharded_state_dict(self, prefix, self._tp_axis_map, sharded_offsets)


class TELinear(_TransformerEngineLinear):
    """TE's `Linear` with Megatron's constructor.

    parallel_mode "column": weight [out/tp, in]; with SP the input [s/tp, b, in] is all-gathered along the
    sequence first, else the input gradient is all-reduced in backward. "row": weight [out, in/tp]; the
    output is all-reduced (SP: reduce-scattered along the sequence) and the bias added after.
    "duplicated" (or None): the full weight on every rank and no communication.
    """

    _te_base_name = "Linear"

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        parallel_mode: Optional[str],
        config: TransformerConfig,
        init_method: Callable,
        bias: bool,
        skip_bias_add: bool,
        skip_weight_param_allocation: bool,
        tp_comm_buffer_name: Optional[str] = None,
        is_expert: bool = False,
        symmetric_ar_type: Optional[str] = None,
        tp_group=None,
        stride: int = 1,
    ):
        mode = parallel_mode or "duplicated"
        _check_linear_arguments(type(self).__name__, mode, skip_weight_param_allocation, is_expert)
        group = None if mode == "duplicated" else get_tp_group(tp_group)
        split = _split_of(mode, input_size, output_size, stride, group)
        return_bias = bool(skip_bias_add and bias)
        super().__init__(
            in_features=input_size,
            out_features=output_size,
            bias=bias,
            return_bias=return_bias,
            parallel_mode=_TE_PARALLEL_MODES[mode],
            **_te_linear_kwargs(config, init_method, group, split),
        )
        self.config = config
        self.te_return_bias = return_bias
        self._tp_axis_map = _TP_AXIS_MAPS[mode]
        _finish_linear(self, config, init_method, split)


class TEColumnParallelLinear(TELinear):
    """Column-parallel TE linear with `ColumnParallelLinear`'s constructor (no gather_output)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: TransformerConfig,
        init_method: Callable,
        gather_output: bool,
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool,
        skip_weight_param_allocation: bool = False,
        tp_comm_buffer_name: Optional[str] = None,
        tp_group=None,
        stride: int = 1,
    ):
        if gather_output:
            raise ValueError(f"{type(self).__name__} does not support gather_output=True: its output stays TP-split.")
        super().__init__(
            input_size, output_size, parallel_mode="column", config=config, init_method=init_method, bias=bias,
            skip_bias_add=skip_bias_add, skip_weight_param_allocation=skip_weight_param_allocation,
            tp_comm_buffer_name=tp_comm_buffer_name, is_expert=is_expert, tp_group=tp_group, stride=stride,
        )


class TERowParallelLinear(TELinear):
    """Row-parallel TE linear with `RowParallelLinear`'s constructor (the input must already be TP-split)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: TransformerConfig,
        init_method: Callable,
        bias: bool,
        input_is_parallel: bool,
        skip_bias_add: bool,
        is_expert: bool,
        tp_comm_buffer_name: Optional[str] = None,
        tp_group=None,
        stride: int = 1,
    ):
        if not input_is_parallel:
            raise ValueError(f"{type(self).__name__} needs input_is_parallel=True: TE does not scatter the input.")
        super().__init__(
            input_size, output_size, parallel_mode="row", config=config, init_method=init_method, bias=bias,
            skip_bias_add=skip_bias_add, skip_weight_param_allocation=False,
            tp_comm_buffer_name=tp_comm_buffer_name, is_expert=is_expert, tp_group=tp_group, stride=stride,
        )


class TELayerNormColumnParallelLinear(_TransformerEngineLinear):
    """TE's `LayerNormLinear` (norm fused into a column-parallel linear) with the native constructor.

    Parameters in TE's order: `layer_norm_weight`, `layer_norm_bias` (LayerNorm only), `weight`, `bias`.
    Under SP the norm runs on this rank's sequence shard, so its parameters are marked `sequence_parallel`.
    """

    _te_base_name = "LayerNormLinear"

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: TransformerConfig,
        init_method: Callable,
        gather_output: bool,
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool,
        skip_weight_param_allocation: bool = False,
        tp_comm_buffer_name: Optional[str] = None,
        tp_group=None,
        stride: int = 1,
    ):
        name = type(self).__name__
        if gather_output:
            raise ValueError(f"{name} does not support gather_output=True: its output stays TP-split.")
        if config.normalization not in _NORMS:
            raise ValueError(f"{name}: normalization ({config.normalization!r}) must be 'LayerNorm' or 'RMSNorm'.")
        _check_linear_arguments(name, "column", skip_weight_param_allocation, is_expert)
        group = get_tp_group(tp_group)
        split = _split_of("column", input_size, output_size, stride, group)
        return_bias = bool(skip_bias_add and bias)
        super().__init__(
            in_features=input_size,
            out_features=output_size,
            eps=config.layernorm_epsilon,
            bias=bias,
            normalization=config.normalization,
            return_bias=return_bias,
            parallel_mode="column",
            return_layernorm_output=False,
            zero_centered_gamma=config.layernorm_zero_centered_gamma,
            **_te_linear_kwargs(config, init_method, group, split),
        )
        self.config = config
        self.te_return_bias = return_bias
        self._tp_axis_map = _TP_AXIS_MAPS["column"]
        _finish_linear(self, config, init_method, split)
        for param_name in ("layer_norm_weight", "layer_norm_bias"):
            param = self._parameters.get(param_name)
            if param is not None:
                setattr(param, "sequence_parallel", config.sequence_parallel)


class TEDotProductAttention(_TransformerEngineModule):
    """TE's `DotProductAttention` with the native constructor and forward.

    Queries [sq, b, np, hn] and keys/values [sk, b, ng, hn] ('sbhd') give [sq, b, np * hn]. Masks follow
    Megatron (True = masked out); causal and no-mask layers pass no mask to TE, which builds the causal
    mask itself (the native TE-layout attention also ignores the mask of a causal layer).
    """

    _te_base_name = "DotProductAttention"

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
        cp_comm_type: Optional[str] = "p2p",
        model_comm_pgs=None,
    ):
        if config.context_parallel_size != 1:
            raise ValueError(
                f"{type(self).__name__}: context_parallel_size ({config.context_parallel_size}) > 1 is not "
                "supported yet: use context_parallel_size=1."
            )
        group = get_tp_group(get_model_comm_pgs_tp(model_comm_pgs))
        kv_channels = config.kv_channels
        if k_channels is not None or v_channels is not None:
            kv_channels = (k_channels or config.kv_channels, v_channels or config.kv_channels)
        optional = {}
        if softmax_scale is not None:
            optional["softmax_scale"] = softmax_scale
        if config.window_size is not None:
            optional["window_size"] = config.window_size
        super().__init__(
            num_attention_heads=config.num_attention_heads,
            kv_channels=kv_channels,
            num_gqa_groups=config.num_query_groups,
            attention_dropout=config.attention_dropout if attention_dropout is None else attention_dropout,
            qkv_format="sbhd",
            attn_mask_type=attn_mask_type.name,
            sequence_parallel=config.sequence_parallel,
            tp_size=get_pg_size(group),
            get_rng_state_tracker=None if config.sequence_parallel else _rng_tracker_getter(),
            tp_group=group,
            layer_number=layer_number,
            attention_type=attention_type,
            **optional,
        )
        self.config = config
        self.megatron_attn_mask_type = attn_mask_type

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """softmax(Q K^T * scale + mask) V over this rank's heads: [sq, b, np, hn] -> [sq, b, np * hn]."""
        if packed_seq_params is not None:
            raise ValueError(f"{type(self).__name__}: packed sequences (packed_seq_params) are not supported yet.")
        mask_type = self.megatron_attn_mask_type if attn_mask_type is None else attn_mask_type
        if mask_type in (AttnMaskType.causal, AttnMaskType.no_mask):
            attention_mask = None
        bias_kwargs = {}
        if attention_bias is not None:
            bias_kwargs = {"core_attention_bias_type": "post_scale_bias", "core_attention_bias": attention_bias}
        return super().forward(
            query, key, value, attention_mask=attention_mask, attn_mask_type=mask_type.name, **bias_kwargs
        )

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """Everything replicated over TP (TE's `_extra_state` as a ShardedObject)."""
        return _sharded_state_dict(self, prefix, {}, sharded_offsets)


class TENorm:
    """Builds TE's `LayerNorm` or `RMSNorm`, chosen by `config.normalization` (Megatron's `TENorm`).

    The result is TE's module itself: parameters `weight` (and `bias` for LayerNorm), as the native norm
    names them, marked `sequence_parallel` like the native norm's.
    """

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5):
        te_pytorch = _te_module_for(cls.__name__)
        if config.normalization not in _NORMS:
            raise ValueError(
                f"TENorm: normalization ({config.normalization!r}) must be 'LayerNorm' or 'RMSNorm' (--normalization)."
            )
        norm = getattr(te_pytorch, config.normalization)(
            hidden_size,
            eps=eps,
            sequence_parallel=config.sequence_parallel,
            zero_centered_gamma=config.layernorm_zero_centered_gamma,
            params_dtype=config.params_dtype,
            device=_param_device(config),
        )
        for param in norm.parameters():
            setattr(param, "sequence_parallel", config.sequence_parallel)
        return norm


__all__ = [
    "HAVE_TE",
    "import_transformer_engine",
    "TENorm",
    "TELinear",
    "TEColumnParallelLinear",
    "TERowParallelLinear",
    "TELayerNormColumnParallelLinear",
    "TEDotProductAttention",
]
