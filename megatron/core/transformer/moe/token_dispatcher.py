"""Token dispatchers: move each token to the ranks holding its experts, and the expert outputs back.

Notation: H hidden size, T = (s/TP)*b local tokens, E experts, L = E/EP local experts, k = top-k.
Every dispatcher runs the same six steps (Megatron Core's interface): `dispatch_preprocess` (local),
`token_dispatch` (communication), `dispatch_postprocess` (local; returns the rows of the local experts, the
row count per local expert, and their probabilities), then `combine_preprocess`,
`token_combine`, `combine_postprocess` in reverse.

- `MoEAllGatherTokenDispatcher`: all-gather tokens, probabilities and routing map over the expert TP x EP
  group, keep the rows of the local experts; reduce-scatter the outputs back.
- `MoEAlltoAllTokenDispatcher`: all-to-all over EP with uneven splits, then all-gather over expert TP;
  reduce-scatter over expert TP and all-to-all back.
- `MoEFlexTokenDispatcher`: DeepEP's fused dispatch/combine (refused here: not wired).

Host synchronisation: the all-to-all needs its split sizes on the host. The dispatcher gathers every count
it needs (splits, per-chunk sizes, rows per local expert) into one device tensor, starts one asynchronous
copy to pinned host memory right after computing it, and waits for that copy only where a host value is
first needed (before the all-to-all; before permuting when a capacity makes the row count data-dependent).
That is one host wait per MoE layer and forward, as in Megatron. Without EP and expert TP, dropless, nothing
needs a host value: the rows per local expert stay on the device (the grouped GEMM takes device offsets)
and the layer's forward does not wait for the GPU at all.
"""
from abc import abstractmethod
from typing import Dict, List, Optional

import torch

from megatron.core.tensor_parallel.mappings import (
    all_gather_along_first_dim,
    all_to_all,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.moe.moe_utils import (
    ModelCommProcessGroups,
    get_capacity,
    get_default_model_comm_pgs,
    group_rank,
    group_size,
    pad_routing_map,
    permute,
    permute_topk,
    sort_chunks_by_idxs,
    unpermute,
    unpermute_topk,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import module_available


class _HostCopy:
    """Small integer device tensors copied to the host with one asynchronous copy; `wait()` returns them."""

    def __init__(self, tensors: Dict[str, torch.Tensor]):
        self.names = list(tensors)
        self.shapes = [tuple(t.shape) for t in tensors.values()]
        # each tensor flattened, all concatenated: one copy instead of one per tensor
        flat = torch.cat([t.reshape(-1).to(torch.long) for t in tensors.values()])
        self.event = None
        if flat.is_cuda:
            self.host = torch.empty(flat.shape, dtype=torch.long, pin_memory=True)
            self.host.copy_(flat, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = flat
        self.result = None

    def wait(self) -> Dict[str, torch.Tensor]:
        """The host tensors (waits for the copy the first time)."""
        if self.result is None:
            if self.event is not None:
                self.event.synchronize()
            pieces = torch.split(self.host, [int(torch.Size(s).numel()) for s in self.shapes])
            self.result = {name: piece.view(shape) for name, piece, shape in zip(self.names, pieces, self.shapes)}
        return self.result


class MoETokenDispatcher:
    """Base class: the process groups and the six-step interface."""

    def __init__(self, config: TransformerConfig, model_comm_pgs: Optional[ModelCommProcessGroups] = None) -> None:
        if model_comm_pgs is None:
            model_comm_pgs = get_default_model_comm_pgs()
        self.config = config
        self.shared_experts = None
        self.ep_group = model_comm_pgs.ep
        # The expert TP group is this module's tensor-parallel group.
        self.tp_group = model_comm_pgs.expt_tp
        self.tp_ep_group = model_comm_pgs.tp_ep
        self.tp_size = group_size(self.tp_group)
        self.tp_rank = group_rank(self.tp_group)
        self.ep_size = group_size(self.ep_group)

    @abstractmethod
    def dispatch_preprocess(self, tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        """Local work before the dispatch communication; returns (tokens, probs) to send."""

    @abstractmethod
    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """The dispatch communication; returns (tokens, probs) received."""

    @abstractmethod
    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Local work after the dispatch; returns (rows of the local experts, rows per local expert (on the
        host, or on the device where no host value was needed), their probabilities)."""

    @abstractmethod
    def combine_preprocess(self, hidden_states):
        """Local work on the expert outputs before the combine communication."""

    @abstractmethod
    def token_combine(self, hidden_states):
        """The combine communication."""

    @abstractmethod
    def combine_postprocess(self, hidden_states):
        """Local work after the combine; returns the layer output in the input's shape."""

    def set_shared_experts(self, shared_experts):
        """Run `shared_experts` inside the dispatch and combine steps (`--moe-shared-expert-overlap`)."""
        if not self.config.moe_shared_expert_overlap:
            raise ValueError("set_shared_experts needs moe_shared_expert_overlap=True.")
        self.shared_experts = shared_experts


def _check_local_experts(num_local_experts: int, local_expert_indices: List[int]) -> None:
    if num_local_experts <= 0 or len(local_expert_indices) != num_local_experts:
        raise ValueError(f"token dispatcher: {num_local_experts} local experts with indices {local_expert_indices}: "
                         "expected one contiguous index per local expert.")
    if any(b - a != 1 for a, b in zip(local_expert_indices, local_expert_indices[1:])):
        raise ValueError(f"token dispatcher: local expert indices {local_expert_indices} must be contiguous.")


class MoEAllGatherTokenDispatcher(MoETokenDispatcher):
    """All-gather based dispatcher over the expert TP x EP group (every rank sees all the group's tokens)."""

    def __init__(self, num_local_experts: int, local_expert_indices: List[int], config: TransformerConfig,
                 model_comm_pgs: Optional[ModelCommProcessGroups] = None) -> None:
        super().__init__(config=config, model_comm_pgs=model_comm_pgs)
        _check_local_experts(num_local_experts, local_expert_indices)
        self.num_local_experts = num_local_experts
        self.local_expert_indices = local_expert_indices
        self.router_topk = config.moe_router_topk
        self.add_bias = config.add_bias_linear
        self.global_local_map = None

    def _communicates(self) -> bool:
        return self.tp_size > 1 or self.ep_size > 1

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        """[s/TP, b, H] -> [T, H]; the routing map is kept for the dispatch."""
        self.hidden_shape = hidden_states.shape
        # [s/TP, b, H] -> [T, H]
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
        self.routing_map = routing_map
        return hidden_states, probs

    def token_dispatch(self, hidden_states, probs):
        """All-gather the routing map (no gradient), the probabilities and the tokens over expert TP x EP."""
        if self._communicates():
            with torch.no_grad():
                # [T, E] -> [T * |tp_ep|, E] (gathered as bytes: every backend has them)
                gathered = all_gather_along_first_dim(self.routing_map.to(torch.uint8), group=self.tp_ep_group)
                self.routing_map = gathered.bool()
            probs = gather_from_sequence_parallel_region(probs, group=self.tp_ep_group)
            hidden_states = gather_from_sequence_parallel_region(hidden_states, group=self.tp_ep_group)
        return hidden_states, probs

    def dispatch_postprocess(self, hidden_states, probs):
        """Keep the rows routed to the local experts, grouped by expert."""
        self.hidden_shape_before_permute = hidden_states.shape
        first, last = self.local_expert_indices[0], self.local_expert_indices[-1] + 1
        self.local_map = self.routing_map[:, first:last].contiguous()
        self.local_probs = probs[:, first:last].contiguous()
        # The row count decides the shapes that follow: one host read per layer (as in Megatron).
        tokens_per_expert = self.local_map.sum(dim=0).long().cpu()
        permuted, self.local_probs, self.reversed_local_input_permutation_mapping = permute(
            hidden_states, self.local_map, probs=self.local_probs, num_out_tokens=int(tokens_per_expert.sum()),
            fused=self.config.moe_permute_fusion)
        self.routing_map = None
        return permuted, tokens_per_expert, self.local_probs

    def combine_preprocess(self, hidden_states):
        """Scatter the expert rows back to the gathered token order (summing each token's k outputs)."""
        return unpermute(hidden_states, self.reversed_local_input_permutation_mapping,
                         restore_shape=self.hidden_shape_before_permute, routing_map=self.local_map,
                         fused=self.config.moe_permute_fusion)

    def token_combine(self, hidden_states):
        """Reduce-scatter over expert TP x EP (summed in the probabilities' dtype)."""
        if self._communicates():
            hidden_states = reduce_scatter_to_sequence_parallel_region(
                hidden_states.to(self.local_probs.dtype), group=self.tp_ep_group).to(hidden_states.dtype)
        return hidden_states

    def combine_postprocess(self, hidden_states):
        """[T, H] -> the input's [s/TP, b, H]."""
        return hidden_states.view(self.hidden_shape)


class MoEAlltoAllTokenDispatcher(MoETokenDispatcher):
    """All-to-all dispatcher: A2A over EP (uneven splits), all-gather / reduce-scatter over expert TP.

    Chunk bookkeeping: `G[tp, ep, l]` = rows that (expert-TP rank tp, EP rank ep) send to local expert l.
    After the A2A and the expert-TP gather the rows arrive in (tp, ep, l) chunk order; "permutation 2" sorts
    them into (l, tp, ep) order so that each local expert's rows are contiguous, and the combine undoes it.
    """

    def __init__(self, num_local_experts: int, local_expert_indices: List[int], config: TransformerConfig,
                 model_comm_pgs: Optional[ModelCommProcessGroups] = None) -> None:
        super().__init__(config=config, model_comm_pgs=model_comm_pgs)
        _check_local_experts(num_local_experts, local_expert_indices)
        self.num_local_experts = num_local_experts
        self.num_experts = config.num_moe_experts
        self.local_expert_indices = local_expert_indices
        self.input_splits = None
        self.output_splits = None
        self.output_splits_tp = None
        chunk_idxs = torch.arange(self.num_experts * self.tp_size)
        # [tp*ep*L] chunk ids in (tp, ep, l) order -> their order grouped by local expert, and back
        self.sort_input_by_local_experts = chunk_idxs.reshape(-1, self.num_local_experts).T.ravel()
        self.restore_output_by_local_experts = chunk_idxs.reshape(self.num_local_experts, -1).T.ravel()
        self.drop_and_pad = config.moe_pad_expert_input_to_capacity
        if self.drop_and_pad and config.moe_expert_capacity_factor is None:
            raise ValueError("moe_pad_expert_input_to_capacity needs moe_expert_capacity_factor.")
        self.capacity = None
        self._pending = None
        self.exact_topk_routes = False

    def preprocess(self, routing_map: torch.Tensor) -> Optional[torch.Tensor]:
        """Split sizes and rows per local expert from the routing map [T, E]; starts their host copy.

        Returns the rows per local expert directly when no host copy is needed (drop-and-pad: known on the
        host; dropless without EP or expert TP: left on the device), else None (they arrive with the host
        copy)."""
        num_tokens = routing_map.size(0)
        if self.drop_and_pad:
            self.capacity = get_capacity(num_tokens=num_tokens * self.config.moe_router_topk,
                                         num_experts=self.num_experts,
                                         capacity_factor=self.config.moe_expert_capacity_factor)
            self.num_out_tokens = self.capacity * self.num_experts
            self.num_global_tokens_per_local_expert = None
            self.input_splits = self.output_splits = self.output_splits_tp = None
            if self.ep_size > 1 or self.tp_size > 1:
                self.input_splits = [self.capacity * self.num_local_experts] * self.ep_size
                self.output_splits = list(self.input_splits)
                self.output_splits_tp = [self.capacity * self.num_local_experts * self.ep_size] * self.tp_size
            self._pending = None
            self.exact_topk_routes = False
            return torch.full((self.num_local_experts,), self.capacity * self.tp_size * self.ep_size, dtype=torch.long)
        # [E] rows this rank sends to each expert
        num_local_tokens_per_expert = routing_map.sum(dim=0).long()
        counts = {"tokens_per_expert": num_local_tokens_per_expert}
        dynamic = self.config.moe_expert_capacity_factor is not None or self.config.moe_router_padding_for_fp8
        self.num_out_tokens = None if dynamic else num_tokens * self.config.moe_router_topk
        # dropless top-k: every token has exactly k routes, so both permutations are gathers
        self.exact_topk_routes = not dynamic
        if dynamic:
            counts["num_out_tokens"] = num_local_tokens_per_expert.sum().view(1)
        if self.ep_size > 1 or self.tp_size > 1:
            counts.update(self._global_counts(num_local_tokens_per_expert))
        elif not dynamic:
            # no communication and a known row count: the counts stay on the device (no host wait at all)
            self.input_splits = self.output_splits = self.output_splits_tp = None
            self.num_global_tokens_per_local_expert = None
            self._pending = None
            return num_local_tokens_per_expert
        self._pending = _HostCopy(counts)
        return None

    def _global_counts(self, num_local_tokens_per_expert: torch.Tensor) -> Dict[str, torch.Tensor]:
        """The counts of every rank of the expert TP x EP group (one all-gather of [E])."""
        input_splits = num_local_tokens_per_expert.reshape(self.ep_size, self.num_local_experts).sum(dim=1)
        gathered = all_gather_along_first_dim(num_local_tokens_per_expert, group=self.tp_ep_group)
        # [|tp_ep| * E] -> [EP, ETP, E] (ETP varies fastest in the group) -> [ETP, EP, E]
        per_rank = gathered.reshape(self.ep_size, self.tp_size, self.num_experts).transpose(0, 1)
        first, last = self.local_expert_indices[0], self.local_expert_indices[-1] + 1
        # [ETP, EP, E] -> G [ETP, EP, L]
        local = per_rank[:, :, first:last].contiguous()
        # [ETP, EP, L] -> [ETP, EP]: rows each (tp, ep) rank sends to this rank's experts
        per_source = local.sum(dim=2)
        return {
            "input_splits": input_splits,
            "output_splits": per_source[self.tp_rank],
            "output_splits_tp": per_source.sum(dim=1),
            "tokens_per_expert": local.sum(dim=(0, 1)),
            "chunks": local.view(-1, self.num_local_experts),
        }

    def _host_counts(self) -> Optional[Dict[str, torch.Tensor]]:
        """Wait for the host copy once and spread it over the dispatcher's attributes."""
        if self._pending is None:
            return None
        counts = self._pending.wait()
        self._pending = None
        if "num_out_tokens" in counts:
            self.num_out_tokens = int(counts["num_out_tokens"][0])
        if "input_splits" in counts:
            self.input_splits = counts["input_splits"].tolist()
            self.output_splits = counts["output_splits"].tolist()
            self.output_splits_tp = counts["output_splits_tp"].tolist()
        else:
            self.input_splits = self.output_splits = self.output_splits_tp = None
        self.num_global_tokens_per_local_expert = counts.get("chunks")
        self.tokens_per_expert = counts["tokens_per_expert"]
        return counts

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        """Count the routes, then permutation 1: rows grouped by expert (so by destination EP rank)."""
        self.hidden_shape = hidden_states.shape
        self.probs = probs
        self.routing_map = routing_map
        if probs.dim() != 2 or routing_map.dim() != 2 or routing_map.dtype != torch.bool:
            raise ValueError("the alltoall dispatcher expects probs [T, E] and a bool routing_map [T, E].")
        # [s/TP, b, H] -> [T, H]
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
        if self.config.moe_router_padding_for_fp8:
            self.routing_map = pad_routing_map(self.routing_map, 16)
        self.tokens_per_expert = self.preprocess(self.routing_map)
        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(hidden_states.view(self.hidden_shape))
        if self.num_out_tokens is None:
            self._host_counts()
        self.hidden_shape_before_permute = hidden_states.shape
        if self.exact_topk_routes:
            permuted_tokens, permuted_probs, self.reversed_local_input_permutation_mapping = permute_topk(
                hidden_states, self.routing_map, self.config.moe_router_topk, probs=probs)
            return permuted_tokens, permuted_probs
        permuted_tokens, permuted_probs, self.reversed_local_input_permutation_mapping = permute(
            hidden_states, self.routing_map, probs=probs, num_out_tokens=self.num_out_tokens,
            fused=self.config.moe_permute_fusion, drop_and_pad=self.drop_and_pad)
        return permuted_tokens, permuted_probs

    def token_dispatch(self, permutated_local_input_tokens, permuted_probs):
        """All-to-all over EP of the rows and their probabilities."""
        self._host_counts()
        global_input_tokens = all_to_all(self.ep_group, permutated_local_input_tokens, self.output_splits,
                                         self.input_splits)
        global_probs = all_to_all(self.ep_group, permuted_probs, self.output_splits, self.input_splits)
        return global_input_tokens, global_probs

    def _sorts_chunks(self) -> bool:
        """Permutation 2 is needed only when rows of several local experts arrive from several ranks (with a
        single source, permutation 1 already grouped them by expert)."""
        return self.num_local_experts > 1 and self.tp_size * self.ep_size > 1

    def _chunk_view(self, tensor, from_order):
        """Drop-and-pad: every chunk has `capacity` rows, so permutation 2 is a transpose."""
        # [a*b*capacity, ...] -> [a, b, capacity, ...] -> [b, a, capacity, ...] -> [a*b*capacity, ...]
        view = tensor.view(*from_order, self.capacity, *tensor.size()[1:])
        return view.transpose(0, 1).contiguous().flatten(start_dim=0, end_dim=2)

    def dispatch_postprocess(self, global_input_tokens, global_probs):
        """All-gather over expert TP, then permutation 2 (rows grouped by local expert)."""
        if self.shared_experts is not None:
            self.shared_experts.linear_fc1_forward_and_act(global_input_tokens)
        self._host_counts()
        if self.tp_size > 1:
            global_input_tokens = gather_from_sequence_parallel_region(
                global_input_tokens, group=self.tp_group, output_split_sizes=self.output_splits_tp)
            global_probs = gather_from_sequence_parallel_region(
                global_probs, group=self.tp_group, output_split_sizes=self.output_splits_tp)
        if self._sorts_chunks():
            if self.drop_and_pad:
                order = (self.tp_size * self.ep_size, self.num_local_experts)
                global_input_tokens = self._chunk_view(global_input_tokens, order)
                global_probs = self._chunk_view(global_probs, order)
            else:
                global_input_tokens, global_probs = sort_chunks_by_idxs(
                    global_input_tokens, self.num_global_tokens_per_local_expert.ravel(),
                    self.sort_input_by_local_experts, probs=global_probs, fused=self.config.moe_permute_fusion)
        tokens_per_expert = self.tokens_per_expert
        self.tokens_per_expert = None
        return global_input_tokens, tokens_per_expert, global_probs

    def combine_preprocess(self, hidden_states):
        """Undo permutation 2, then reduce-scatter over expert TP (in the probabilities' dtype)."""
        if self._sorts_chunks():
            if self.drop_and_pad:
                hidden_states = self._chunk_view(hidden_states, (self.num_local_experts, self.tp_size * self.ep_size))
            else:
                hidden_states, _ = sort_chunks_by_idxs(
                    hidden_states, self.num_global_tokens_per_local_expert.T.ravel(),
                    self.restore_output_by_local_experts, fused=self.config.moe_permute_fusion)
        if self.tp_size > 1:
            hidden_states = reduce_scatter_to_sequence_parallel_region(
                hidden_states.to(self.probs.dtype), group=self.tp_group,
                input_split_sizes=self.output_splits_tp).to(hidden_states.dtype)
        return hidden_states

    def token_combine(self, hidden_states):
        """All-to-all back over EP (the splits swapped)."""
        return all_to_all(self.ep_group, hidden_states, self.input_splits, self.output_splits)

    def combine_postprocess(self, permutated_local_input_tokens):
        """Unpermute to [T, H], reshape to the input's shape, add the overlapped shared experts' output."""
        if self.shared_experts is not None:
            self.shared_experts.linear_fc2_forward(permutated_local_input_tokens)
            self.shared_experts.post_forward_comm()
        if self.exact_topk_routes:
            output = unpermute_topk(permutated_local_input_tokens, self.reversed_local_input_permutation_mapping)
        else:
            output = unpermute(permutated_local_input_tokens, self.reversed_local_input_permutation_mapping,
                               restore_shape=self.hidden_shape_before_permute, routing_map=self.routing_map,
                               fused=self.config.moe_permute_fusion, drop_and_pad=self.drop_and_pad)
        output = output.view(self.hidden_shape)
        if self.shared_experts is not None:
            output = output + self.shared_experts.get_output()
        return output


class MoEFlexTokenDispatcher(MoETokenDispatcher):
    """DeepEP-based dispatcher (`--moe-token-dispatcher-type flex --moe-enable-deepep`): not wired here."""

    def __init__(self, num_local_experts: int, local_expert_indices: List[int], config: TransformerConfig,
                 model_comm_pgs: Optional[ModelCommProcessGroups] = None) -> None:
        if not module_available("deep_ep"):
            raise ImportError("moe_token_dispatcher_type='flex' needs DeepEP (the deep_ep package), which is not "
                              "installed: use --moe-token-dispatcher-type alltoall (or allgather).")
        raise NotImplementedError("moe_token_dispatcher_type='flex': DeepEP's fused dispatch is not wired into this "
                                  "framework yet; use --moe-token-dispatcher-type alltoall (or allgather).")

    def dispatch_preprocess(self, tokens, routing_map, probs):
        """Not reached: construction refuses."""

    def token_dispatch(self, hidden_states, probs):
        """Not reached: construction refuses."""

    def dispatch_postprocess(self, hidden_states, probs):
        """Not reached: construction refuses."""

    def combine_preprocess(self, hidden_states):
        """Not reached: construction refuses."""

    def token_combine(self, hidden_states):
        """Not reached: construction refuses."""

    def combine_postprocess(self, hidden_states):
        """Not reached: construction refuses."""


__all__ = ["MoETokenDispatcher", "MoEAllGatherTokenDispatcher", "MoEAlltoAllTokenDispatcher", "MoEFlexTokenDispatcher"]
