"""The local experts of an MoE layer: `GroupedMLP`, `SequentialMLP` and the `TEGroupedMLP` name.

Every expert class takes (rows of the local experts grouped by expert [N, H], rows per local expert [L] (a
host tensor, or a device tensor when the dispatcher needed no host value), their probabilities [N]) and
returns (output [N, H], None). Probabilities are applied inside the expert: `fc2(act(fc1(x)) * p)`, the
product computed in p's dtype and cast back (or `x * p` first with `--moe-apply-probs-on-input`, top-1
only). With gradient-accumulation fusion (the command line's default) and DDP, GroupedMLP's weight
gradients go straight into `main_grad` on CUDA (`grouped_gemm_util.gmm_fused_wgrad`). Weights are split over
the expert-TP group (fc1 column-parallel, fc2 row-parallel) without TP communication: the dispatcher's
gathers and reduce-scatters replace it.

Checkpoint layout (identical for all classes, Megatron's): dist keys `<prefix>experts.linear_fc1.weight` /
`linear_fc2.weight` with a prepended expert axis of global size E (local expert j of EP rank r at r*L + j),
the TP axis split over expert TP (a gated fc1 as the global [all gate; all up]), replica ids carrying the
expert-DP rank, `_extra_state` ShardedObjects per (layer, expert). Plain state dicts keep local indices.
"""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch.nn.parameter import Parameter

from megatron.core import tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory
from megatron.core.fusions import _triton_swiglu
from megatron.core.fusions._compile import CudaCompiled, eager_fusions_requested
from megatron.core.tensor_parallel.layers import _initialize_affine_weight_cpu, _initialize_affine_weight_gpu
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe import grouped_gemm_util as gg
from megatron.core.transformer.moe.moe_utils import (
    ModelCommProcessGroups,
    get_default_model_comm_pgs,
    group_rank,
    group_size,
)
from megatron.core.transformer.sharded import apply_swiglu_sharded_factory
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide


def _weighted_swiglu_forward(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    gate, up = torch.chunk(y, 2, dim=-1)
    return (F.silu(gate) * up * weights).to(y.dtype)


def _weighted_swiglu_backward(grad_output: torch.Tensor, y: torch.Tensor, weights: torch.Tensor):
    gate, up = torch.chunk(y, 2, dim=-1)
    compute = torch.promote_types(y.dtype, weights.dtype)
    gate, up, g = gate.to(compute), up.to(compute), grad_output.to(compute)
    sigmoid = torch.sigmoid(gate)
    silu = gate * sigmoid
    weighted = g * weights.to(compute)
    d_gate = weighted * up * sigmoid * (1 + gate * (1 - sigmoid))
    d_up = weighted * silu
    d_weights = (g * silu * up).sum(dim=-1, keepdim=True)
    return torch.cat([d_gate, d_up], dim=-1).to(y.dtype), d_weights.to(weights.dtype)


# one fused kernel each way on CUDA (the MoE layer itself runs eagerly); eager on CPU
_weighted_swiglu_forward_fused = CudaCompiled(_weighted_swiglu_forward)
_weighted_swiglu_backward_fused = CudaCompiled(_weighted_swiglu_backward)


def _weighted_swiglu_backward_on_device(grad_output: torch.Tensor, y: torch.Tensor, weights: torch.Tensor):
    """The one-pass Triton kernel (`_triton_swiglu.weighted_swiglu_back`) where it applies (CUDA, contiguous,
    not under `--fusion-kernels eager`), else the compiled (CUDA) or eager (CPU) backward."""
    if (_triton_swiglu.weighted_usable(grad_output, y, weights) and not eager_fusions_requested()
            and not torch.compiler.is_compiling()):
        return _triton_swiglu.weighted_swiglu_back(grad_output, y, weights)
    return _weighted_swiglu_backward_fused(grad_output, y, weights)


class WeightedSwiGLU(torch.autograd.Function):
    """`(silu(gate) * up * w).to(y.dtype)` of y = [gate | up]; saves only y and w (the activation is
    recomputed in backward). w [N, 1] may be fp32 with a bf16 y: the product is then taken in fp32."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, weights: torch.Tensor):
        """[N, 2f] x [N, 1] -> [N, f]."""
        ctx.save_for_backward(y, weights)
        return _weighted_swiglu_forward_fused(y, weights)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        """d gate, d up from grad * w; d w = sum(grad * silu(gate) * up)."""
        y, weights = ctx.saved_tensors
        return _weighted_swiglu_backward_on_device(grad_output.contiguous(), y, weights)


def weighted_swiglu(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The weighted SwiGLU of the experts: `silu(gate) * up * w` for y = [gate | up] (see WeightedSwiGLU)."""
    return WeightedSwiGLU.apply(y, weights)


def _apply_probs_on_input(config, hidden_states, probs):
    """`--moe-apply-probs-on-input`: scale the expert input by its probability and use 1 afterwards."""
    if not config.moe_apply_probs_on_input:
        return hidden_states, probs
    if config.moe_router_topk != 1:
        raise ValueError(f"moe_apply_probs_on_input needs moe_router_topk = 1 (got {config.moe_router_topk}).")
    scaled = (probs.unsqueeze(-1) * hidden_states).to(hidden_states.dtype)
    return scaled, torch.ones_like(probs)


def _expert_groups(model_comm_pgs):
    if model_comm_pgs is None:
        model_comm_pgs = get_default_model_comm_pgs()
    return model_comm_pgs


def _edp_rank(groups) -> int:
    return group_rank(getattr(groups, "expt_dp", None))


def _extra_state_object(key, offsets, replica_id):
    """A ShardedObject `key` at the grid position given by `offsets` ((axis, index, size) per grid axis)."""
    ordered = sorted(offsets, key=lambda item: item[0])
    return ShardedObject(key, None, tuple(size for _, _, size in ordered), tuple(i for _, i, _ in ordered), replica_id)


class GroupedMLP(MegatronModule):
    """All local experts in two parameters, computed with grouped GEMMs (`--moe-grouped-gemm`, local spec).

    weight1 [H, L * fc1_out / ETP] (expert j's fc1, transposed: `weight1.view(L, H, -1)[j]`) and weight2
    [L * ffn / ETP, H] (`weight2.view(L, -1, H)[j]`), Megatron's layout. No bias.
    """

    def __init__(self, num_local_experts: int, config: TransformerConfig,
                 model_comm_pgs: Optional[ModelCommProcessGroups] = None):
        super().__init__(config=config)
        self.num_local_experts = num_local_experts
        gg.assert_grouped_gemm_is_available()
        if config.add_bias_linear:
            raise ValueError("GroupedMLP has no bias: use --disable-bias-linear with --moe-grouped-gemm.")
        if config.gated_linear_unit and config.activation_func not in (F.silu, F.gelu):
            raise ValueError("GroupedMLP with a gated linear unit supports only silu (SwiGLU) and gelu.")
        self.expert_parallel = config.expert_model_parallel_size > 1
        self.activation_recompute = (config.recompute_granularity == "selective"
                                     and "moe_act" in config.recompute_modules)
        groups = _expert_groups(model_comm_pgs)
        self.ep_group, self.tp_group, self.dp_group = groups.ep, groups.expt_tp, getattr(groups, "expt_dp", None)
        tp_size, tp_rank = group_size(self.tp_group), group_rank(self.tp_group)
        fc1_output_size = config.moe_ffn_hidden_size * num_local_experts * (2 if config.gated_linear_unit else 1)
        fc2_input_size = config.moe_ffn_hidden_size * num_local_experts
        self._build_weights(fc1_output_size, fc2_input_size, tp_size, tp_rank)
        self.register_load_state_dict_post_hook(_ignore_extra_state_keys)

    def _build_weights(self, fc1_output_size, fc2_input_size, tp_size, tp_rank):
        config = self.config
        hidden = config.hidden_size
        fc1_per_partition, fc2_per_partition = divide(fc1_output_size, tp_size), divide(fc2_input_size, tp_size)
        on_cpu = config.use_cpu_initialization or not torch.cuda.is_available()
        device = torch.device("cpu") if on_cpu else torch.device("cuda", torch.cuda.current_device())
        self.weight1 = Parameter(torch.empty(hidden, fc1_per_partition, device=device, dtype=config.params_dtype))
        self.weight2 = Parameter(torch.empty(fc2_per_partition, hidden, device=device, dtype=config.params_dtype))
        if config.perform_initialization:
            if on_cpu:
                _initialize_affine_weight_cpu(self.weight1, hidden, fc1_output_size, fc1_per_partition, 1,
                                              config.init_method, params_dtype=config.params_dtype,
                                              rank=tp_rank, world_size=tp_size)
                _initialize_affine_weight_cpu(self.weight2, fc2_input_size, hidden, fc2_per_partition, 0,
                                              config.output_layer_init_method, params_dtype=config.params_dtype,
                                              rank=tp_rank, world_size=tp_size)
            else:
                _initialize_affine_weight_gpu(self.weight1, config.init_method, partition_dim=1, is_expert=True)
                _initialize_affine_weight_gpu(self.weight2, config.output_layer_init_method, partition_dim=0,
                                              is_expert=True)
        else:
            tensor_parallel.set_tensor_model_parallel_attributes(self.weight1, True, 1, 1)
            tensor_parallel.set_tensor_model_parallel_attributes(self.weight2, True, 0, 1)
        setattr(self.weight1, "allreduce", not self.expert_parallel)
        setattr(self.weight2, "allreduce", not self.expert_parallel)

    def _activation_with_probs(self, x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        if self.config.gated_linear_unit and self.config.activation_func is F.silu:
            return weighted_swiglu(x, probs)
        if self.config.gated_linear_unit:
            gate, up = torch.chunk(x, 2, dim=-1)
            return (self.config.activation_func(gate) * up * probs).to(x.dtype)
        return (self.config.activation_func(x) * probs).to(x.dtype)

    def _mlp(self, hidden_states, probs, fc1, fc2):
        """fc2(act(fc1(x)) * p), with the activation recomputed in backward under `moe_act` recompute."""
        fc1_output = fc1(hidden_states)
        if self.activation_recompute:
            checkpoint = tensor_parallel.CheckpointWithoutOutput()
            intermediate = checkpoint.checkpoint(self._activation_with_probs, fc1_output, probs)
            output = fc2(intermediate)
            checkpoint.discard_output_and_register_recompute(output)
            return output
        return fc2(self._activation_with_probs(fc1_output, probs))

    def _gmm(self, x, weight, grouped_shape, tokens_per_expert):
        """x [N, K] by expert through weight viewed as grouped_shape [L, K, M]; with gradient-accumulation
        fusion the weight gradient goes straight into `main_grad` (`gg.gmm_fused_wgrad`)."""
        if self.config.gradient_accumulation_fusion and gg.fused_wgrad_supported(x, weight, grouped_shape):
            return gg.gmm_fused_wgrad(x, weight, grouped_shape, tokens_per_expert)
        return gg.ops.gmm(x, weight.view(grouped_shape), tokens_per_expert)

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        """[N, H] rows grouped by local expert -> ([N, H], None)."""
        hidden_states, probs = _apply_probs_on_input(self.config, permuted_local_hidden_states, permuted_probs)
        probs = probs.unsqueeze(-1)  # [N] -> [N, 1]
        hidden = self.config.hidden_size
        if hidden_states.nelement() != 0:
            # [H, L*F1] -> [L, H, F1]; [L*F2, H] -> [L, F2, H]
            shape1 = (self.num_local_experts, hidden, self.weight1.shape[1] // self.num_local_experts)
            shape2 = (self.num_local_experts, self.weight2.shape[0] // self.num_local_experts, hidden)
            output = self._mlp(hidden_states, probs, lambda x: self._gmm(x, self.weight1, shape1, tokens_per_expert),
                               lambda x: self._gmm(x, self.weight2, shape2, tokens_per_expert))
        else:
            # No rows for any local expert: a plain matmul on the empty input still gives every weight a
            # (zero) gradient, so DDP sees gradients of all parameters.
            w1 = self.weight1.view(hidden, -1)
            w2 = self.weight2.view(-1, hidden)
            output = self._mlp(hidden_states, probs, lambda x: torch.matmul(x, w1), lambda x: torch.matmul(x, w2))
        return output, None

    def _glu_pieces(self, key, local_experts_first, sharded_offsets, ep_rank, ep_size, tp_rank, tp_size, replica_id):
        """ShardedTensors of a gated fc1 given as [L, 2f/ETP, H]: the gate half at TP fragment tp_rank and the
        up half at ETP + tp_rank of 2 * ETP fragments."""
        axis = len(sharded_offsets)
        half = local_experts_first.shape[-2] // 2
        gate, up = local_experts_first.narrow(-2, 0, half), local_experts_first.narrow(-2, half, half)
        return [ShardedTensor.from_rank_offsets(key, half, *sharded_offsets, (axis, ep_rank, ep_size),
                                                (axis + 1, rank, tp_size * 2), replica_id=replica_id,
                                                prepend_axis_num=axis)
                for half, rank in ((gate, tp_rank), (up, tp_size + tp_rank))]

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """weight1/weight2 saved per expert in the SequentialMLP layout (transposed views of the parameters, so
        optimizer states map onto them too), plus placeholder `_extra_state` objects, so the dist checkpoint equals
        SequentialMLP's."""
        ep_size, ep_rank = group_size(self.ep_group), group_rank(self.ep_group)
        tp_size, tp_rank = group_size(self.tp_group), group_rank(self.tp_group)
        dp_rank = group_rank(self.dp_group)
        num_local, hidden = self.num_local_experts, self.config.hidden_size
        axis = len(sharded_offsets)
        replica_id = (0, 0, dp_rank)
        with_glu = self.config.gated_linear_unit

        def build(key, data, replica, flattened_range, fc1):
            if flattened_range is not None:
                raise ValueError(f"{key}: GroupedMLP weights cannot be saved from flattened optimizer shards.")
            # fc1 [H, L*F] -> [L, H, F] -> [L, F, H]; fc2 [L*F, H] -> [L, F, H] -> [L, H, F] (views of the weight)
            data = data.detach()
            experts = data.view(num_local, hidden, -1) if fc1 else data.view(num_local, -1, hidden)
            experts = experts.transpose(-1, -2)
            if fc1 and with_glu:
                return self._glu_pieces(key, experts, sharded_offsets, ep_rank, ep_size, tp_rank, tp_size, replica)
            tp_axis = axis + 1 if fc1 else axis + 2
            return ShardedTensor.from_rank_offsets(key, experts, *sharded_offsets, (axis, ep_rank, ep_size),
                                                   (tp_axis, tp_rank, tp_size), replica_id=replica,
                                                   prepend_axis_num=axis)

        def merge(loaded, fc1):
            if isinstance(loaded, list):
                loaded = torch.cat(loaded, dim=-2)
            # inverse of build: fc1 [L, F, H] -> [L, H, F] -> (the memory of) [H, L*F];
            # fc2 [L, H, F] -> [L, F, H] -> [L*F, H]
            restored = loaded.transpose(-1, -2)
            return restored.reshape(hidden, -1) if fc1 else restored.reshape(-1, hidden)

        sharded = {}
        for name, fc1, module_name in (("weight1", True, "linear_fc1"), ("weight2", False, "linear_fc2")):
            tensor = getattr(self, name)
            sharded[f"{prefix}{name}"] = ShardedTensorFactory(
                f"{prefix}experts.{module_name}.weight", tensor,
                lambda k, d, r, f, fc1=fc1: build(k, d, r, f, fc1), lambda x, fc1=fc1: merge(x, fc1), replica_id)
        for local in range(num_local):
            global_index = ep_rank * num_local + local
            offsets = (*sharded_offsets, (axis, global_index, ep_size * num_local))
            for module_name in ("linear_fc1", "linear_fc2"):
                sharded[f"{prefix}expert{global_index}.{module_name}._extra_state"] = _extra_state_object(
                    f"{prefix}experts.{module_name}._extra_state", offsets, (0, tp_rank, dp_rank))
        return sharded


def _ignore_extra_state_keys(module, incompatible_keys):
    """GroupedMLP's dist checkpoint carries `_extra_state` entries (for SequentialMLP compatibility) that the
    module does not have: they are not unexpected."""
    for key in list(incompatible_keys.unexpected_keys):
        if "_extra_state" in key:
            incompatible_keys.unexpected_keys.remove(key)


class TEGroupedMLP(MegatronModule):
    """Transformer Engine's grouped experts (`GroupedLinear`, params `linear_fc1.weight{j}`): needs Transformer
    Engine's MoE path, which is not wired here. Without TE the transformer_engine spec builds GroupedMLP (the
    same distributed-checkpoint layout)."""

    def __init__(self, num_local_experts, config: TransformerConfig, submodules: MLPSubmodules = None,
                 model_comm_pgs: Optional[ModelCommProcessGroups] = None):
        raise ValueError("TEGroupedMLP needs Transformer Engine's grouped linear layers, which this framework does not "
                         "wire for mixture-of-experts yet: use --transformer-impl local (GroupedMLP, the same "
                         "checkpoint layout).")


class SequentialMLP(MegatronModule):
    """The local experts as a list of MLPs (`local_experts.{j}`, j the local index), run one after another."""

    def __init__(self, num_local_experts, config: TransformerConfig, submodules: MLPSubmodules,
                 model_comm_pgs: Optional[ModelCommProcessGroups] = None):
        super().__init__(config=config)
        self.add_bias = config.add_bias_linear
        self.num_local_experts = num_local_experts
        groups = _expert_groups(model_comm_pgs)
        self.ep_group, self.tp_group, self.dp_group = groups.ep, groups.expt_tp, getattr(groups, "expt_dp", None)
        self.local_experts = torch.nn.ModuleList([
            MLP(config, submodules, ffn_hidden_size=config.moe_ffn_hidden_size, is_expert=True, tp_group=self.tp_group)
            for _ in range(num_local_experts)
        ])

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        """[N, H] rows grouped by local expert -> ([N, H], bias rows or None)."""
        hidden_states, probs = _apply_probs_on_input(self.config, permuted_local_hidden_states, permuted_probs)
        if self.num_local_experts == 1:
            return self.local_experts[0](hidden_states, probs)
        sizes = tokens_per_expert.tolist() if torch.is_tensor(tokens_per_expert) else list(tokens_per_expert)
        outputs, biases = [], []
        for expert, tokens, token_probs in zip(self.local_experts, torch.split(hidden_states, sizes),
                                               torch.split(probs, sizes)):
            output, bias = expert(tokens, token_probs)
            outputs.append(output)
            if self.add_bias:
                biases.append(bias.expand_as(output))
        return torch.cat(outputs, dim=0), (torch.cat(biases, dim=0) if self.add_bias else None)

    def _expert_sharded(self, expert, local_prefix, sharded_prefix, offsets, tp_rank, tp_size, dp_rank):
        """One expert's linears as ShardedTensors over expert TP (keys without the expert index)."""
        sharded = {}
        axis = len(offsets)
        for name, tp_axis in (("linear_fc1", 0), ("linear_fc2", 1)):
            linear = getattr(expert, name)
            for param_name, value in linear.state_dict(prefix="", keep_vars=True).items():
                dict_key, key = f"{local_prefix}{name}.{param_name}", f"{sharded_prefix}{name}.{param_name}"
                if param_name.endswith("_extra_state"):
                    sharded[dict_key] = _extra_state_object(key, offsets, (0, tp_rank, dp_rank))
                    sharded[dict_key].data = value
                    continue
                split = param_name == "weight" or (param_name == "bias" and tp_axis == 0)
                tp_offsets = ((axis + (tp_axis if param_name == "weight" else 0), tp_rank, tp_size),) if split else ()
                shard = ShardedTensor.from_rank_offsets(key, value, *offsets, *tp_offsets,
                                                        replica_id=(0, 0 if split else tp_rank, dp_rank),
                                                        prepend_axis_num=axis)
                if name == "linear_fc1" and self.config.gated_linear_unit:
                    shard = apply_swiglu_sharded_factory(shard, offsets)
                sharded[dict_key] = shard
        return sharded

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """Each local expert under the dist keys `<prefix>experts.*`, at its global index on the expert axis."""
        ep_size, ep_rank = group_size(self.ep_group), group_rank(self.ep_group)
        tp_size, tp_rank = group_size(self.tp_group), group_rank(self.tp_group)
        dp_rank = group_rank(self.dp_group)
        num_global = ep_size * self.num_local_experts
        sharded = {}
        for local, expert in enumerate(self.local_experts):
            offsets = (*sharded_offsets, (len(sharded_offsets), ep_rank * self.num_local_experts + local, num_global))
            sharded.update(self._expert_sharded(expert, f"{prefix}local_experts.{local}.", f"{prefix}experts.",
                                                offsets, tp_rank, tp_size, dp_rank))
        return sharded


__all__ = ["GroupedMLP", "TEGroupedMLP", "SequentialMLP", "WeightedSwiGLU", "weighted_swiglu"]
