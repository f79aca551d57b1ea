"""YaRN rotary embeddings against the formulas written out here, and the cos/sin form of RoPE."""
import math
from types import SimpleNamespace

import pytest
import torch

from megatron.core.models.common.embeddings.rope_utils import (
    apply_rotary_pos_emb,
    apply_rotary_pos_emb_with_cos_sin,
    get_pos_emb_on_this_cp_rank,
)
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
    YarnRotaryEmbedding,
    _yarn_find_correction_range,
    _yarn_get_mscale,
    _yarn_linear_ramp_mask,
)


def _yarn_inv_freq_reference(d, base, s, orig_len, beta_fast, beta_slow):
    """YaRN's blended inverse frequencies, computed element by element in float64."""
    def corr_dim(rotations):
        return d * math.log(orig_len / (2 * math.pi * rotations)) / (2 * math.log(base))

    low = max(math.floor(corr_dim(beta_fast)), 0)
    high = min(math.ceil(corr_dim(beta_slow)), d - 1)
    if low == high:
        high += 0.001
    values = []
    for i in range(d // 2):
        extra = base ** (-2 * i / d)
        inter = 1.0 / (s * base ** (2 * i / d))
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        keep = 1.0 - ramp  # 1: original frequency, 0: interpolated
        values.append(inter * (1 - keep) + extra * keep)
    return torch.tensor(values, dtype=torch.float64), low, high


def _mscale(s, m):
    return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0


@pytest.mark.parametrize("d,base,s,orig_len,beta_fast,beta_slow,m,m_all", [
    (64, 10000.0, 40.0, 4096, 32.0, 1.0, 0.707, 0.707),  # DeepSeek-V3's MLA settings
    (64, 10000.0, 40.0, 4096, 32.0, 1.0, 1.0, 0.0),      # the class defaults for mscale
    (128, 500000.0, 8.0, 8192, 32.0, 1.0, 1.0, 1.0),
    (16, 10000.0, 1.0, 2048, 32.0, 1.0, 1.0, 1.0),       # factor 1: YaRN reduces to plain RoPE
])
def test_yarn_angles_and_mscale_match_the_formulas(d, base, s, orig_len, beta_fast, beta_slow, m, m_all):
    yarn = YarnRotaryEmbedding(d, rotary_base=base, scaling_factor=s, original_max_position_embeddings=orig_len,
                               beta_fast=beta_fast, beta_slow=beta_slow, mscale=m, mscale_all_dim=m_all,
                               use_cpu_initialization=True)
    inv_freq, low, high = _yarn_inv_freq_reference(d, base, s, orig_len, beta_fast, beta_slow)
    assert _yarn_find_correction_range(beta_fast, beta_slow, d, base, orig_len) == (low, math.floor(high))
    torch.testing.assert_close(yarn.blended_inv_freq().double(), inv_freq, rtol=2e-6, atol=0)

    emb, mscale = yarn(12, offset=3)
    assert emb.shape == (12, 1, 1, d)
    positions = torch.arange(3, 15, dtype=torch.float64)
    angles = torch.outer(positions, inv_freq)
    torch.testing.assert_close(emb[:, 0, 0, :].double(), torch.cat((angles, angles), dim=-1), rtol=1e-5, atol=1e-5)
    assert mscale == pytest.approx(_mscale(s, m) / _mscale(s, m_all), rel=1e-12)
    if s == 1.0:
        plain = RotaryEmbedding(d, 1.0, rotary_base=int(base), use_cpu_initialization=True)
        torch.testing.assert_close(emb, plain(12, offset=3))

    cos, sin = yarn.get_cached_cos_sin(12, dtype=torch.float32)
    emb0, _ = yarn(12)
    torch.testing.assert_close(cos, emb0.cos() * mscale)
    torch.testing.assert_close(sin, emb0.sin() * mscale)
    # A longer request or another dtype rebuilds the tables.
    cos_long, _ = yarn.get_cached_cos_sin(orig_len + 5, dtype=torch.bfloat16)
    assert cos_long.shape[0] == orig_len + 5 and cos_long.dtype == torch.bfloat16


def test_yarn_helpers():
    assert _yarn_get_mscale(1.0, 5.0) == 1.0
    assert _yarn_get_mscale(40.0, 0.707) == pytest.approx(0.1 * 0.707 * math.log(40.0) + 1.0)
    torch.testing.assert_close(_yarn_linear_ramp_mask(2, 6, 8), torch.tensor([0, 0, 0, .25, .5, .75, 1, 1]))
    # equal ends: a step of width 0.001, no division by zero
    torch.testing.assert_close(_yarn_linear_ramp_mask(3, 3, 6), torch.tensor([0, 0, 0, 0, 1, 1.0]))


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_percent", [1.0, 0.5])
def test_apply_rotary_pos_emb_with_cos_sin_equals_apply_rotary_pos_emb(interleaved, rotary_percent):
    torch.manual_seed(0)
    s, b, heads, hn = 10, 2, 3, 16
    rope = RotaryEmbedding(hn, rotary_percent, rotary_interleaved=interleaved, use_cpu_initialization=True)
    t = torch.randn(s, b, heads, hn)
    config = SimpleNamespace(rotary_interleaved=interleaved, apply_rope_fusion=False)
    expected = apply_rotary_pos_emb(t, rope(s), config=config)
    half_angles = rope.get_freqs_non_repeated(s + 4)  # [s + 4, rot / 2]: longer tables are cut to s
    cos, sin = rope.get_cos_sin(s + 4)
    torch.testing.assert_close(cos, half_angles.cos())
    got = apply_rotary_pos_emb_with_cos_sin(t, cos, sin, rotary_interleaved=interleaved)
    torch.testing.assert_close(got, expected)
    if rotary_percent < 1.0:
        torch.testing.assert_close(got[..., hn // 2:], t[..., hn // 2:])  # channels past rot pass through
    # bf16 activations: tables are cast to bf16 first, as Megatron does.
    got16 = apply_rotary_pos_emb_with_cos_sin(t.bfloat16(), half_angles.cos(), half_angles.sin(), interleaved)
    assert got16.dtype == torch.bfloat16
    torch.testing.assert_close(got16.float(), expected, atol=5e-2, rtol=0)


class _FakeGroup:
    def __init__(self, rank, size):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


def test_get_pos_emb_on_this_cp_rank_keeps_chunks_r_and_2cp_minus_1_minus_r():
    emb = torch.arange(16.0).view(16, 1, 1, 1)
    got = [get_pos_emb_on_this_cp_rank(emb, 0, _FakeGroup(r, 2)).flatten().tolist() for r in range(2)]
    assert got == [[0, 1, 2, 3, 12, 13, 14, 15], [4, 5, 6, 7, 8, 9, 10, 11]]
    along_dim1 = torch.arange(8.0).view(1, 8)
    assert get_pos_emb_on_this_cp_rank(along_dim1, 1, _FakeGroup(1, 2)).tolist() == [[2, 3, 4, 5]]
    assert get_pos_emb_on_this_cp_rank(emb, 0, _FakeGroup(0, 1)) is emb
