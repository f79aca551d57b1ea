"""`RotaryEmbedding`: the rotation angles for each position ([s, 1, 1, rot_dim]).

`inv_freq` is a plain attribute, not a buffer, so it never appears in the state dict (as in Megatron).
"""
import math
from typing import Optional

import torch

from megatron.core import parallel_state


class RotaryEmbedding(torch.nn.Module):
    """Rotary position embedding angles, with optional Llama-3.x frequency scaling."""

    def __init__(
        self,
        kv_channels: int,
        rotary_percent: float,
        rotary_interleaved: bool = False,
        seq_len_interpolation_factor: Optional[float] = None,
        rotary_base: int = 10000,
        rope_scaling: bool = False,
        rope_scaling_factor: float = 8.0,
        use_cpu_initialization: bool = False,
        cp_group=None,
    ):
        super().__init__()
        dim = kv_channels
        if rotary_percent < 1.0:
            dim = int(dim * rotary_percent)
        self.rotary_interleaved = rotary_interleaved
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.cp_group = cp_group
        device = "cpu" if use_cpu_initialization or not torch.cuda.is_available() else torch.cuda.current_device()
        self.inv_freq = 1.0 / (rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
        if rope_scaling:
            self.inv_freq = self._apply_scaling(self.inv_freq, factor=rope_scaling_factor)

    def _apply(self, fn, *args, **kwargs):
        """Follow `.cuda()` / `.to(device)` with `inv_freq` (device only: it stays fp32 under `.bfloat16()`)."""
        probe = fn(torch.empty(0, device=self.inv_freq.device))
        self.inv_freq = self.inv_freq.to(device=probe.device)
        return super()._apply(fn, *args, **kwargs)

    @staticmethod
    def _apply_scaling(
        freqs: torch.Tensor,
        factor: float = 8.0,
        low_freq_factor: float = 1.0,
        high_freq_factor: float = 4.0,
        original_max_position_embeddings: int = 8192,
    ) -> torch.Tensor:
        """Llama-3.x scaling: divide low frequencies by `factor`, keep high ones, blend in between."""
        low_freq_wavelen = original_max_position_embeddings / low_freq_factor
        high_freq_wavelen = original_max_position_embeddings / high_freq_factor
        wavelen = 2 * math.pi / freqs
        scaled = torch.where(wavelen > low_freq_wavelen, freqs / factor, freqs)
        smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)

    def get_freqs_non_repeated(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        """Angles [s, rot_dim/2]: position times inverse frequency."""
        seq = torch.arange(max_seq_len, device=self.inv_freq.device, dtype=self.inv_freq.dtype) + offset
        if self.seq_len_interpolation_factor is not None:
            seq = seq * (1 / self.seq_len_interpolation_factor)
        return torch.outer(seq, self.inv_freq)

    def get_cos_sin(self, max_seq_len: int, offset: int = 0):
        """(cos, sin) of the angles [s, rot_dim/2] of positions offset.., for `apply_rotary_pos_emb_with_cos_sin`."""
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        return torch.cos(freqs), torch.sin(freqs)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False) -> torch.Tensor:
        """Angles for positions offset..offset+max_seq_len-1 as [s, 1, 1, rot_dim]."""
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        if not self.rotary_interleaved:
            emb = torch.cat((freqs, freqs), dim=-1)
        else:
            emb = torch.stack((freqs, freqs), dim=-1).flatten(-2)  # [s, d/2, 2] -> [s, d]
        emb = emb[:, None, None, :]  # [s, d] -> [s, 1, 1, d]
        cp_size = self._cp_size()
        if cp_size > 1 and not packed_seq:
            emb = _select_cp_chunks(emb, cp_size, self._cp_rank())
        return emb

    def _cp_size(self) -> int:
        if self.cp_group is not None:
            return self.cp_group.size()
        return parallel_state.get_context_parallel_world_size()

    def _cp_rank(self) -> int:
        if self.cp_group is not None:
            return self.cp_group.rank()
        return parallel_state.get_context_parallel_rank()

    def get_rotary_seq_len(self, inference_context, transformer, transformer_input, transformer_config, packed_seq_params=None) -> int:
        """The full sequence length the angles must cover (undoing SP and CP sharding)."""
        if inference_context is not None:
            return inference_context.max_sequence_length
        # Packed (THD) rows restart positions at every sequence: the table covers the longest one. Documents
        # inside ordinary rows ('sbhd', --reset-attention-mask) keep their row positions, as in Megatron.
        thd = packed_seq_params is not None and getattr(packed_seq_params, "qkv_format", None) == "thd"
        if thd and getattr(packed_seq_params, "max_seqlen_q", None) is not None:
            return max(packed_seq_params.max_seqlen_q, packed_seq_params.max_seqlen_kv)
        if transformer is not None and getattr(transformer, "input_tensor", None) is not None:
            rotary_seq_len = transformer.input_tensor.size(0)
        else:
            rotary_seq_len = transformer_input.size(0)
        if transformer_config.sequence_parallel:
            rotary_seq_len *= transformer_config.tensor_model_parallel_size
        return rotary_seq_len * transformer_config.context_parallel_size


def _select_cp_chunks(emb: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Keep chunks r and 2*CP-1-r of 2*CP sequence chunks (the load-balanced CP split)."""
    chunks = emb.view(2 * cp_size, emb.shape[0] // (2 * cp_size), *emb.shape[1:])  # [s, ...] -> [2cp, s/2cp, ...]
    index = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=emb.device)
    selected = chunks.index_select(0, index)
    return selected.reshape(-1, *emb.shape[1:])  # [2, s/2cp, ...] -> [s/cp, ...]


__all__ = ["RotaryEmbedding"]
