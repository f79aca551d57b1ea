"""YaRN rotary embeddings (Peng et al. 2023, "YaRN: Efficient Context Window Extension"), as Megatron's MLA uses them.

With head dim d, base b, scaling factor s and the original context length L:
- each frequency i = 0 .. d/2-1 has an extrapolated value `b^(-2i/d)` and an interpolated one `b^(-2i/d) / s`;
- `corr_dim(r) = d ln(L / (2 pi r)) / (2 ln b)` is the dimension whose wavelength fits r times into L;
  `low = max(floor(corr_dim(beta_fast)), 0)` and `high = min(ceil(corr_dim(beta_slow)), d - 1)`;
- `ramp[i] = clamp((i - low) / (high - low), 0, 1)` (high nudged by 0.001 when equal to low);
  dimensions below `low` keep their frequency, those above `high` are interpolated, a linear blend between;
- the angles are `outer(positions, inv_freq)` doubled to [S, 1, 1, d] (`cat(freqs, freqs)`), and attention
  multiplies cos/sin by `mscale = m(s, mscale) / m(s, mscale_all_dim)`, `m(s, k) = 0.1 k ln(s) + 1` (1 for s <= 1).

`forward` returns `(angles, mscale)`; `get_cached_cos_sin` returns the scaled cos/sin tables.
"""
import math
from typing import Optional, Tuple

import torch

from megatron.core.models.common.embeddings.rope_utils import get_pos_emb_on_this_cp_rank
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding


def _yarn_find_correction_dim(num_rotations: float, dim: int, rotary_base: float = 10000,
                              max_position_embeddings: int = 2048) -> float:
    """The (fractional) dimension index whose wavelength fits `num_rotations` times into the context."""
    return (dim * math.log(max_position_embeddings / (num_rotations * 2 * math.pi))) / (2 * math.log(rotary_base))


def _yarn_find_correction_range(low_rot: float, high_rot: float, dim: int, rotary_base: float = 10000,
                                max_position_embeddings: int = 2048) -> Tuple[int, int]:
    """(low, high) dimension indices between which YaRN blends extrapolation into interpolation."""
    low = math.floor(_yarn_find_correction_dim(low_rot, dim, rotary_base, max_position_embeddings))
    high = math.ceil(_yarn_find_correction_dim(high_rot, dim, rotary_base, max_position_embeddings))
    return max(low, 0), min(high, dim - 1)


def _yarn_linear_ramp_mask(min: float, max: float, dim: int, device=None) -> torch.Tensor:
    """fp32 [dim] on `device`: 0 up to `min`, rising linearly to 1 at `max`, 1 after."""
    if min == max:
        max += 0.001  # a zero-width ramp would divide by zero
    ramp = (torch.arange(dim, dtype=torch.float32, device=device) - min) / (max - min)
    return torch.clamp(ramp, 0, 1)


def _yarn_get_mscale(scale: float = 1, mscale: float = 1) -> float:
    """YaRN's attention magnitude correction 0.1 * mscale * ln(scale) + 1 (1 without scaling)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


class YarnRotaryEmbedding(RotaryEmbedding):
    """Rotary embedding with YaRN frequency blending (see the module docstring for the formulas).

    Args:
        kv_channels: rotated head dimension d (MLA: `qk_pos_emb_head_dim`).
        rotary_percent, rotary_interleaved, seq_len_interpolation_factor: as `RotaryEmbedding` (the YaRN
            frequencies use all d channels; the angles are laid out `cat(freqs, freqs)`).
        rotary_base: b.
        scaling_factor: s (`rotary_scaling_factor`).
        original_max_position_embeddings: L, the context the model was trained with.
        beta_fast, beta_slow: rotation counts bounding the blend.
        mscale, mscale_all_dim: magnitude correction coefficients.
        use_cpu_initialization: build the frequencies on the CPU.
        cp_group: context-parallel group whose rank's sequence chunks the angles are cut to.
    """

    def __init__(
        self,
        kv_channels: int,
        rotary_percent: float = 1.0,
        rotary_interleaved: bool = False,
        seq_len_interpolation_factor: Optional[float] = None,
        rotary_base: float = 10000.0,
        scaling_factor: float = 1.0,
        original_max_position_embeddings: int = 4096,
        beta_fast: float = 32.0,
        beta_slow: float = 1.0,
        mscale: float = 1.0,
        mscale_all_dim: float = 0.0,
        use_cpu_initialization: bool = False,
        cp_group=None,
    ):
        super().__init__(kv_channels, rotary_percent, rotary_interleaved=rotary_interleaved,
                         seq_len_interpolation_factor=seq_len_interpolation_factor, rotary_base=rotary_base,
                         use_cpu_initialization=use_cpu_initialization, cp_group=cp_group)
        self.dim = kv_channels
        self.rotary_base = rotary_base
        self.scaling_factor = scaling_factor
        self.original_max_position_embeddings = original_max_position_embeddings
        self.beta_fast = beta_fast
        self.beta_slow = beta_slow
        self.mscale = mscale
        self.mscale_all_dim = mscale_all_dim
        device = self.inv_freq.device
        exponents = torch.arange(0, self.dim, 2, dtype=torch.float32, device=device) / self.dim
        self.inv_freq_extra = 1.0 / (rotary_base ** exponents)
        self.inv_freq_inter = 1.0 / (scaling_factor * rotary_base ** exponents)
        self._set_cos_sin_cache(original_max_position_embeddings, offset=0, dtype=torch.get_default_dtype())

    def _apply(self, fn, *args, **kwargs):
        """Follow `.to(device)` with the YaRN frequency tables too (they stay fp32)."""
        probe = fn(torch.empty(0, device=self.inv_freq_extra.device))
        self.inv_freq_extra = self.inv_freq_extra.to(device=probe.device)
        self.inv_freq_inter = self.inv_freq_inter.to(device=probe.device)
        return super()._apply(fn, *args, **kwargs)

    def blended_inv_freq(self) -> torch.Tensor:
        """The YaRN inverse frequencies [d/2]: interpolated above the ramp, original below it."""
        low, high = _yarn_find_correction_range(self.beta_fast, self.beta_slow, self.dim, self.rotary_base,
                                                self.original_max_position_embeddings)
        # made on the tables' device: a host tensor copied over would make every forward wait for the GPU
        # (a pageable copy) and could not be captured in a CUDA graph
        extrapolate = 1.0 - _yarn_linear_ramp_mask(low, high, self.dim // 2, device=self.inv_freq_extra.device)
        return self.inv_freq_inter * (1 - extrapolate) + self.inv_freq_extra * extrapolate

    def magnitude_scale(self) -> float:
        """mscale = m(s, mscale) / m(s, mscale_all_dim), the factor cos and sin are multiplied by."""
        return float(_yarn_get_mscale(self.scaling_factor, self.mscale)
                     / _yarn_get_mscale(self.scaling_factor, self.mscale_all_dim))

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False) -> Tuple[torch.Tensor, float]:
        """(angles [max_seq_len, 1, 1, d] for positions offset.., mscale); cut to this CP rank's chunks."""
        inv_freq = self.blended_inv_freq()
        seq = torch.arange(max_seq_len, device=inv_freq.device, dtype=torch.float32) + offset
        freqs = torch.outer(seq, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]  # [s, d/2] -> [s, 1, 1, d]
        if self.cp_group is not None and self.cp_group.size() > 1 and not packed_seq:
            emb = get_pos_emb_on_this_cp_rank(emb, 0, self.cp_group)
        return emb, self.magnitude_scale()

    def _set_cos_sin_cache(self, seq_len: int, offset: int, dtype: torch.dtype, packed_seq: bool = False) -> None:
        self.max_seq_len_cached = seq_len
        self.offset_cached = offset
        self.dtype_cached = dtype
        self.packed_seq_cached = packed_seq
        emb, mscale = self.forward(seq_len, offset, packed_seq)
        self.cos_cached = (emb.cos() * mscale).to(dtype).contiguous()
        self.sin_cached = (emb.sin() * mscale).to(dtype).contiguous()

    def get_cached_cos_sin(self, seq_len: int, offset: int = 0, dtype: torch.dtype = torch.get_default_dtype(),
                           packed_seq: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
        """(cos * mscale, sin * mscale), each [seq_len, 1, 1, d] in `dtype`, rebuilt when the request outgrows
        or differs from the cached tables."""
        if (seq_len > self.max_seq_len_cached or offset != self.offset_cached or dtype != self.dtype_cached
                or packed_seq != self.packed_seq_cached
                or self.cos_cached.device != self.inv_freq_extra.device):
            self._set_cos_sin_cache(seq_len, offset, dtype, packed_seq)
        return self.cos_cached[:seq_len, ...], self.sin_cached[:seq_len, ...]


__all__ = [
    "YarnRotaryEmbedding",
    "_yarn_find_correction_dim",
    "_yarn_find_correction_range",
    "_yarn_linear_ramp_mask",
    "_yarn_get_mscale",
]
