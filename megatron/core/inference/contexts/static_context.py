"""`StaticInferenceContext`: the key/value cache of static batching (Megatron Core's `InferenceParams`).

One batch of `max_batch_size` rows advances together: a forward feeds the columns
`[sequence_len_offset, sequence_len_offset + s)` of every row, which attend causally to all earlier columns.
Per layer the cache is `key_value_memory_dict[layer_number] = (K, V)`, K
`[max_sequence_length, max_batch_size, num_query_groups / TP, key head dim]` and V the same with the value
head dim (they differ for multi-latent attention: q_head_dim vs v_head_dim), allocated at the first forward.
The caller advances `sequence_len_offset` after each forward. `token_positions` gives the positions of a
forward's tokens to layers that rotate their own keys (multi-latent attention); with `cache_mla_latents`
multi-latent attention layers cache their compressed latent (one head) instead of per-head keys/values:
the layer's value is the leading part of its key ([latent | k_pe]), so only K is allocated and V is a view
of its leading channels.

Static-shape decode (CUDA graphs, `megatron.core.inference.decode_graphs`): while `static_decode` is on, a
one-column forward of `b` rows reads the column from the device tensor `decode_position` [1] instead of
`sequence_len_offset`, writes its keys/values with `index_copy_` and attends over the first `decode_window`
cached columns of rows `[0, b)` (a power of two >= the column, at least 128, at most `max_sequence_length`:
part of the graph key) under a mask `column <= position` built on the device: no Python int of the
step reaches a kernel, so the step is the same kernels at the same addresses every time.
"""
from typing import Dict, Tuple

import torch

from megatron.core.inference.contexts.base_context import BaseInferenceContext
from megatron.core.inference.contexts.kv_attention import attend_padded, check_value_in_key, rotary_table, rotate
from megatron.core.inference.decode_graphs import batch_bucket


class StaticInferenceContext(BaseInferenceContext):
    """Per-layer key/value memory plus the current batch and sequence offsets."""

    def __init__(self, max_batch_size: int, max_sequence_length: int, materialize_only_last_token_logits: bool = True,
                 cache_mla_latents: bool = False):
        super().__init__(materialize_only_last_token_logits)
        self.cache_mla_latents = cache_mla_latents
        self._max_sequence_length = max_sequence_length
        self.max_batch_size = max_batch_size
        self.current_batch_size = max_batch_size
        self.sequence_len_offset = 0
        self.batch_size_offset = 0
        self.decode_mode = False
        self.static_decode = False
        self.decode_position = None
        self.decode_window = max_sequence_length
        self.key_value_memory_dict: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def from_config(cls, inference_config) -> "StaticInferenceContext":
        """A context sized by an `InferenceWrapperConfig`."""
        return cls(inference_config.inference_max_requests, inference_config.inference_max_seq_length)

    @property
    def max_sequence_length(self) -> int:
        return self._max_sequence_length

    @max_sequence_length.setter
    def max_sequence_length(self, value: int) -> None:
        self._max_sequence_length = value

    def is_static_batching(self) -> bool:
        return True

    def is_decode_only(self) -> bool:
        """True once every row is past its prompt (one new column per forward)."""
        return self.decode_mode

    def enable_prefill_mode(self) -> None:
        """Forwards feed several columns (prompts)."""
        self.decode_mode = False

    def enable_decode_mode(self) -> None:
        """Forwards feed one column."""
        self.decode_mode = True

    def swap_key_value_dict(self, batch_idx: torch.Tensor) -> None:
        """Reorder every cached key/value along the batch dimension (beam search)."""
        if not self.key_value_memory_dict:
            raise ValueError("swap_key_value_dict: the key/value cache is empty")
        for layer_number, (key, value) in self.key_value_memory_dict.items():
            in_key = value.data_ptr() == key.data_ptr()  # MLA latents: the values are the keys' leading part
            key = key[:, batch_idx]
            value = key[..., :value.shape[-1]] if in_key else value[:, batch_idx]
            self.key_value_memory_dict[layer_number] = (key, value)

    def reset(self) -> None:
        """Start a new batch: offsets back to 0, cache kept allocated."""
        self.sequence_len_offset = 0
        self.batch_size_offset = 0
        self.decode_mode = False

    def _memory(self, layer_number: int, key: torch.Tensor, value: torch.Tensor):
        """This layer's (K, V) memory, (re)allocated when missing or of another dtype, device or head shape."""
        memory = self.key_value_memory_dict.get(layer_number)
        if memory is None or memory[0].dtype != key.dtype or memory[0].device != key.device or \
                memory[0].shape[2:] != key.shape[2:] or memory[1].shape[2:] != value.shape[2:]:
            rows = (self.max_sequence_length, self.max_batch_size)
            key_memory = torch.zeros(rows + tuple(key.shape[2:]), dtype=key.dtype, device=key.device)
            if self.cache_mla_latents:  # the values are the keys' leading channels
                value_memory = key_memory[..., :value.shape[-1]]
            else:
                value_memory = torch.zeros(rows + tuple(value.shape[2:]), dtype=key.dtype, device=key.device)
            memory = (key_memory, value_memory)
            self.key_value_memory_dict[layer_number] = memory
        return memory

    def _store(self, layer_number, key, value, columns, rows):
        """Write this forward's keys/values at `columns` (a slice, or a device index tensor) of `rows`;
        returns the layer's (K, V) memory. Under cache_mla_latents only the keys are written."""
        if self.cache_mla_latents:
            check_value_in_key(key, value)
        key_memory, value_memory = self._memory(layer_number, key, value)
        pairs = ((key_memory, key),) if self.cache_mla_latents else ((key_memory, key), (value_memory, value))
        for memory, new in pairs:
            if isinstance(columns, slice):
                memory[columns, rows] = new
            else:
                memory[:, rows].index_copy_(0, columns, new)
        return key_memory, value_memory

    def token_positions(self, num_tokens: int, device) -> torch.Tensor:
        """Positions [s] of the columns this forward feeds (the device `decode_position` under static decode)."""
        if self.static_decode:
            if self.decode_position is None:
                raise ValueError("static decode needs decode_position: call set_decode_position() first")
            return self.decode_position
        start = self.sequence_len_offset
        return torch.arange(start, start + num_tokens, device=device)

    def attend(self, layer_number, query, key, value, rotary_pos_emb, softmax_scale, config):
        """query [sq, b, np, hn], key [sq, b, ng, hn], value [sq, b, ng, hv] -> [sq, b, np * hv]."""
        sq, b = query.shape[0], query.shape[1]
        if self.static_decode:
            return self._attend_static_decode(layer_number, query, key, value, rotary_pos_emb, softmax_scale, config)
        start, end = self.sequence_len_offset, self.sequence_len_offset + sq
        rows = slice(self.batch_size_offset, self.batch_size_offset + b)
        if end > self.max_sequence_length or rows.stop > self.max_batch_size:
            raise ValueError(
                f"the static inference cache holds {self.max_sequence_length} tokens x {self.max_batch_size} rows; "
                f"this forward needs columns up to {end} and rows up to {rows.stop}: raise "
                f"--inference-max-seq-length / --inference-max-requests"
            )
        table = rotary_table(rotary_pos_emb)
        query, key = rotate(query, key, None if table is None else table[start:end], config)
        key_memory, value_memory = self._store(layer_number, key, value, slice(start, end), rows)
        keys, values = key_memory[:end, rows], value_memory[:end, rows]  # [end, b, ng, hn]
        allowed = None
        if sq > 1:  # column start + i sees columns 0 .. start + i
            q_pos = torch.arange(start, end, device=query.device)
            allowed = (torch.arange(end, device=query.device)[None, :] <= q_pos[:, None]).view(1, 1, sq, end)
        out = attend_padded(query.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), allowed,
                            softmax_scale)  # [b, sq, np, hn]
        return out.transpose(0, 1).reshape(sq, b, -1)  # [b, sq, np, hv] -> [sq, b, np*hv]

    def set_decode_position(self, device) -> torch.Tensor:
        """`decode_position` [1] (allocated once, then refilled) set to `sequence_len_offset`."""
        if self.decode_position is None or self.decode_position.device != torch.device(device):
            self.decode_position = torch.zeros(1, dtype=torch.long, device=device)
        self.decode_position.fill_(self.sequence_len_offset)
        needed = self.sequence_len_offset + 1
        self.decode_window = needed if needed >= self.max_sequence_length else \
            batch_bucket(max(needed, min(128, self.max_sequence_length)), self.max_sequence_length)
        return self.decode_position

    def _attend_static_decode(self, layer_number, query, key, value, rotary_pos_emb, softmax_scale, config):
        """One column at `decode_position`: query [1, b, np, hn], key/value [1, b, ng, hn] -> [1, b, np * hn]."""
        b = query.shape[1]
        if query.shape[0] != 1 or b > self.max_batch_size or self.decode_position is None:
            raise ValueError(f"static decode takes one column of at most {self.max_batch_size} rows with "
                             f"decode_position set; got {tuple(query.shape[:2])}")
        position = self.decode_position
        table = rotary_table(rotary_pos_emb)
        query, key = rotate(query, key, None if table is None else table.index_select(0, position), config)
        key_memory, value_memory = self._store(layer_number, key, value, position, slice(0, b))
        window = self.decode_window
        columns = torch.arange(window, device=query.device)
        allowed = (columns <= position).view(1, 1, 1, window)  # [W] -> [1, 1, 1, W]
        out = attend_padded(query.transpose(0, 1), key_memory[:window, :b].transpose(0, 1),
                            value_memory[:window, :b].transpose(0, 1), allowed, softmax_scale)  # [b, 1, np, hn]
        return out.transpose(0, 1).reshape(1, b, -1)  # [b, 1, np, hv] -> [1, b, np*hv]

    def last_token_hidden_states(self, hidden_states):
        """[s, b, h] -> [1, b, h]."""
        return hidden_states[-1:]

    def __str__(self) -> str:
        return (
            f"StaticInferenceContext(max_seq_len={self.max_sequence_length}, max_batch_size={self.max_batch_size}, "
            f"sequence_len_offset={self.sequence_len_offset}, batch_size_offset={self.batch_size_offset})"
        )


__all__ = ["StaticInferenceContext"]
