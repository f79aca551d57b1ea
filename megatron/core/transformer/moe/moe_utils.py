"""Routing math, token permutation and auxiliary-loss bookkeeping of Megatron Core's mixture of experts.

What this module owns (Megatron Core 0.13.1's `moe_utils` names and signatures):
- load-balancing losses (`switch_load_balancing_loss_func`, `sequence_load_balancing_loss_func`,
  `z_loss_func`, `sinkhorn`) and `MoEAuxLossAutoScaler`, which gives an auxiliary loss the main loss's
  backward scale;
- top-k routing with capacity (`topk_softmax_with_capacity`, `group_limited_topk`, `get_capacity`);
- token permutation (`permute`, `unpermute`, `sort_chunks_by_idxs`);
- the per-layer loss tracker read by the training log (`save_to_aux_losses_tracker`,
  `reduce_aux_losses_tracker_across_ranks`, `track_moe_metrics`, ...) and the aux-loss-free expert bias
  update (`get_updated_expert_bias`).

Design note (no host syncs in the permutation): `permute` takes the number of routed rows from the caller
(`num_out_tokens`, known on the host: `T * k` when dropless) and finds the rows with `torch.nonzero_static`,
so it never waits for the GPU; only without `num_out_tokens` does it fall back to a data-dependent
`masked_select` (what Megatron's unfused path always does). `sort_chunks_by_idxs` turns the host-side
chunk sizes into one gather index instead of a split/cat per chunk.

Design note (fused kernels): `fused=True` (`--moe-permute-fusion`) names Transformer Engine's permutation
kernels; the native permutation computes the same result and is used either way.
"""
import math
from typing import Dict, List, Optional, Union

import torch

from megatron.core import parallel_state
from megatron.core.pipeline_parallel.utils import register_aux_loss_scale_setter
from megatron.core.process_groups_config import ModelCommProcessGroups, get_pg_rank, get_pg_size
from megatron.core.tensor_parallel.mappings import all_reduce_tensor, gather_from_sequence_parallel_region


# ---------------------------------------------------------------------------------------------------------
# Load-balancing losses
# ---------------------------------------------------------------------------------------------------------
def switch_load_balancing_loss_func(
    probs: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    topk: int,
    moe_aux_loss_coeff: float,
    sequence_partition_group=None,
) -> torch.Tensor:
    """GShard/Switch auxiliary loss `E * coeff * sum_e f_e * P_e` of one rank's tokens.

    probs [T, E] are the router scores of the local tokens, tokens_per_expert [E] their top-k counts. With
    `sequence_partition_group` (TP x CP when the sequence is split) the counts are summed over the group (in
    place) and T becomes the full sequence's token count; the local probability sums stay local, so the
    per-rank losses add up to the loss of the whole sequence.
    """
    num_sub_sequence = 1
    if sequence_partition_group is not None:
        num_sub_sequence = get_pg_size(sequence_partition_group)
        all_reduce_tensor(tokens_per_expert, sequence_partition_group)
    num_tokens = probs.shape[0] * num_sub_sequence
    num_experts = probs.shape[1]
    aggregated_probs_per_expert = probs.sum(dim=0)
    # sum_e (sum_t P[t, e] / T) * (c_e / (T k)) * E * coeff, with the divisions folded into one factor
    return torch.sum(aggregated_probs_per_expert * tokens_per_expert) * (
        num_experts * moe_aux_loss_coeff / (num_tokens * num_tokens * topk)
    )


def sequence_load_balancing_loss_func(
    probs: torch.Tensor,
    routing_map: torch.Tensor,
    batch_size: int,
    seq_length: int,
    topk: int,
    moe_aux_loss_coeff: float,
    sequence_partition_group=None,
) -> torch.Tensor:
    """DeepSeek-V2 sequence-level auxiliary loss: the Switch loss of every sample, averaged over the batch.

    probs and routing_map are [s * b, E] in sequence-major token order. With `sequence_partition_group` the
    probabilities are all-gathered along the sequence (with gradient) while the counts stay local.
    """
    num_experts = probs.shape[1]
    # [s*b, E] -> [s, b, E]
    probs_for_aux_loss = probs.view(seq_length, batch_size, -1)
    routing_map = routing_map.view(seq_length, batch_size, -1)
    if sequence_partition_group is not None:
        seq_length *= get_pg_size(sequence_partition_group)
        probs_for_aux_loss = gather_from_sequence_parallel_region(probs_for_aux_loss, group=sequence_partition_group)
    # [s, b, E] -> [b, E]: count of each sample's tokens per expert over the expected count s*k/E
    cost_coeff = routing_map.sum(dim=0, dtype=torch.float).div_(seq_length * topk / num_experts)
    seq_aux_loss = (cost_coeff * probs_for_aux_loss.mean(dim=0)).sum(dim=1).mean()
    return seq_aux_loss * moe_aux_loss_coeff


def z_loss_func(logits: torch.Tensor, z_loss_coeff: float) -> torch.Tensor:
    """ST-MoE router z-loss: `coeff * mean_t(logsumexp_e(logits[t])^2)`."""
    return torch.mean(torch.square(torch.logsumexp(logits, dim=-1))) * z_loss_coeff


def sinkhorn(cost: torch.Tensor, tol: float = 0.0001) -> torch.Tensor:
    """Sinkhorn normalisation of exp(cost) [T, E] until the expert scaling moves less than `tol` on average.

    The stopping test reads the error on the host once per iteration (the algorithm needs that decision).
    """
    cost = torch.exp(cost)
    d0 = torch.ones(cost.size(0), device=cost.device, dtype=cost.dtype)
    d1 = torch.ones(cost.size(1), device=cost.device, dtype=cost.dtype)
    eps = 0.00000001
    error = 1e9
    d1_old = d1
    while error > tol:
        d0 = (1 / d0.size(0)) * 1 / (torch.sum(d1 * cost, 1) + eps)
        d1 = (1 / d1.size(0)) * 1 / (torch.sum(d0.unsqueeze(1) * cost, 0) + eps)
        error = torch.mean(torch.abs(d1_old - d1))
        d1_old = d1
    return d1 * cost * d0.unsqueeze(1)


def get_capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity=None) -> int:
    """Rows each expert accepts: `ceil(num_tokens / num_experts * capacity_factor)` (at least min_capacity)."""
    capacity = math.ceil((num_tokens / num_experts) * capacity_factor)
    if min_capacity is not None and capacity < min_capacity:
        capacity = min_capacity
    return capacity


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """Attach an auxiliary loss to an activation: identity forward; backward adds the loss's gradient.

    `y = MoEAuxLossAutoScaler.apply(x, aux_loss)` returns x; in backward, aux_loss receives the gradient
    `main_loss_backward_scale` (what the schedule scales the main loss by: 1/num_microbatches, times the
    fp16 loss scale), so the loss enters the objective exactly like the main loss does.
    """

    main_loss_backward_scale: Optional[torch.Tensor] = None

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor):
        """Keep aux_loss for the backward; return `output` unchanged."""
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        """Pass grad_output through; give aux_loss the gradient `main_loss_backward_scale`."""
        (aux_loss,) = ctx.saved_tensors
        if MoEAuxLossAutoScaler.main_loss_backward_scale is None:
            MoEAuxLossAutoScaler.main_loss_backward_scale = torch.tensor(1.0, device=aux_loss.device)
        scaled_aux_loss_grad = torch.ones_like(aux_loss) * MoEAuxLossAutoScaler.main_loss_backward_scale
        return grad_output, scaled_aux_loss_grad

    @staticmethod
    def set_loss_scale(scale: torch.Tensor):
        """Set the backward scale of every attached auxiliary loss (the main loss's scale)."""
        current = MoEAuxLossAutoScaler.main_loss_backward_scale
        if current is None or current.shape != scale.shape or current.device != scale.device:
            # a tensor of its own, updated in place from now on (a CUDA-graphed backward reads its memory)
            MoEAuxLossAutoScaler.main_loss_backward_scale = scale.detach().clone()
        else:
            current.copy_(scale)


def _set_aux_loss_scale_from_schedule(config, scale: torch.Tensor) -> None:
    """The schedule's hook (`pipeline_parallel.utils`): after each forward step of an MoE model."""
    if getattr(config, "num_moe_experts", None) is not None:
        MoEAuxLossAutoScaler.set_loss_scale(scale)


register_aux_loss_scale_setter(_set_aux_loss_scale_from_schedule)


# ---------------------------------------------------------------------------------------------------------
# Top-k routing
# ---------------------------------------------------------------------------------------------------------
def group_limited_topk(
    scores: torch.Tensor, topk: int, num_tokens: int, num_experts: int, num_groups: int, group_topk: int
):
    """Top-k restricted to the `group_topk` best of `num_groups` expert groups (DeepSeek device/node limit).

    A group's score is the sum of its `topk // group_topk` largest scores; experts of unselected groups are
    set to -inf before the final top-k. Returns (probs [T, k], indices [T, k]).
    """
    # [T, E] -> [T, G, E/G] -> top (k / group_topk) per group, summed -> [T, G]
    group_scores = scores.view(num_tokens, num_groups, -1).topk(topk // group_topk, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    # [T, G] -> [T, G, E/G] -> [T, E]
    score_mask = group_mask.unsqueeze(-1).expand(num_tokens, num_groups, num_experts // num_groups)
    score_mask = score_mask.reshape(num_tokens, -1)
    masked_scores = scores.masked_fill(~score_mask.bool(), float("-inf"))
    return torch.topk(masked_scores, k=topk, dim=-1)


def pad_routing_map(routing_map: torch.Tensor, pad_multiple: int) -> torch.Tensor:
    """Route extra (zero-probability) tokens to each expert until its count is a multiple of pad_multiple;
    the first unrouted tokens of each expert are taken."""
    # [T, E] -> [E, T]
    routing_map = routing_map.transpose(0, 1)
    num_to_pad = (-routing_map.sum(dim=1)) % pad_multiple
    zero_ranks = torch.cumsum((routing_map == 0).int(), dim=1)
    mask = (routing_map == 0) & (zero_ranks <= num_to_pad.unsqueeze(1))
    routing_map = routing_map | mask if routing_map.dtype == torch.bool else routing_map.masked_fill(mask, 1)
    # [E, T] -> [T, E]
    return routing_map.transpose(0, 1)


def _topk_scores(logits, topk, use_pre_softmax, score_function, expert_bias, compute_topk):
    """(probs [T, k], indices [T, k]) of one score function (Megatron's table, §1.2)."""
    if score_function == "softmax":
        if use_pre_softmax:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
            return compute_topk(scores, topk)
        scores, top_indices = compute_topk(logits, topk)
        return torch.softmax(scores, dim=-1, dtype=torch.float32).type_as(logits), top_indices
    if score_function == "sigmoid":
        scores = torch.sigmoid(logits.float()).type_as(logits)
        if expert_bias is not None:
            _, top_indices = compute_topk(scores + expert_bias, topk)
            scores = torch.gather(scores, dim=1, index=top_indices).type_as(logits)
        else:
            scores, top_indices = compute_topk(scores, topk)
        probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20) if topk > 1 else scores
        return probs, top_indices
    raise ValueError(f"moe_router_score_function ({score_function!r}) must be 'softmax' or 'sigmoid'.")


def topk_softmax_with_capacity(
    logits: torch.Tensor,
    topk: int,
    capacity_factor: Optional[float] = None,
    pad_to_capacity: bool = False,
    drop_policy: str = "probs",
    use_pre_softmax: bool = False,
    num_groups: Optional[int] = None,
    group_topk: Optional[int] = None,
    scaling_factor: Optional[float] = None,
    deterministic_mode: bool = False,
    score_function: str = "softmax",
    expert_bias: Optional[torch.Tensor] = None,
):
    """Top-k routing of logits [T, E], with optional per-expert capacity (token dropping / padding).

    Returns (probs [T, E] with the gate values in the chosen columns, routing_map [T, E] bool, tokens_per_expert
    [E] counted before dropping). With a capacity factor each expert keeps at most
    `ceil(T * k / E * factor)` rows: the largest gates (`drop_policy='probs'`) or, by torch.topk over the 0/1
    map, the earliest tokens (`'position'`); `pad_to_capacity` fills every expert up to its capacity with
    unrouted tokens of probability 0. `deterministic_mode` is accepted and unused (as in Megatron).
    """
    if logits.dim() != 2:
        raise ValueError(f"topk_softmax_with_capacity expects 2-D logits [num_tokens, num_experts], got {logits.dim()}-D.")
    num_tokens, num_experts = logits.shape

    def compute_topk(scores, k):
        if group_topk:
            return group_limited_topk(scores, k, num_tokens, num_experts, num_groups, group_topk)
        return torch.topk(scores, k=k, dim=1)

    probs, top_indices = _topk_scores(logits, topk, use_pre_softmax, score_function, expert_bias, compute_topk)
    if scaling_factor:
        probs = probs * scaling_factor
    # [T, k] scattered into [T, E]
    topk_masked_gates = torch.zeros_like(logits).scatter(1, top_indices, probs)
    topk_map = torch.zeros_like(logits).int().scatter(1, top_indices, 1).bool()
    tokens_per_expert = topk_map.sum(dim=0)
    if capacity_factor is None:
        return topk_masked_gates, topk_map, tokens_per_expert
    expert_capacity = get_capacity(num_tokens=num_tokens * topk, num_experts=num_experts,
                                   capacity_factor=capacity_factor)
    if drop_policy == "probs":
        _, capacity_indices = torch.topk(topk_masked_gates, k=expert_capacity, dim=0, sorted=False)
    elif drop_policy == "position":
        _, capacity_indices = torch.topk(topk_map.int(), k=expert_capacity, dim=0, sorted=False)
    else:
        raise ValueError(f"moe_token_drop_policy ({drop_policy!r}) must be 'probs' or 'position'.")
    capacity_mask = torch.zeros_like(logits).scatter(0, capacity_indices, 1).bool()
    final_map = capacity_mask if pad_to_capacity else torch.logical_and(topk_map, capacity_mask)
    return topk_masked_gates * final_map, final_map, tokens_per_expert


# ---------------------------------------------------------------------------------------------------------
# Token permutation
# ---------------------------------------------------------------------------------------------------------
def _expert_major_routes(routing_map: torch.Tensor, num_out_tokens: Optional[int]):
    """(expert ids, token ids) of every route, expert-major and in token order inside an expert."""
    num_tokens, num_experts = routing_map.shape
    # [T, E] -> [E, T]
    expert_major = routing_map.bool().T.contiguous()
    if num_out_tokens is None:
        token_ids = torch.arange(num_tokens, device=routing_map.device).unsqueeze(0).expand_as(expert_major)
        expert_ids = torch.arange(num_experts, device=routing_map.device).unsqueeze(1).expand_as(expert_major)
        return expert_ids.masked_select(expert_major), token_ids.masked_select(expert_major)
    # (e, t) pairs in row-major order, found without reading their number back from the device
    pairs = torch.nonzero_static(expert_major, size=int(num_out_tokens))
    return pairs[:, 0].contiguous(), pairs[:, 1].contiguous()


def _host_index_to(index: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host index tensor on `device`; a CUDA copy goes through pinned memory (a pageable copy would make the
    host wait for the GPU)."""
    if device.type == "cuda":
        return index.pin_memory().to(device, non_blocking=True)
    return index


def permute(
    tokens: torch.Tensor,
    routing_map: torch.Tensor,
    probs: Optional[torch.Tensor] = None,
    num_out_tokens: Optional[int] = None,
    fused: bool = False,
    drop_and_pad: bool = False,
):
    """Group the rows of tokens [T, H] by expert: returns (permuted [N, H], permuted probs [N] or None,
    sorted_indices [N]).

    Expert-major order, token order inside an expert. `num_out_tokens` is N (the routed rows; with
    drop_and_pad, E * capacity and every expert has exactly `capacity` rows).
    """
    num_tokens = tokens.shape[0]
    num_experts = routing_map.shape[1]
    permuted_probs = None
    if drop_and_pad and num_out_tokens is not None:
        capacity = int(num_out_tokens) // num_experts
        # [T, E] -> [E, T]; a stable descending argsort puts the routed tokens of each expert first, in order
        expert_major = routing_map.to(dtype=torch.int8).T.contiguous()
        sorted_indices = expert_major.argsort(dim=-1, descending=True, stable=True)[:, :capacity].contiguous()
        if probs is not None:
            # [T, E] -> [E*T]; row e*T + t of the flattened transpose is probs[t, e]
            flat_index = torch.arange(num_experts, device=routing_map.device).unsqueeze(-1) * num_tokens + sorted_indices
            permuted_probs = probs.T.contiguous().view(-1).index_select(0, flat_index.view(-1))
        # [E, capacity] -> [E*capacity]
        sorted_indices = sorted_indices.view(-1)
    else:
        expert_ids, sorted_indices = _expert_major_routes(routing_map, num_out_tokens)
        if probs is not None:
            permuted_probs = probs[sorted_indices, expert_ids]
    return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices


def unpermute(
    permuted_tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    restore_shape: torch.Size,
    probs: torch.Tensor = None,
    routing_map: torch.Tensor = None,
    fused: bool = False,
    drop_and_pad: bool = False,
):
    """Inverse of `permute`: scatter-add the rows back to [T, H] (summing a token's k expert outputs).

    With probs [T, E] (and its routing_map) the rows are first weighted by their gate value; no dispatcher
    does that (the experts apply the probabilities). The result has the input's dtype.
    """
    _, hidden = restore_shape
    input_dtype = permuted_tokens.dtype
    if probs is not None:
        if routing_map is None:
            raise ValueError("unpermute with probs needs the routing_map that selected them.")
        if drop_and_pad:
            num_experts = routing_map.size(1)
            capacity = sorted_indices.size(0) // num_experts
            flat_index = (torch.arange(num_experts, device=routing_map.device).unsqueeze(-1) * probs.size(0)
                          + sorted_indices.view(num_experts, capacity))
            permuted_probs = probs.T.contiguous().view(-1).index_select(0, flat_index.view(-1))
        else:
            permuted_probs = probs.T.contiguous().masked_select(routing_map.T.contiguous())
        permuted_tokens = permuted_tokens * permuted_probs.unsqueeze(-1)
    output_tokens = torch.zeros(restore_shape, dtype=permuted_tokens.dtype, device=permuted_tokens.device)
    output_tokens.scatter_add_(0, sorted_indices.unsqueeze(1).expand(-1, hidden), permuted_tokens)
    return output_tokens.to(dtype=input_dtype)


def _chunk_gather_index(split_sizes: torch.Tensor, sorted_idxs: torch.Tensor) -> torch.Tensor:
    """Row index that concatenates the chunks (sizes `split_sizes`) in the order `sorted_idxs` (host tensors)."""
    sizes = split_sizes.to(device="cpu", dtype=torch.long)
    order = sorted_idxs.to(device="cpu", dtype=torch.long)
    starts = torch.cumsum(sizes, 0) - sizes
    sorted_sizes = sizes[order]
    out_starts = torch.cumsum(sorted_sizes, 0) - sorted_sizes
    total = int(sorted_sizes.sum())
    # row i of the output is row (i - out_start of its chunk + start of its chunk) of the input
    shift = torch.repeat_interleave(starts[order] - out_starts, sorted_sizes, output_size=total)
    return torch.arange(total) + shift


def sort_chunks_by_idxs(
    input: torch.Tensor,
    split_sizes: torch.Tensor,
    sorted_idxs: torch.Tensor,
    probs: Optional[torch.Tensor] = None,
    fused: bool = False,
):
    """Split input (and probs) into chunks of `split_sizes` rows and concatenate them in `sorted_idxs` order."""
    index = _host_index_to(_chunk_gather_index(split_sizes, sorted_idxs), input.device)
    output = input.index_select(0, index)
    permuted_probs = probs.index_select(0, index) if probs is not None else None
    return output, permuted_probs


class _TopkPermutation:
    """Where every route of a top-k routing goes, when every token has exactly k routes (dropless top-k):
    `sorted_indices` [N] the token of each permuted row (expert-major, as `permute`), `inverse` [T*k] the
    permuted rows of token 0, then token 1, ... (each token's k rows in expert order). Both directions of the
    permutation are then gathers, with no scatter-add (atomics) in the forward or the backward."""

    def __init__(self, sorted_indices: torch.Tensor, num_tokens: int, topk: int):
        self.sorted_indices = sorted_indices
        self.num_tokens, self.topk = num_tokens, topk
        # rows sorted by their token (stable: expert order within a token)
        self.inverse = torch.argsort(sorted_indices, stable=True)

    def sum_per_token(self, rows: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [T, H]: each token's k rows summed (accumulated in fp32, rounded once)."""
        # [N, H] -> [T*k, H] -> [T, k, H] -> [T, H]
        gathered = rows.index_select(0, self.inverse).view(self.num_tokens, self.topk, rows.shape[-1])
        return gathered.sum(dim=1, dtype=torch.float32).to(rows.dtype) if self.topk > 1 else gathered[:, 0]


class _GatherPermute(torch.autograd.Function):
    """tokens [T, H] -> their routed rows [N, H]; backward sums each token's k row gradients."""

    @staticmethod
    def forward(ctx, tokens, mapping):
        ctx.mapping = mapping
        return tokens.index_select(0, mapping.sorted_indices)

    @staticmethod
    def backward(ctx, grad_rows):
        return ctx.mapping.sum_per_token(grad_rows), None


class _GatherUnpermute(torch.autograd.Function):
    """routed rows [N, H] -> [T, H], each token's k rows summed; backward gathers the token gradient."""

    @staticmethod
    def forward(ctx, rows, mapping):
        ctx.mapping = mapping
        return mapping.sum_per_token(rows)

    @staticmethod
    def backward(ctx, grad_tokens):
        return grad_tokens.index_select(0, ctx.mapping.sorted_indices), None


def permute_topk(tokens: torch.Tensor, routing_map: torch.Tensor, topk: int, probs: Optional[torch.Tensor] = None):
    """`permute` for a routing map with exactly `topk` routes per token (dropless top-k); returns (permuted
    [T*k, H], permuted probs [T*k] or None, the mapping for `unpermute_topk`). Same rows and order as `permute`;
    the gradients are gathers instead of scatter-adds."""
    num_tokens = tokens.shape[0]
    expert_ids, sorted_indices = _expert_major_routes(routing_map, num_tokens * topk)
    mapping = _TopkPermutation(sorted_indices, num_tokens, topk)
    permuted_probs = probs[sorted_indices, expert_ids] if probs is not None else None
    return _GatherPermute.apply(tokens, mapping), permuted_probs, mapping


def unpermute_topk(permuted_tokens: torch.Tensor, mapping: _TopkPermutation) -> torch.Tensor:
    """Inverse of `permute_topk`: [T*k, H] -> [T, H], each token's k rows summed."""
    return _GatherUnpermute.apply(permuted_tokens, mapping)


# ---------------------------------------------------------------------------------------------------------
# Auxiliary-loss tracking (read by the training log)
# ---------------------------------------------------------------------------------------------------------
def get_moe_layer_wise_logging_tracker() -> Dict[str, dict]:
    """The per-layer auxiliary-loss tracker: {name: {'values': [num_layers], 'reduce_group', 'avg_group'}}."""
    return parallel_state.get_moe_layer_wise_logging_tracker()


def save_to_aux_losses_tracker(
    name: str, loss: torch.Tensor, layer_number: int, num_layers: int, reduce_group=None, avg_group=None
):
    """Add `loss` (detached) to the tracker entry `name` at index layer_number - 1; values accumulate over
    microbatches. `reduce_group` is summed over and `avg_group` averaged over when the tracker is reduced.
    Nothing is recorded for a layer without a layer number."""
    if layer_number is None:
        return
    tracker = get_moe_layer_wise_logging_tracker()
    if name not in tracker:
        tracker[name] = {"values": torch.zeros(num_layers, device=loss.device)}
    tracker[name]["values"][layer_number - 1] += loss.detach()
    tracker[name]["reduce_group"] = reduce_group
    tracker[name]["avg_group"] = avg_group


def clear_aux_losses_tracker():
    """Zero every tracked value and forget the reduction groups."""
    tracker = get_moe_layer_wise_logging_tracker()
    for name in tracker:
        tracker[name]["values"].zero_()
        tracker[name]["reduce_group"] = None
        tracker[name]["avg_group"] = None


def reduce_aux_losses_tracker_across_ranks(track_names: Optional[List[str]] = None):
    """Sum the tracked values over the pipeline group, then over each entry's reduce group, then average
    them over its avg group (a sum divided by the group size: gloo has no AVG)."""
    tracker = get_moe_layer_wise_logging_tracker()
    if track_names is None:
        track_names = list(tracker.keys())
    for name in track_names:
        values = tracker[name]["values"]
        all_reduce_tensor(values, parallel_state.get_pipeline_model_parallel_group(check_initialized=False))
        if tracker[name].get("reduce_group") is not None:
            all_reduce_tensor(values, tracker[name]["reduce_group"])
        if tracker[name].get("avg_group") is not None:
            all_reduce_tensor(values, tracker[name]["avg_group"])
            values.div_(get_pg_size(tracker[name]["avg_group"]))


def _num_moe_layers(num_layers, moe_layer_freq, mtp_num_layers) -> int:
    if moe_layer_freq is None:
        count = num_layers
    elif isinstance(moe_layer_freq, int):
        if not isinstance(num_layers, int):
            raise ValueError(f"track_moe_metrics: an int moe_layer_freq ({moe_layer_freq}) needs num_layers.")
        count = sum(1 for i in range(num_layers) if i % moe_layer_freq == 0)
    elif isinstance(moe_layer_freq, list):
        count = sum(moe_layer_freq)
    else:
        raise ValueError(f"moe_layer_freq ({moe_layer_freq!r}) must be an int or a list of 0/1 per layer.")
    return count + (mtp_num_layers or 0)


def _tracker_device(tracker) -> torch.device:
    for entry in tracker.values():
        return entry["values"].device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _write_moe_metrics(writer, wandb_writer, iteration, name, loss_list, num_moe_layers, per_layer_logging):
    value = loss_list.sum() / num_moe_layers
    writer.add_scalar(name, value, iteration)
    per_layer = loss_list.tolist() if per_layer_logging else []
    for i, loss in enumerate(per_layer):
        writer.add_scalar(f"moe/{name}_layer_{i}", loss, iteration)
    if wandb_writer:
        wandb_writer.log({f"{name}": value}, iteration)
        if per_layer_logging:
            wandb_writer.log({f"moe/{name}_layer_{i}": loss for i, loss in enumerate(per_layer)}, iteration)


def track_moe_metrics(
    loss_scale: float,
    iteration: int,
    writer,
    wandb_writer=None,
    total_loss_dict=None,
    per_layer_logging=False,
    force_initialize: bool = False,
    track_names: Optional[List[str]] = None,
    num_layers: Optional[int] = None,
    moe_layer_freq: Optional[Union[int, List[int]]] = None,
    mtp_num_layers: Optional[int] = None,
):
    """Reduce the tracked auxiliary losses of this iteration, log them and clear the tracker.

    Every tracked name is reduced (`reduce_aux_losses_tracker_across_ranks`; `force_initialize` first creates
    zero entries for `track_names`, so ranks without MoE layers join the collectives). When a writer exists
    (Megatron 0.13.1: only then), each name's value `sum over layers * loss_scale / num MoE layers` is written
    as a scalar (and per layer as `moe/{name}_layer_{i}` with `per_layer_logging`), sent to wandb, and added
    to `total_loss_dict[name]`. The number of MoE layers counts `moe_layer_freq`'s MoE layers plus the MTP
    layers.
    """
    tracker = get_moe_layer_wise_logging_tracker()
    if force_initialize and track_names is not None:
        device = _tracker_device(tracker)
        for key in track_names:
            if key not in tracker:
                tracker[key] = {"values": torch.zeros(num_layers, device=device), "reduce_group": None,
                                "avg_group": None}
    reduce_aux_losses_tracker_across_ranks(track_names)
    num_moe_layers = _num_moe_layers(num_layers, moe_layer_freq, mtp_num_layers)
    if writer is not None:
        aux_losses = {name: entry["values"].float() * loss_scale for name, entry in tracker.items()}
        for name, loss_list in aux_losses.items():
            if total_loss_dict is not None:
                if name not in total_loss_dict:
                    total_loss_dict[name] = loss_list.sum() / num_moe_layers
                else:
                    total_loss_dict[name] += loss_list.sum() / num_moe_layers
            _write_moe_metrics(writer, wandb_writer, iteration, name, loss_list, num_moe_layers, per_layer_logging)
    clear_aux_losses_tracker()


def get_updated_expert_bias(tokens_per_expert, expert_bias, expert_bias_update_rate):
    """Aux-loss-free balancing step: counts summed over TP x CP x DP (in place), then every expert's bias
    moves by `rate * sign(mean count - its count)` (https://arxiv.org/abs/2408.15664)."""
    with torch.no_grad():
        all_reduce_tensor(tokens_per_expert,
                          parallel_state.get_tensor_and_data_parallel_group(check_initialized=False,
                                                                            with_context_parallel=True))
        average_tokens = tokens_per_expert.sum(dim=-1, keepdim=True) / tokens_per_expert.shape[-1]
        offset = average_tokens - tokens_per_expert
        return expert_bias + torch.sign(offset) * expert_bias_update_rate


# ---------------------------------------------------------------------------------------------------------
# Router helpers
# ---------------------------------------------------------------------------------------------------------
def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
    """A CUDA tensor copied to the host (non-blocking; optionally as numpy); anything else unchanged."""
    if torch.is_tensor(tensor) and tensor.is_cuda:
        cpu_tensor = tensor.to(torch.device("cpu"), non_blocking=True)
        if as_numpy:
            cpu_tensor = cpu_tensor.numpy()
        if record_stream:
            tensor.record_stream(torch.cuda.current_stream())
        tensor = cpu_tensor
    return tensor


class RandomSTE(torch.autograd.Function):
    """Random N(0, 1) logits (seed 42 + global rank) with a straight-through gradient (benchmarking only)."""

    generator = None

    @staticmethod
    def forward(ctx, logits):
        """Logits replaced by draws of this rank's generator."""
        if RandomSTE.generator is None:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            RandomSTE.generator = torch.Generator(device=logits.device)
            RandomSTE.generator.manual_seed(42 + rank)
        return logits.clone().normal_(generator=RandomSTE.generator)

    @staticmethod
    def backward(ctx, grad_output):
        """The gradient passes through unchanged."""
        return grad_output


def apply_random_logits(logits):
    """`--moe-router-force-load-balancing`: random logits with a straight-through gradient."""
    return RandomSTE.apply(logits)


class RouterGatingLinearFunction(torch.autograd.Function):
    """`logits = x W^T` computed in `router_dtype`; gradients are returned in the input's and weight's dtypes
    (so only the bf16 operands are saved, not fp32 copies)."""

    @staticmethod
    def forward(ctx, inp: torch.Tensor, weight: torch.Tensor, router_dtype: torch.dtype):
        """[..., H] x [E, H] -> [..., E] in router_dtype."""
        ctx.save_for_backward(inp, weight)
        ctx.router_dtype = router_dtype
        ctx.input_dtype = inp.dtype
        ctx.weight_dtype = weight.dtype
        inp_shape = inp.shape
        # [..., H] -> [N, H]
        inp = inp.reshape(-1, inp_shape[-1])
        output = torch.mm(inp.to(router_dtype), weight.to(router_dtype).t())
        # [N, E] -> [..., E]
        return output.view(*inp_shape[:-1], -1)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        """dX = dY W, dW = dY^T X in router_dtype, cast back."""
        inp, weight = ctx.saved_tensors
        inp_shape = inp.shape
        # [..., H] -> [N, H]; [..., E] -> [N, E]
        inp = inp.reshape(-1, inp_shape[-1])
        grad_output = grad_output.reshape(-1, grad_output.shape[-1])
        grad_input = torch.mm(grad_output, weight.to(ctx.router_dtype)).to(ctx.input_dtype)
        grad_weight = torch.mm(grad_output.t(), inp.to(ctx.router_dtype)).to(ctx.weight_dtype)
        # [N, H] -> [..., H]
        return grad_input.view(*inp_shape), grad_weight, None


def router_gating_linear(inp: torch.Tensor, weight: torch.Tensor, router_dtype: torch.dtype):
    """The router's gate `x W^T` with logits in `router_dtype` (see `RouterGatingLinearFunction`)."""
    return RouterGatingLinearFunction.apply(inp, weight, router_dtype)


def get_default_model_comm_pgs() -> ModelCommProcessGroups:
    """The MoE process groups from parallel_state: ep, tp, cp, expt_tp, expt_dp, tp_ep, tp_cp (None where a
    group does not exist, which means size 1)."""
    groups = ModelCommProcessGroups(
        ep=parallel_state.get_expert_model_parallel_group(check_initialized=False),
        tp=parallel_state.get_tensor_model_parallel_group(check_initialized=False),
        cp=parallel_state.get_context_parallel_group(check_initialized=False),
        expt_tp=parallel_state.get_expert_tensor_parallel_group(check_initialized=False),
        tp_ep=parallel_state.get_expert_tensor_and_model_parallel_group(check_initialized=False),
        tp_cp=parallel_state.get_tensor_and_context_parallel_group(check_initialized=False),
    )
    groups.expt_dp = parallel_state.get_expert_data_parallel_group(check_initialized=False)
    return groups


def group_size(group) -> int:
    """Size of a process group (1 for None)."""
    return get_pg_size(group)


def group_rank(group) -> int:
    """This rank's index in a process group (0 for None)."""
    return get_pg_rank(group)


__all__ = [
    "switch_load_balancing_loss_func", "sequence_load_balancing_loss_func", "z_loss_func", "sinkhorn",
    "get_capacity", "MoEAuxLossAutoScaler", "group_limited_topk", "pad_routing_map", "topk_softmax_with_capacity",
    "permute", "unpermute", "permute_topk", "unpermute_topk", "sort_chunks_by_idxs",
    "get_moe_layer_wise_logging_tracker",
    "save_to_aux_losses_tracker", "clear_aux_losses_tracker", "reduce_aux_losses_tracker_across_ranks",
    "track_moe_metrics", "get_updated_expert_bias", "maybe_move_tensor_to_cpu", "RandomSTE",
    "apply_random_logits", "RouterGatingLinearFunction", "router_gating_linear", "get_default_model_comm_pgs",
    "ModelCommProcessGroups", "group_size", "group_rank",
]
