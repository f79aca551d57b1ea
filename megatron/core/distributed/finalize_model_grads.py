"""`finalize_model_grads`: everything that turns local gradients into the gradients the optimizer steps on.

Order (Megatron's): finish the data-parallel reduction of every model chunk; all-reduce the conditional
embedder over pipeline stages; all-reduce over TP the gradients of parameters that are replicated across
TP ranks but see different data (layernorms and biases under sequence parallelism, q/k layernorms);
all-reduce tied word embeddings (and shared position embeddings) between the first and last pipeline
stages; update MoE router expert biases; and, for a per-token loss, divide by the global token count.
"""
from typing import Callable, List, Optional

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megatron.core import parallel_state
from megatron.core.utils import get_attr_wrapped_model, get_model_config

try:
    from torch.distributed.tensor import DTensor, distribute_tensor
except ImportError:  # torch without the public DTensor module: FSDP2 is not usable there anyway
    DTensor = None
    distribute_tensor = None


class _Groups:
    """The groups finalize_model_grads talks to, from `pg_collection` or parallel_state."""

    def __init__(self, pg_collection):
        if pg_collection is None:
            self.tp = parallel_state.get_tensor_model_parallel_group()
            self.pp = parallel_state.get_pipeline_model_parallel_group()
            self.embd = parallel_state.get_embedding_group(check_initialized=False)
            self.pos_embd = parallel_state.get_position_embedding_group(check_initialized=False)
            self.dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
            self.in_embd = parallel_state.is_rank_in_embedding_group(ignore_virtual=True)
            self.in_pos_embd = parallel_state.is_rank_in_position_embedding_group()
        else:
            for attr in ("tp", "pp", "dp_cp"):
                if getattr(pg_collection, attr, None) is None:
                    raise ValueError(f"pg_collection passed to finalize_model_grads has no '{attr}' process group")
            self.tp = pg_collection.tp
            self.pp = pg_collection.pp
            self.dp_cp = pg_collection.dp_cp
            self.embd = getattr(pg_collection, "embd", None)
            self.pos_embd = getattr(pg_collection, "pos_embd", None)
            self.in_embd = self.embd is not None
            self.in_pos_embd = self.pos_embd is not None


def _timer(config, name: str):
    timers = getattr(config, "timers", None)
    if timers is None:
        return None
    timer = timers(name, log_level=1)
    timer.start(barrier=getattr(config, "barrier_with_L1_time", False))
    return timer


def _stop(timer):
    if timer is not None:
        timer.stop()


def _get_main_grad_attr(param: torch.nn.Parameter) -> str:
    return "main_grad" if hasattr(param, "main_grad") else "grad"


def _unshard_if_dtensor(tensor: torch.Tensor) -> torch.Tensor:
    if DTensor is not None and isinstance(tensor, DTensor):
        return tensor.full_tensor()
    return tensor


def _copy_into(original: torch.Tensor, full: torch.Tensor) -> None:
    """Write a reduced full gradient back into `original` (only its local shard when it is a DTensor)."""
    if DTensor is not None and isinstance(original, DTensor):
        sharded = distribute_tensor(full, original.device_mesh, original.placements)
        original.to_local().copy_(sharded.to_local())
    elif full.data_ptr() != original.data_ptr():
        original.data.copy_(full)


def _allreduce_grads(params: List[torch.nn.Parameter], group) -> None:
    """Sum the (main) gradients of `params` over `group` with one coalesced all-reduce."""
    if not params:
        return
    originals = [getattr(p, _get_main_grad_attr(p)) for p in params]
    grads = [_unshard_if_dtensor(g).data for g in originals]
    coalesced = _flatten_dense_tensors(grads)
    dist.all_reduce(coalesced, group=group)
    for original, grad, synced in zip(originals, grads, _unflatten_dense_tensors(coalesced, grads)):
        grad.copy_(synced)
        _copy_into(original, grad)


def _named_params(model_chunk):
    return get_attr_wrapped_model(model_chunk, "named_parameters")()


def _allreduce_conditional_embedding_grads(model: List[torch.nn.Module], config, pp_group) -> None:
    """Conditional embedders (DiT-style models) are replicated on every pipeline stage: sum them."""
    if pp_group is None or pp_group.size() <= 1 or not getattr(config, "has_cond_embedder", False):
        return
    grads_by_name = {}
    for model_chunk in model:
        for name, param in _named_params(model_chunk):
            if param.requires_grad and getattr(param, "pipeline_parallel", False):
                grads_by_name.setdefault(name, []).append(getattr(param, _get_main_grad_attr(param)))
    if not grads_by_name:
        return
    firsts = []
    for grads in grads_by_name.values():
        for extra in grads[1:]:
            grads[0].add_(extra)
        firsts.append(grads[0])
    coalesced = _flatten_dense_tensors(firsts)
    dist.all_reduce(coalesced, group=pp_group)
    for grad, synced in zip(firsts, _unflatten_dense_tensors(coalesced, firsts)):
        grad.copy_(synced)
    for grads in grads_by_name.values():
        for extra in grads[1:]:
            extra.copy_(grads[0])


def _allreduce_non_tensor_model_parallel_grads(model: List[torch.nn.Module], config, tp_group) -> None:
    """Sum over TP the grads of params that are replicated across TP but see TP-local data."""
    if tp_group is None or tp_group.size() <= 1:
        return
    if not (getattr(config, "sequence_parallel", False) or getattr(config, "qk_layernorm", False)):
        return
    params_sum, params_avg = [], []
    for model_chunk in model:
        for name, param in _named_params(model_chunk):
            if not param.requires_grad:
                continue
            if getattr(param, "average_gradients_across_tp_domain", False):
                params_avg.append(param)
            elif getattr(param, "sequence_parallel", False) or "q_layernorm" in name or "k_layernorm" in name:
                params_sum.append(param)
    _allreduce_grads(params_sum, tp_group)
    if params_avg:
        _allreduce_grads(params_avg, tp_group)
        for param in params_avg:
            getattr(param, _get_main_grad_attr(param)).div_(tp_group.size())


def _shared_word_embedding_weight(model_module, config) -> Optional[torch.nn.Parameter]:
    shares = getattr(model_module, "share_embeddings_and_output_weights", False)
    if (shares or getattr(config, "mtp_num_layers", None)) and hasattr(model_module, "shared_embedding_or_output_weight"):
        return model_module.shared_embedding_or_output_weight()
    return None


def _position_embedding_weight(model_module, config) -> Optional[torch.nn.Parameter]:
    embedding = getattr(model_module, "embedding", None)
    position_embeddings = getattr(embedding, "position_embeddings", None)
    return None if position_embeddings is None else position_embeddings.weight


def _allreduce_embedding_grad(model, group, pp_group, weight_getter: Callable, config) -> None:
    """Sum one shared weight's gradient over `group` (the ranks holding a copy of it)."""
    if pp_group is None or pp_group.size() <= 1 or pp_group.rank() == 0:
        model_module = model[0]
    elif pp_group.rank() == pp_group.size() - 1:
        model_module = model[-1]
    else:
        model_module = model[0]
    try:
        inner = get_attr_wrapped_model(model_module, "shared_embedding_or_output_weight", return_model_obj=True)
    except RuntimeError:
        try:
            inner = get_attr_wrapped_model(model_module, "embedding", return_model_obj=True)
        except RuntimeError:
            return
    weight = weight_getter(inner, config)
    if weight is None or not weight.requires_grad:
        return
    _allreduce_grads([weight], group)


def _in_group(group) -> bool:
    return group is not None and dist.get_rank() in dist.get_process_group_ranks(group)


def _allreduce_shared_embedding_grads(model, config, groups: _Groups) -> None:
    """finalize_model_grads' step: both shared embeddings over the groups it resolved (no defaulting)."""
    if groups.in_embd and groups.embd is not None and dist.get_world_size(groups.embd) > 1:
        _allreduce_embedding_grad(model, groups.embd, groups.pp, _shared_word_embedding_weight, config)
    if groups.in_pos_embd and groups.pos_embd is not None and dist.get_world_size(groups.pos_embd) > 1:
        _allreduce_embedding_grad(model, groups.pos_embd, groups.pp, _position_embedding_weight, config)


def _allreduce_word_embedding_grads(model: List[torch.nn.Module], config, embd_group=None, pp_group=None) -> None:
    """Sum the tied word-embedding / output-layer weight's gradient over the embedding group (the first and
    last pipeline stages), so both copies stay equal. Groups default to parallel_state's; a rank outside
    the embedding group, or a group of one rank, does nothing."""
    if embd_group is None:
        embd_group = parallel_state.get_embedding_group(check_initialized=False)
    if pp_group is None:
        pp_group = parallel_state.get_pipeline_model_parallel_group(check_initialized=False)
    if _in_group(embd_group) and dist.get_world_size(embd_group) > 1:
        _allreduce_embedding_grad(model, embd_group, pp_group, _shared_word_embedding_weight, config)


def _allreduce_position_embedding_grads(model: List[torch.nn.Module], config, pos_emb_group=None,
                                        pp_group=None) -> None:
    """Sum the learned position embedding's gradient over the position-embedding group (encoder and decoder
    stages sharing it). Groups default to parallel_state's; ranks outside the group do nothing."""
    if pos_emb_group is None:
        pos_emb_group = parallel_state.get_position_embedding_group(check_initialized=False)
    if pp_group is None:
        pp_group = parallel_state.get_pipeline_model_parallel_group(check_initialized=False)
    if _in_group(pos_emb_group) and dist.get_world_size(pos_emb_group) > 1:
        _allreduce_embedding_grad(model, pos_emb_group, pp_group, _position_embedding_weight, config)


def _allreduce_embedding_grads(model: List[torch.nn.Module], config, embd_group=None, pos_emb_group=None,
                               pp_group=None) -> None:
    """Both shared embeddings: the tied word embedding, then the position embedding."""
    _allreduce_word_embedding_grads(model, config, embd_group, pp_group)
    _allreduce_position_embedding_grads(model, config, pos_emb_group, pp_group)


def _allreduce_layernorm_grads(model: List[torch.nn.Module], config, tp_group=None) -> None:
    """Megatron's earlier name of `_allreduce_non_tensor_model_parallel_grads` (sequence-parallel norm and bias
    gradients, q/k layernorms); the TP group defaults to parallel_state's."""
    if tp_group is None:
        tp_group = parallel_state.get_tensor_model_parallel_group(check_initialized=False)
    _allreduce_non_tensor_model_parallel_grads(model, config, tp_group)


def _get_shared_word_embedding_weight(model_module, config) -> Optional[torch.nn.Parameter]:
    """The tied embedding / output weight a model chunk holds a pipeline copy of, or None."""
    return _shared_word_embedding_weight(model_module, config)


def _get_position_embedding_weight(model_module, config=None) -> Optional[torch.nn.Parameter]:
    """The learned position-embedding weight of a model chunk, or None."""
    return _position_embedding_weight(model_module, config)


def _reshard_if_dtensor(tensor_to_shard: torch.Tensor, reference_tensor: torch.Tensor) -> torch.Tensor:
    """`tensor_to_shard` (a full tensor) sharded like `reference_tensor` when that is a DTensor, else unchanged;
    the inverse of `_unshard_if_dtensor`."""
    if DTensor is not None and isinstance(reference_tensor, DTensor):
        return distribute_tensor(tensor_to_shard, reference_tensor.device_mesh, reference_tensor.placements)
    return tensor_to_shard


def _update_router_expert_bias(model: List[torch.nn.Module], config) -> None:
    """Aux-loss-free MoE load balancing, once per step: counts summed over TP x CP x DP, then each expert's bias
    moves by `rate * sign(mean count - its count)` and the counts restart. The same update as
    `megatron.core.transformer.moe.moe_utils.get_updated_expert_bias` (this package must not import the model
    code; the MoE parity test checks that both agree)."""
    tokens_per_expert, expert_biases = [], []
    for model_chunk in model:
        for module in get_attr_wrapped_model(model_chunk, "modules")():
            if getattr(module, "expert_bias", None) is not None and hasattr(module, "local_tokens_per_expert"):
                tokens_per_expert.append(module.local_tokens_per_expert)
                expert_biases.append(module.expert_bias)
    if not expert_biases:
        return
    with torch.no_grad():
        stacked_tokens = torch.stack(tokens_per_expert, dim=0)  # [layers, experts]
        stacked_bias = torch.stack(expert_biases, dim=0)  # [layers, experts]
        dist.all_reduce(stacked_tokens, group=parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True))
        average = stacked_tokens.sum(dim=-1, keepdim=True) / stacked_tokens.shape[-1]
        updated = stacked_bias + torch.sign(average - stacked_tokens) * config.moe_router_bias_update_rate
        for tokens, bias, new_bias in zip(tokens_per_expert, expert_biases, updated):
            tokens.zero_()
            bias.copy_(new_bias)


def _normalize_by_num_tokens(model: List[torch.nn.Module], num_tokens: torch.Tensor, groups: _Groups) -> None:
    """Per-token loss: num_tokens lives on the last stage; share it, sum it over DP x CP, divide grads."""
    if groups.pp is not None and groups.pp.size() > 1:
        last_rank = dist.get_global_rank(groups.pp, groups.pp.size() - 1)
        dist.broadcast(num_tokens, src=last_rank, group=groups.pp)
    dist.all_reduce(num_tokens, group=groups.dp_cp)
    # Kept on the device (no host sync): grads are left unscaled when no token counted.
    total = num_tokens.to(torch.float32)
    scale = torch.where(total > 0, 1.0 / total.clamp(min=1.0), torch.ones_like(total))
    for model_chunk in model:
        model_chunk.scale_gradients(scale)


def finalize_model_grads(model: List[torch.nn.Module], num_tokens: Optional[torch.Tensor] = None, pg_collection=None):
    """Finish all gradient communication of one iteration (see the module docstring for the order).

    Args:
        model: the list of (DDP-wrapped) model chunks of this rank.
        num_tokens: total loss tokens of this rank's microbatches when the loss is per-token, else None.
        pg_collection: optional object with `tp`, `pp`, `dp_cp` (and `embd`, `pos_embd`) process groups.
    """
    config = get_model_config(model[0])
    groups = _Groups(pg_collection)

    timer = _timer(config, "all-grads-sync")
    for model_chunk in model:
        model_chunk.finish_grad_sync()
    _stop(timer)

    timer = _timer(config, "conditional-embedder-grads-all-reduce")
    _allreduce_conditional_embedding_grads(model, config, groups.pp)
    _stop(timer)

    timer = _timer(config, "non-tensor-parallel-grads-all-reduce")
    _allreduce_non_tensor_model_parallel_grads(model, config, groups.tp)
    _stop(timer)

    timer = _timer(config, "embedding-grads-all-reduce")
    _allreduce_shared_embedding_grads(model, config, groups)
    _stop(timer)

    if getattr(config, "moe_router_enable_expert_bias", False):
        _update_router_expert_bias(model, config)

    if num_tokens is not None:
        _normalize_by_num_tokens(model, num_tokens, groups)
