"""`get_batch_on_this_cp_rank`: Megatron's split of a batch along the sequence for context parallelism.

Megatron exposes it from `megatron.core.utils` (re-exported lazily there: this module needs
`parallel_state`, which sits above `utils` in the import graph) and from `megatron.training.utils`.
"""
from typing import Any, Dict

import torch

from megatron.core import parallel_state


def get_batch_on_this_cp_rank(batch: Dict[str, Any]) -> Dict[str, Any]:
    """Keep this CP rank's two sequence chunks of every entry of `batch` (in place; returns `batch`).

    Every tensor's sequence dimension (dim 1; dim 2 for `attention_mask` [b, 1, s, s], i.e. its query axis)
    is viewed as 2 * CP equal chunks; rank r keeps chunks r and 2 * CP - 1 - r, concatenated in that order.
    None entries stay None; with CP = 1 the batch is returned unchanged."""
    cp_size = parallel_state.get_context_parallel_world_size()
    if cp_size == 1:
        return batch
    cp_rank = parallel_state.get_context_parallel_rank()
    for key, val in batch.items():
        if val is None:
            continue
        seq_dim = 2 if key == "attention_mask" else 1
        if val.shape[seq_dim] % (2 * cp_size) != 0:
            raise ValueError(
                f"get_batch_on_this_cp_rank: {key!r} has sequence length {val.shape[seq_dim]}, which is not "
                f"divisible by 2 x context-parallel size ({2 * cp_size}): use a --seq-length divisible by it."
            )
        index = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], dtype=torch.long, device=val.device)
        val = val.view(  # [.., s, ..] -> [.., 2cp, s/2cp, ..]
            *val.shape[:seq_dim], 2 * cp_size, val.shape[seq_dim] // (2 * cp_size), *val.shape[seq_dim + 1:]
        )
        val = val.index_select(seq_dim, index)
        batch[key] = val.view(*val.shape[:seq_dim], -1, *val.shape[seq_dim + 2:])  # [.., 2, s/2cp, ..] -> [.., s/cp, ..]
    return batch


__all__ = ["get_batch_on_this_cp_rank"]
