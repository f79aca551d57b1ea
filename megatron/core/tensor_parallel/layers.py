"""Tensor-parallel layers: `ColumnParallelLinear`, `RowParallelLinear`, `VocabParallelEmbedding`.

Weights are stored in Megatron's layout (column: `[out/tp, in]`, row: `[out, in/tp]`, embedding:
`[V/tp, h]`) and carry Megatron's parameter attributes (`tensor_model_parallel`, `partition_dim`,
`partition_stride`, `sequence_parallel`, `allreduce`). All communication goes through `mappings`.

Gradient accumulation fusion (`gradient_accumulation_fusion=True`, the CLI default) works everywhere: the
weight gradient goes straight into `weight.main_grad` (`tensor_parallel.wgrad_accumulation`, whose names are
re-exported here). The FP8 GEMMs with `--tp-comm-overlap` are `tensor_parallel.fp8_overlap`.
"""
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.nn.parameter import Parameter

from megatron.core import parallel_state
from megatron.core.fp8.linear import fp8_linear
from megatron.core.fp8.recipe import Fp8LinearState, Fp8Recipe
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.process_groups_config import get_pg_rank, get_pg_size, get_tensor_model_parallel_group_if_none
from megatron.core.tensor_parallel.fp8_overlap import fp8_linear_all_gather_overlap, fp8_linear_reduce_scatter_overlap
from megatron.core.tensor_parallel.mappings import (
    ReduceOp,
    all_gather_along_first_dim,
    all_gather_along_first_dim_async,
    all_reduce_tensor,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_along_first_dim_async,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.overlap import (
    all_gather_matmul, matmul_reduce_scatter, matmul_reduce_scatter_async)
from megatron.core.tensor_parallel.peer_copy import peer_copy_transport
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name
from megatron.core.tensor_parallel.utils import VocabUtility, make_sharded_state_dict_for_layer
from megatron.core.tensor_parallel.wgrad_accumulation import (
    _weight_grad,
    accumulate_wgrad_fp32_,
    add_weight_grad_to_main_grad,
    addmm_fp32_out_supported,
)
from megatron.core.utils import divide

_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS = {"tensor_model_parallel": False, "partition_dim": -1, "partition_stride": 1}


def param_is_not_tensor_parallel_duplicate(param) -> bool:
    """True for TP-split params and, for replicated params, only on TP rank 0 (count each value once)."""
    return bool(getattr(param, "tensor_model_parallel", False)) or (
        parallel_state.get_tensor_model_parallel_rank() == 0
    )


def set_tensor_model_parallel_attributes(tensor, is_parallel: bool, dim: int, stride: int) -> None:
    """Mark `tensor` as TP-split (or not) along `dim` with `stride` interleaved partitions."""
    setattr(tensor, "tensor_model_parallel", is_parallel)
    setattr(tensor, "partition_dim", dim)
    setattr(tensor, "partition_stride", stride)


def set_defaults_if_not_set_tensor_model_parallel_attributes(tensor) -> None:
    """Give `tensor` the 'not TP-split' attributes unless it already has them."""
    for attribute, value in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS.items():
        if not hasattr(tensor, attribute):
            setattr(tensor, attribute, value)


def copy_tensor_model_parallel_attributes(destination_tensor, source_tensor) -> None:
    """Copy the TP attributes that `source_tensor` has onto `destination_tensor`."""
    for attribute in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS:
        if hasattr(source_tensor, attribute):
            setattr(destination_tensor, attribute, getattr(source_tensor, attribute))


def _initialize_affine_weight_gpu(weight, init_method, partition_dim, stride=1, is_expert=False) -> None:
    """Init this rank's shard in place under the model-parallel (or expert-parallel) RNG stream."""
    set_tensor_model_parallel_attributes(weight, True, partition_dim, stride)
    name = get_expert_parallel_rng_tracker_name() if is_expert else "model-parallel-rng"
    tracker = get_cuda_rng_tracker()
    if tracker.is_initialized() and name in getattr(tracker, "states_", {name: None}):
        with tracker.fork(name):
            init_method(weight)
    else:
        init_method(weight)


def _initialize_affine_weight_cpu(
    weight,
    output_size,
    input_size,
    per_partition_size,
    partition_dim,
    init_method,
    stride=1,
    return_master_weight=False,
    *,
    params_dtype=torch.float32,
    rank=None,
    world_size=None,
    skip_set_tensor_parallel_attributes=False,
):
    """Init the full `[output_size, input_size]` weight on CPU (default generator) and copy this rank's
    partitions into `weight`, so the model is identical for every TP size."""
    if not skip_set_tensor_parallel_attributes:
        set_tensor_model_parallel_attributes(weight, True, partition_dim, stride)
    master_weight = torch.empty(output_size, input_size, dtype=torch.float, device="cpu", requires_grad=False)
    init_method(master_weight)
    master_weight = master_weight.to(dtype=params_dtype)
    if rank is None:
        rank = parallel_state.get_tensor_model_parallel_rank()
        world_size = parallel_state.get_tensor_model_parallel_world_size()
    per_partition_per_stride_size = divide(per_partition_size, stride)
    # [out, in] -> (stride * tp) x [out/(stride*tp), in] along partition_dim; this rank keeps every tp-th piece
    pieces = torch.split(master_weight, per_partition_per_stride_size, dim=partition_dim)
    with torch.no_grad():
        weight.data.copy_(torch.cat(pieces[rank::world_size], dim=partition_dim).to(weight.device))
    return master_weight if return_master_weight else None


def _weight_device(config: ModelParallelConfig):
    if config.use_cpu_initialization or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


class LinearWithGradAccumulationAndAsyncCommunication(torch.autograd.Function):
    """`y = x W^T + b` with TP/SP communication folded in.

    Forward: with sequence_parallel, all-gather x along the sequence dim first.
    Backward: dgrad is all-reduced over TP (allreduce_dgrad, overlapped with the wgrad GEMM) or
    reduce-scattered along the sequence dim (sequence_parallel, overlapped with the wgrad GEMM, after
    the input's all-gather overlapped with the dgrad GEMM); wgrad goes to `main_grad` when fused.
    """

    @staticmethod
    def forward(ctx, input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                grad_output_buffer, wgrad_deferral_limit, tp_group, overlap_all_gather=False, peer_copy=False):
        ctx.save_for_backward(input, weight)
        ctx.use_bias = bias is not None
        ctx.gradient_accumulation_fusion = gradient_accumulation_fusion
        ctx.allreduce_dgrad = allreduce_dgrad
        ctx.sequence_parallel = sequence_parallel
        ctx.grad_output_buffer = grad_output_buffer
        ctx.wgrad_deferral_limit = wgrad_deferral_limit
        ctx.tp_group = tp_group
        ctx.overlap_all_gather, ctx.peer_copy = overlap_all_gather, peer_copy
        if sequence_parallel and overlap_all_gather:
            # [s/tp, b, in] -> [s, b, out], each chunk's GEMM overlapping the next chunk's transfer
            return all_gather_matmul(input, weight, bias, tp_group, peer_copy=peer_copy)
        total_input = all_gather_along_first_dim(input, tp_group) if sequence_parallel else input
        # [s, b, in] x [out, in] (+ [out]) -> [s, b, out]; the bias add is fused into the GEMM
        return F.linear(total_input, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        group = ctx.tp_group
        wgrad_compute = ctx.needs_input_grad[1]
        buffer = ctx.grad_output_buffer
        if buffer is not None and wgrad_compute:
            if ctx.wgrad_deferral_limit == 0 or len(buffer) < ctx.wgrad_deferral_limit:
                buffer.append(grad_output)
                wgrad_compute = False
        transport = (peer_copy_transport(group, grad_output.device)
                     if ctx.sequence_parallel and ctx.overlap_all_gather and ctx.peer_copy else None)
        if transport is not None:
            return _sequence_parallel_backward_peer_copy(ctx, transport, grad_output, input, weight, wgrad_compute)
        total_input = input
        gather = None
        if ctx.sequence_parallel and wgrad_compute:
            gather = all_gather_along_first_dim_async(input, group)  # moves while the dgrad GEMM runs
        grad_input = grad_output.matmul(weight) if ctx.needs_input_grad[0] else None
        if gather is not None:
            total_input = gather.wait()
        handle = scatter = None
        if ctx.allreduce_dgrad and grad_input is not None:
            grad_input = grad_input.contiguous()
            handle = all_reduce_tensor(grad_input, group, async_op=True)
        elif ctx.sequence_parallel and grad_input is not None:
            scatter = reduce_scatter_along_first_dim_async(grad_input, group)  # moves while the wgrad GEMM runs
        grad_weight, grad_bias = _weight_and_bias_grads(ctx, weight, grad_output,
                                                        total_input if wgrad_compute else None)
        if scatter is not None:
            grad_input = scatter.wait()
        if handle is not None:
            handle.wait()
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None, None, None


def _weight_and_bias_grads(ctx, weight, grad_output, total_input):
    """(weight gradient, bias gradient) of `LinearWithGradAccumulationAndAsyncCommunication`'s backward; no
    weight gradient when `total_input` (the all-gathered input) is None."""
    # [s, b, out] -> [s*b, out]
    grad_output_2d = grad_output.reshape(-1, grad_output.shape[-1])
    grad_weight = None
    if total_input is not None:
        # [s, b, in] -> [s*b, in]
        grad_weight = _weight_grad(ctx, weight, grad_output_2d, total_input.reshape(-1, total_input.shape[-1]))
    grad_bias = grad_output_2d.sum(dim=0) if ctx.use_bias else None  # [s*b, out] -> [out]
    return grad_weight, grad_bias


def _sequence_parallel_backward_peer_copy(ctx, transport, grad_output, input, weight, wgrad_compute):
    """The sequence-parallel backward of `LinearWithGradAccumulationAndAsyncCommunication` under
    `--tp-comm-overlap` with a copy-engine transport: the input's all-gather (for the weight gradient) and
    the dgrad's reduce-scatter move by copy engine while the dgrad and weight-gradient GEMMs run, so no
    communication kernel takes SMs from them."""
    gather = transport.all_gather_async(input) if wgrad_compute else None
    scatter = None
    if ctx.needs_input_grad[0]:
        # [s, b, out] x [out, in] -> [s, b, in], reduce-scattered along s: [s/tp, b, in]
        scatter = matmul_reduce_scatter_async(grad_output, weight.t(), ctx.tp_group, peer_copy=True)
    total_input = gather.wait() if gather is not None else None
    grad_weight, grad_bias = _weight_and_bias_grads(ctx, weight, grad_output, total_input)
    grad_input = scatter.wait() if scatter is not None else None
    return grad_input, grad_weight, grad_bias, None, None, None, None, None, None, None, None


class LinearWithReduceScatterOverlap(torch.autograd.Function):
    """Row-parallel `y = reduce_scatter(x W^T)` along the sequence with the GEMM chunks overlapping the
    transfers (`overlap.matmul_reduce_scatter`). Backward: the output gradient's all-gather pipelined with
    the dgrad GEMM chunks (`overlap.all_gather_matmul`), then the weight gradient from the gathered output
    gradient (into `main_grad` when fused)."""

    @staticmethod
    def forward(ctx, input, weight, gradient_accumulation_fusion, tp_group, peer_copy=False):
        ctx.save_for_backward(input, weight)
        ctx.gradient_accumulation_fusion, ctx.tp_group = gradient_accumulation_fusion, tp_group
        ctx.peer_copy = peer_copy
        return matmul_reduce_scatter(input, weight, tp_group, peer_copy=peer_copy)

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        grad_input = None
        if ctx.needs_input_grad[0]:
            # [s/tp, b, out] -> (all-gathered: total_grad [s, b, out]) x [out, in] -> [s, b, in]
            grad_input, total_grad = all_gather_matmul(grad_output, weight.t(), None, ctx.tp_group,
                                                       return_gathered=True, peer_copy=ctx.peer_copy)
        else:
            total_grad = all_gather_along_first_dim(grad_output, ctx.tp_group)  # [s/tp, b, out] -> [s, b, out]
        grad_weight = None
        if ctx.needs_input_grad[1]:
            # [s, b, out] -> [s*b, out]; [s, b, in] -> [s*b, in]
            grad_2d, input_2d = total_grad.reshape(-1, total_grad.shape[-1]), input.reshape(-1, input.shape[-1])
            grad_weight = _weight_grad(ctx, weight, grad_2d, input_2d)
        return grad_input, grad_weight, None, None, None


def linear_with_grad_accumulation_and_async_allreduce(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    gradient_accumulation_fusion: bool,
    allreduce_dgrad: bool,
    sequence_parallel: bool,
    grad_output_buffer: Optional[List[torch.Tensor]] = None,
    wgrad_deferral_limit: Optional[int] = 0,
    async_grad_allreduce: Optional[bool] = None,
    tp_group=None,
    tp_comm_overlap_ag: bool = False,
    tp_comm_transport: str = "p2p",
    trace_when_compiled: bool = False,
) -> torch.Tensor:
    """Linear layer with TP communication in its backward (see LinearWithGradAccumulationAndAsyncCommunication).

    `async_grad_allreduce` is the deprecated name of `allreduce_dgrad`; `tp_group=None` means the TP group;
    `tp_comm_overlap_ag` pipelines the sequence-parallel input all-gather with the GEMM (`overlap.py`), its
    chunks moved by `tp_comm_transport` ('copy-engine' or 'p2p'). Inside a `torch.compile` trace the autograd
    function is called eagerly (the layer's graph splits here) unless `trace_when_compiled` (the layers'
    `--compile-linears` decision of the optimisation plan).
    """
    if async_grad_allreduce is not None:
        allreduce_dgrad = async_grad_allreduce
    if allreduce_dgrad and sequence_parallel:
        raise ValueError("allreduce_dgrad and sequence_parallel cannot both be True: SP reduce-scatters the dgrad")
    tp_group = get_tensor_model_parallel_group_if_none(tp_group)
    apply = LinearWithGradAccumulationAndAsyncCommunication.apply
    if torch.compiler.is_compiling() and not trace_when_compiled:
        apply = _apply_linear_eagerly
    return apply(
        input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
        grad_output_buffer, wgrad_deferral_limit or 0, tp_group, tp_comm_overlap_ag,
        tp_comm_transport == "copy-engine",
    )


@torch.compiler.disable
def _apply_linear_eagerly(*args):
    return LinearWithGradAccumulationAndAsyncCommunication.apply(*args)



class LinearWithFrozenWeight(torch.autograd.Function):
    """`y = x W^T + b` for a weight that takes no gradient (Megatron's op for frozen weights).

    Forward and input gradient are the same computation as `LinearWithGradAccumulationAndAsyncCommunication`;
    the backward only returns the input gradient, all-reduced over `tp_group` when `allreduce_dgrad`
    (a sequence-parallel caller gathers its input before and gets the reduce-scatter from that gather).
    """

    @staticmethod
    def forward(ctx, input, weight, bias, allreduce_dgrad, tp_group):
        ctx.save_for_backward(weight)
        ctx.allreduce_dgrad = allreduce_dgrad
        ctx.tp_group = tp_group
        output = torch.matmul(input, weight.t())  # [s, b, in] x [in, out] -> [s, b, out]
        if bias is not None:
            output = output + bias
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (weight,) = ctx.saved_tensors
        grad_input = grad_output.matmul(weight)  # [s, b, out] x [out, in] -> [s, b, in]
        if ctx.allreduce_dgrad:
            all_reduce_tensor(grad_input, ctx.tp_group)
        return grad_input, None, None, None, None


def linear_with_frozen_weight(
    input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
    grad_output_buffer=None, wgrad_deferral_limit=None, async_grad_allreduce=None, tp_group=None,
    tp_comm_overlap_ag=False, tp_comm_transport="p2p", trace_when_compiled=False,
):
    """The linear of a weight with requires_grad=False (`LinearWithFrozenWeight`); with sequence parallelism
    the input is all-gathered along the sequence first (its gradient reduce-scattered back).

    `gradient_accumulation_fusion`, `wgrad_deferral_limit` and `tp_comm_overlap_ag` have nothing to act on; a
    deferred weight-gradient buffer is refused (as in Megatron); `async_grad_allreduce` is the deprecated name
    of `allreduce_dgrad`.
    """
    if grad_output_buffer is not None:
        raise ValueError("grad_output_buffer must be None for a frozen weight: there is no weight gradient to defer")
    if async_grad_allreduce is not None:
        allreduce_dgrad = async_grad_allreduce
    tp_group = get_tensor_model_parallel_group_if_none(tp_group)
    if sequence_parallel:
        # [s/tp, b, in] -> [s, b, in]; backward reduce-scatters the input gradient
        input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=tp_group)
    return LinearWithFrozenWeight.apply(input, weight, bias, allreduce_dgrad, tp_group)


class VocabParallelEmbedding(torch.nn.Module):
    """Embedding split along the vocabulary: rank r holds rows [r*V/tp, (r+1)*V/tp).

    Forward: look up the ids this rank owns (others give 0), then all-reduce over TP, or, with
    `reduce_scatter_embeddings`, transpose to `[s, b, h]` and reduce-scatter along the sequence.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, init_method: Callable,
                 reduce_scatter_embeddings: bool = False, config: ModelParallelConfig, tp_group=None):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.reduce_scatter_embeddings = reduce_scatter_embeddings
        self.tp_group = get_tensor_model_parallel_group_if_none(tp_group)
        self.tp_size = get_pg_size(self.tp_group)
        self.tp_rank = get_pg_rank(self.tp_group)
        self.vocab_start_index, self.vocab_end_index = VocabUtility.vocab_range_from_global_vocab_size(
            num_embeddings, self.tp_rank, self.tp_size
        )
        self.num_embeddings_per_partition = self.vocab_end_index - self.vocab_start_index
        self.deterministic_mode = config.deterministic_mode
        self.weight = Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim,
                                            device=_weight_device(config), dtype=config.params_dtype))
        if config.perform_initialization:
            if config.use_cpu_initialization:
                _initialize_affine_weight_cpu(
                    self.weight, num_embeddings, embedding_dim, self.num_embeddings_per_partition, 0, init_method,
                    params_dtype=config.params_dtype, rank=self.tp_rank, world_size=self.tp_size,
                )
            else:
                _initialize_affine_weight_gpu(self.weight, init_method, partition_dim=0, stride=1)
        else:
            set_tensor_model_parallel_attributes(self.weight, True, 0, 1)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        """[b, s] token ids -> [b, s, h] (or [s/tp, b, h] with reduce_scatter_embeddings)."""
        if self.tp_size > 1:
            input_mask = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
            masked_input = input_.clone() - self.vocab_start_index
            masked_input[input_mask] = 0
        else:
            masked_input = input_
        if self.deterministic_mode:
            output_parallel = self.weight[masked_input]
        else:
            output_parallel = F.embedding(masked_input, self.weight)
        if self.tp_size > 1:
            output_parallel[input_mask, :] = 0.0
        if self.reduce_scatter_embeddings:
            # [b, s, h] -> [s, b, h]
            output_parallel = output_parallel.transpose(0, 1).contiguous()
            return reduce_scatter_to_sequence_parallel_region(output_parallel, group=self.tp_group)
        return reduce_from_tensor_model_parallel_region(output_parallel, group=self.tp_group)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """The weight, TP-split along the vocabulary; loads across padded-vocab changes (shape mismatch allowed)."""
        state_dict = {"weight": self.state_dict(prefix="", keep_vars=True)["weight"]}
        return make_sharded_state_dict_for_layer(state_dict, prefix, {"weight": 0}, sharded_offsets,
                                                 allow_shape_mismatch=True)


def _init_linear_weight(layer, config, init_method, out_full, in_full, per_partition, partition_dim, stride,
                        keep_master_weight_for_test, is_expert):
    """Create and initialise `layer.weight` of shape [out, in] split along `partition_dim`."""
    shape = (per_partition, in_full) if partition_dim == 0 else (out_full, per_partition)
    layer.weight = Parameter(torch.empty(*shape, device=_weight_device(config), dtype=config.params_dtype))
    layer.master_weight = None
    if not config.perform_initialization:
        set_tensor_model_parallel_attributes(layer.weight, True, partition_dim, stride)
    elif config.use_cpu_initialization:
        layer.master_weight = _initialize_affine_weight_cpu(
            layer.weight, out_full, in_full, per_partition, partition_dim, init_method, stride=stride,
            return_master_weight=keep_master_weight_for_test, params_dtype=config.params_dtype,
            rank=layer.tp_rank, world_size=layer.tp_size,
        )
    else:
        _initialize_affine_weight_gpu(layer.weight, init_method, partition_dim, stride, is_expert=is_expert)
    setattr(layer.weight, "allreduce", not (is_expert and layer.expert_parallel))
    if config.gradient_accumulation_fusion and torch.cuda.is_available() and torch.cuda.is_initialized():
        # Probe now, eagerly: a compiled layer's backward is traced before any eager backward runs. Only
        # where CUDA is already up, so that building a CPU layer never initialises CUDA (forked test ranks).
        addmm_fp32_out_supported(torch.device("cuda", torch.cuda.current_device()), config.params_dtype)


def _init_bias(layer, config, size, stride, tensor_parallel):
    bias = Parameter(torch.empty(size, device=_weight_device(config), dtype=config.params_dtype))
    if tensor_parallel:
        set_tensor_model_parallel_attributes(bias, True, 0, stride)
    if config.perform_initialization:
        with torch.no_grad():
            bias.zero_()
    setattr(bias, "allreduce", not (layer.is_expert and layer.expert_parallel))
    return bias


def _amax_max_over(group) -> Callable[[torch.Tensor], torch.Tensor]:
    """The FP8 amax reduction of an operand split over `group`: the maximum over its ranks, in place (the
    communication `megatron.core.fp8` leaves to the layer that owns the group)."""

    def reduce(amax_: torch.Tensor) -> torch.Tensor:
        all_reduce_tensor(amax_, group, op=ReduceOp.MAX)
        return amax_

    return reduce


class _ParallelLinearBase(torch.nn.Module):
    """Shared set-up of the column- and row-parallel linear layers."""

    def _setup(self, config, is_expert, tp_group, skip_bias_add):
        self.config = config
        self.is_expert = is_expert
        self.expert_parallel = config.expert_model_parallel_size > 1
        self.skip_bias_add = skip_bias_add
        self.tp_group = get_tensor_model_parallel_group_if_none(tp_group, is_expert=is_expert)
        self.tp_size = get_pg_size(self.tp_group)
        self.tp_rank = get_pg_rank(self.tp_group)
        self.explicit_expert_comm = is_expert and (self.tp_size > 1 or self.expert_parallel)
        self.sequence_parallel = config.sequence_parallel and self.tp_size > 1
        self.gradient_accumulation_fusion = config.gradient_accumulation_fusion
        self._forward_impl = linear_with_grad_accumulation_and_async_allreduce
        # How this layer runs: built plain; the optimisation plan (`megatron.core.optimization_plan`) turns
        # these on through `enable_fp8` / `enable_tp_comm_overlap` and `trace_when_compiled`.
        self.fp8: Optional[Fp8LinearState] = None
        self.tp_comm_overlap_halves: Tuple[str, ...] = ()
        self.tp_comm_transport = "p2p"
        self.trace_when_compiled = False

    _FP8_SHARDED: tuple = ()
    # (overlap half, operand): the operand that the pipelined half of `--tp-comm-overlap` quantizes in
    # sequence chunks, so that its amax too is reduced over TP (`fp8_overlap`)
    _FP8_OVERLAP_SHARDED: Tuple[str, str] = ("", "")

    def enable_fp8(self, recipe: Fp8Recipe) -> None:
        """Run this layer's GEMMs in FP8 under `recipe` from now on (the amax of the operands split over TP
        reduced over the TP group, so the scales are those of the unsplit layer)."""
        reduce = _amax_max_over(self.tp_group) if self.tp_size > 1 else None
        half, operand = self._FP8_OVERLAP_SHARDED
        sharded = self._FP8_SHARDED + ((operand,) if half and self._overlap(half) else ())
        self.fp8 = Fp8LinearState(recipe, sharded, reduce)
        if recipe.fp8_param and getattr(self, "weight", None) is not None:
            # `--fp8-param-gather`: the distributed optimizer gathers this weight as FP8 bytes (`fp8.params`)
            setattr(self.weight, "fp8_param", True)

    def enable_tp_comm_overlap(self, all_gather: bool, reduce_scatter: bool, transport: str) -> None:
        """`--tp-comm-overlap`: pipeline this layer's sequence-parallel all-gather and/or reduce-scatter with its
        GEMM, the chunks moved by `transport` ('copy-engine' or 'p2p'); a layer without sequence parallelism
        (or an expert layer with its own communication) has nothing to pipeline and runs as before."""
        if transport not in ("copy-engine", "p2p"):
            raise ValueError(f"tp_comm_overlap_transport {transport!r}: expected 'copy-engine' or 'p2p'")
        self.tp_comm_overlap_halves = tuple(half for half, on in (("ag", all_gather), ("rs", reduce_scatter)) if on)
        self.tp_comm_transport = transport
        if self.fp8 is not None:  # the operands split by the pipelines reduce their amax too
            self.enable_fp8(self.fp8.recipe)

    def _linear(self, input_parallel, weight, bias, allreduce_dgrad, sequence_parallel, grad_output_buffer=None):
        if self.fp8 is not None and grad_output_buffer is None:
            return self._fp8_linear(input_parallel, weight, bias, allreduce_dgrad, sequence_parallel)
        impl = self._forward_impl if weight.requires_grad else linear_with_frozen_weight
        return impl(
            input=input_parallel,
            weight=weight,
            bias=bias,
            gradient_accumulation_fusion=self.gradient_accumulation_fusion,
            allreduce_dgrad=allreduce_dgrad,
            sequence_parallel=sequence_parallel,
            grad_output_buffer=grad_output_buffer,
            wgrad_deferral_limit=self.config.wgrad_deferral_limit,
            tp_group=self.tp_group,
            tp_comm_overlap_ag=bool(sequence_parallel and self._overlap("ag")),
            tp_comm_transport=self.tp_comm_transport,
            trace_when_compiled=self.trace_when_compiled,
        )

    @torch.compiler.disable
    def _fp8_linear(self, input_parallel, weight, bias, allreduce_dgrad, sequence_parallel):
        """The FP8 GEMMs (`megatron.core.fp8.linear`) between this layer's TP mappings: (SP) all-gather the
        input along the sequence (backward: reduce-scatter), or (TP without SP) all-reduce the input
        gradient. Runs eagerly inside compiled layers, like the bf16 linears."""
        fused = self.gradient_accumulation_fusion and weight.requires_grad
        sink = add_weight_grad_to_main_grad if fused else None
        if sequence_parallel and self._overlap("ag"):
            return fp8_linear_all_gather_overlap(input_parallel, weight, bias, self.fp8, self.tp_group, sink)
        if sequence_parallel:
            input_parallel = gather_from_sequence_parallel_region(input_parallel, group=self.tp_group)
        elif allreduce_dgrad:
            input_parallel = copy_to_tensor_model_parallel_region(input_parallel, group=self.tp_group)
        return fp8_linear(input_parallel, weight, bias, self.fp8, sink)

    def _overlap(self, half: str) -> bool:
        """Whether `--tp-comm-overlap` pipelines this layer's sequence-parallel all-gather ('ag') or
        reduce-scatter ('rs') with its GEMM (`enable_tp_comm_overlap`)."""
        return bool(self.sequence_parallel and not self.explicit_expert_comm and half in self.tp_comm_overlap_halves)

    _TP_AXIS_MAP: dict = {}

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """Weight and bias as ShardedTensors (TP-split per `_TP_AXIS_MAP`), `_extra_state` as a ShardedObject."""
        state_dict = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_state_dict_for_layer(state_dict, prefix, self._TP_AXIS_MAP, sharded_offsets)

    def set_extra_state(self, state: Any) -> None:
        """Extra state is ignored (kept for Transformer Engine state-dict compatibility)."""

    def get_extra_state(self) -> None:
        """No extra state; the `_extra_state` key keeps state dicts compatible with Transformer Engine layers."""
        return None

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """An absent `_extra_state` is not a missing key: it carries no data here, and Megatron's checkpoints
        omit some of them (`output_layer._extra_state` is never saved), so a strict load of such a state dict
        works as it does with Megatron's layers."""
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        extra_key = prefix + "_extra_state"
        if extra_key not in state_dict and extra_key in missing_keys:
            missing_keys.remove(extra_key)
        if getattr(self, "weight", None) is not None and prefix + "weight" in state_dict:
            self.weight.fp8_weight_copy = None  # an FP8 parameter's copy is stale: requantized on the next gather


class ColumnParallelLinear(_ParallelLinearBase):
    """`Y = X A + b` with A split along its output dim: weight `[output_size/tp, input_size]`.

    Forward: (SP) all-gather X along the sequence dim, or (no SP) identity with the dgrad all-reduced
    in backward; optionally all-gather Y along the last dim (`gather_output`).
    Returns `(output, output_bias)`; `output_bias` is the bias only with `skip_bias_add`.
    """

    _TP_AXIS_MAP = {"weight": 0, "bias": 0}
    _FP8_SHARDED = ("weight", "grad_output")
    _FP8_OVERLAP_SHARDED = ("ag", "input")

    def __init__(self, input_size, output_size, *, config: ModelParallelConfig, init_method: Callable, bias=True,
                 gather_output=False, stride=1, keep_master_weight_for_test=False, skip_bias_add=False,
                 skip_weight_param_allocation: bool = False, embedding_activation_buffer: Optional[List] = None,
                 grad_output_buffer: Optional[List] = None, is_expert: bool = False, tp_comm_buffer_name: str = None,
                 disable_grad_reduce: bool = False, tp_group=None):
        super().__init__()
        self._setup(config, is_expert, tp_group, skip_bias_add)
        self.input_size = input_size
        self.output_size = output_size
        self.gather_output = gather_output
        self.embedding_activation_buffer = embedding_activation_buffer
        self.grad_output_buffer = grad_output_buffer
        self.disable_grad_reduce = disable_grad_reduce
        self.output_size_per_partition = divide(output_size, self.tp_size)
        if skip_weight_param_allocation:
            self.weight = None
        else:
            _init_linear_weight(self, config, init_method, output_size, input_size, self.output_size_per_partition,
                                0, stride, keep_master_weight_for_test, is_expert)
        if bias:
            self.bias = _init_bias(self, config, self.output_size_per_partition, stride, tensor_parallel=True)
        else:
            self.register_parameter("bias", None)
        self.allreduce_dgrad = self.tp_size > 1 and not self.sequence_parallel and not disable_grad_reduce

    def _check_weight(self, weight):
        if weight is None:
            if self.weight is None:
                raise RuntimeError(
                    "ColumnParallelLinear was built with skip_weight_param_allocation=True: pass weight= to forward"
                )
            return self.weight
        expected = (self.output_size_per_partition, self.input_size)
        if tuple(weight.shape) != expected:
            raise RuntimeError(f"supplied weight's shape is {tuple(weight.shape)}, not {expected} as expected")
        return weight

    def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None, runtime_gather_output=None):
        """[s, b, h_in] (or [s/tp, b, h_in] with SP) -> ([s, b, h_out/tp] or gathered [s, b, h_out], bias)."""
        weight = self._check_weight(weight)
        bias = self.bias if not self.skip_bias_add else None
        plain_input = self.allreduce_dgrad or self.sequence_parallel or self.explicit_expert_comm
        if plain_input or self.disable_grad_reduce:
            input_parallel = input_
        else:
            input_parallel = copy_to_tensor_model_parallel_region(input_, group=self.tp_group)
        if self.config.defer_embedding_wgrad_compute and self.embedding_activation_buffer is not None:
            limit = self.config.wgrad_deferral_limit
            if limit == 0 or len(self.embedding_activation_buffer) < limit:
                self.embedding_activation_buffer.append(input_parallel)
        output_parallel = self._linear(
            input_parallel, weight, bias,
            allreduce_dgrad=False if self.explicit_expert_comm else self.allreduce_dgrad,
            sequence_parallel=False if self.explicit_expert_comm else self.sequence_parallel,
            grad_output_buffer=self.grad_output_buffer if self.config.defer_embedding_wgrad_compute else None,
        )
        gather_output = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather_output:
            if self.sequence_parallel:
                raise ValueError("gather_output=True cannot be combined with sequence_parallel=True")
            output = gather_from_tensor_model_parallel_region(output_parallel, group=self.tp_group)
        else:
            output = output_parallel
        return output, (self.bias if self.skip_bias_add else None)

    def __repr__(self):
        return (f"{type(self).__name__}(in_features={self.input_size}, out_features={self.output_size}, "
                f"bias={self.bias is not None}, TP={self.tp_size})")


class RowParallelLinear(_ParallelLinearBase):
    """`Y = X A + b` with A split along its input dim: weight `[output_size, input_size/tp]`.

    Forward: (unless input_is_parallel) keep this rank's slice of X's last dim, multiply, then
    all-reduce over TP, or reduce-scatter along the sequence dim with SP; the bias is added after.
    """

    _TP_AXIS_MAP = {"weight": 1}
    _FP8_SHARDED = ("input", "weight")
    _FP8_OVERLAP_SHARDED = ("rs", "grad_output")

    def __init__(self, input_size: int, output_size: int, *, config: ModelParallelConfig, init_method: Callable,
                 bias: bool, input_is_parallel: bool, skip_bias_add: bool, stride: int = 1,
                 keep_master_weight_for_test: bool = False, is_expert: bool = False, tp_comm_buffer_name: str = None,
                 tp_group=None):
        super().__init__()
        self._setup(config, is_expert, tp_group, skip_bias_add)
        self.input_size = input_size
        self.output_size = output_size
        self.input_is_parallel = input_is_parallel
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel=True needs input_is_parallel=True")
        self.input_size_per_partition = divide(input_size, self.tp_size)
        _init_linear_weight(self, config, init_method, output_size, input_size, self.input_size_per_partition,
                            1, stride, keep_master_weight_for_test, is_expert)
        if bias:
            self.bias = _init_bias(self, config, output_size, stride, tensor_parallel=False)
            setattr(self.bias, "sequence_parallel", self.sequence_parallel)
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor):
        """[s, b, h_in/tp] (or full h_in) -> ([s, b, h_out] or [s/tp, b, h_out] with SP, bias)."""
        if self.input_is_parallel:
            input_parallel = input_
        else:
            input_parallel = scatter_to_tensor_model_parallel_region(input_, group=self.tp_group)
        if self._overlap("rs") and self.fp8 is not None:
            sink = add_weight_grad_to_main_grad if self.gradient_accumulation_fusion and self.weight.requires_grad \
                else None
            output_ = fp8_linear_reduce_scatter_overlap(input_parallel, self.weight, self.fp8, self.tp_group, sink)
            return self._add_bias(output_)
        if self._overlap("rs") and self.weight.requires_grad:
            output_ = LinearWithReduceScatterOverlap.apply(input_parallel, self.weight,
                                                           self.gradient_accumulation_fusion, self.tp_group,
                                                           self.tp_comm_transport == "copy-engine")
            return self._add_bias(output_)
        output_parallel = self._linear(input_parallel, self.weight, None, allreduce_dgrad=False,
                                       sequence_parallel=False)
        if self.explicit_expert_comm:
            if not self.skip_bias_add:
                raise ValueError("expert RowParallelLinear with explicit expert communication needs skip_bias_add=True")
            output_ = output_parallel
        elif self.sequence_parallel:
            output_ = reduce_scatter_to_sequence_parallel_region(output_parallel, group=self.tp_group)
        else:
            output_ = reduce_from_tensor_model_parallel_region(output_parallel, group=self.tp_group)
        return self._add_bias(output_)

    def _add_bias(self, output_: torch.Tensor):
        if self.skip_bias_add:
            return output_, self.bias
        output = output_ + self.bias if self.bias is not None else output_
        return output, None

    def __repr__(self):
        return (f"{type(self).__name__}(in_features={self.input_size}, out_features={self.output_size}, "
                f"bias={self.bias is not None}, TP={self.tp_size})")
