"""Context parallelism of the Mamba mixer (Megatron's `MambaContextParallel` scheme).

The scan runs over the whole sequence, so the CP ranks trade sequence shards for head shards: each of z, x, B,
C, dt goes through an all-to-all (`context_parallel.comm`, Ulysses) from this rank's load-balanced sequence
chunks of all local heads to the full sequence of `heads/CP` heads (and `groups/CP` groups), the load-balanced
chunk order is undone, the conv / scan / norm run with this CP rank's slices of the TP-rank parameters, and the
result goes back the same way. Parameters stay whole on every CP rank (no extra checkpoint state); each rank's
gradient lands in its slice and the DP x CP gradient reduction sums them.
"""
import torch

from megatron.core.context_parallel.comm import all_to_all_heads_to_seq, all_to_all_seq_to_heads, group_rank, \
    group_size
from megatron.core.context_parallel.layout import load_balanced_indices


def cp_problems(nheads_local: int, ngroups_local: int, cp_size: int) -> list:
    """Divisibility rules of the mixer under CP (per TP rank)."""
    problems = []
    if nheads_local % cp_size:
        problems.append(f"Mamba heads per TP rank ({nheads_local}) must be divisible by --context-parallel-size "
                        f"({cp_size}).")
    if ngroups_local % cp_size:
        problems.append(f"--mamba-num-groups per TP rank ({ngroups_local}) must be divisible by "
                        f"--context-parallel-size ({cp_size}) here (Megatron replicates groups instead).")
    return problems


class MambaCPSlices:
    """This CP rank's slices of the mixer's per-head / per-group parameters and the sequence reordering."""

    def __init__(self, mixer, cp_group):
        self.group, self.size, self.rank = cp_group, group_size(cp_group), group_rank(cp_group)
        self.heads = mixer.nheads_local // self.size
        self.groups = mixer.ngroups_local // self.size
        d_cp, gs_cp = mixer.d_inner_local // self.size, mixer.ngroups_local * mixer.d_state // self.size
        d_local, gs_local = mixer.d_inner_local, mixer.ngroups_local * mixer.d_state
        r = self.rank
        self.channels = torch.cat([torch.arange(r * d_cp, (r + 1) * d_cp),
                                   d_local + torch.arange(r * gs_cp, (r + 1) * gs_cp),
                                   d_local + gs_local + torch.arange(r * gs_cp, (r + 1) * gs_cp)])
        self.inner = slice(r * d_cp, (r + 1) * d_cp)
        self.head_slice = slice(r * self.heads, (r + 1) * self.heads)

    def to_heads(self, t: torch.Tensor) -> torch.Tensor:
        """[s/cp, b, n, d] load-balanced sequence shard -> [s, b, n/cp, d] in natural token order."""
        gathered = all_to_all_seq_to_heads(t, self.group)
        order = self._order(gathered.shape[0], gathered.device)
        return gathered.index_select(0, torch.argsort(order))

    def to_sequence(self, t: torch.Tensor) -> torch.Tensor:
        """[s, b, n/cp, d] natural order -> [s/cp, b, n, d] this rank's load-balanced shard."""
        order = self._order(t.shape[0], t.device)
        return all_to_all_heads_to_seq(t.index_select(0, order).contiguous(), self.group)

    def _order(self, seq_len: int, device) -> torch.Tensor:
        """Global position of every token of the rank-order concatenation of the CP shards."""
        return torch.cat([load_balanced_indices(seq_len, self.size, r, device) for r in range(self.size)])


__all__ = ["MambaCPSlices", "cp_problems"]
