"""`BlendedMegatronDatasetConfig`: what every Megatron dataset builder needs, plus split parsing.

The split string becomes a normalised vector, then "bookends" (the split matrix). Both the string and
the matrix feed the dataset cache hash, so the float arithmetic follows Megatron's order exactly.
"""
import logging
import re
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from megatron.core.datasets.megatron_tokenizer import MegatronTokenizer
from megatron.core.datasets.utils import Split, log_single_rank, normalize

logger = logging.getLogger(__name__)


@dataclass
class BlendedMegatronDatasetConfig:
    """Configuration shared by every Megatron Core dataset."""

    random_seed: int
    """The seed for all RNG during dataset creation (`--seed`)."""

    sequence_length: int
    """The sequence length of a sample (`--seq-length`)."""

    blend: Optional[Tuple[List[str], Optional[List[float]]]] = None
    """(prefixes, weights or None) for all splits drawn from one distribution; not with blend_per_split."""

    blend_per_split: Optional[List[Optional[Tuple[List[str], Optional[List[float]]]]]] = None
    """One blend (or None) per split (train, valid, test); not with blend or split."""

    split: Optional[str] = None
    """Comma-separated split weights such as "969,30,1"; required with blend."""

    split_matrix: Optional[List[Optional[Tuple[float, float]]]] = field(init=False, default=None)
    """Bookends [(begin, end) or None] per split, derived from split; not a constructor argument."""

    num_dataset_builder_threads: int = 1
    """Threads used to build the per-prefix datasets of a blend."""

    path_to_cache: Optional[str] = None
    """Directory where the index caches go (`--data-cache-path`); default is next to each dataset."""

    mmap_bin_files: bool = True
    """Memory-map the .bin files (False reads them with file reads)."""

    mock: bool = field(init=False, default=False)
    """True when neither blend nor blend_per_split is given (synthetic data); derived."""

    tokenizer: Optional[MegatronTokenizer] = None
    """The tokenizer; its unique_identifiers feed the cache hash and its eod/pad the masks."""

    mid_level_dataset_surplus: float = 0.005
    """Extra fraction of samples to build per blended component so the blend never runs dry."""

    def __post_init__(self) -> None:
        """Check the blend/split combination and derive mock and split_matrix."""
        problems = []
        if self.blend_per_split is not None and any(self.blend_per_split):
            if self.blend is not None:
                problems.append("blend and blend_per_split are both set: use one of them")
            if self.split is not None:
                problems.append(
                    f"split ({self.split!r}) and blend_per_split are both set: per-split blends "
                    "take no split (drop --split)"
                )
            if len(self.blend_per_split) != len(Split):
                problems.append(
                    f"blend_per_split has {len(self.blend_per_split)} entries; it needs "
                    f"{len(Split)} (train, valid, test)"
                )
            for split in Split:
                if split.value >= len(self.blend_per_split):
                    continue
                blend = self.blend_per_split[split.value]
                if blend is not None:
                    _check_blend(blend, f"blend_per_split[{split.name}]", problems)
        else:
            if self.blend is not None:
                _check_blend(self.blend, "blend", problems)
                if self.split is None:
                    problems.append("split must be provided when blend is set (e.g. '969,30,1')")
            else:
                self.mock = True
                self.split = "1,1,1"
                log_single_rank(logger, logging.INFO, "Let mock = True: no blend and no blend_per_split")
        if problems:
            raise ValueError("invalid dataset config: " + "; ".join(problems))
        if self.split is not None and not (self.blend_per_split is not None and any(self.blend_per_split)):
            split_vector = parse_and_normalize_split(self.split)
            self.split_matrix = convert_split_vector_to_split_matrix(split_vector)
            log_single_rank(logger, logging.INFO, f"Let split_matrix = {self.split_matrix}")


def _check_blend(blend, name: str, problems: List[str]) -> None:
    prefixes, weights = blend
    if weights is not None and len(prefixes) != len(weights):
        problems.append(
            f"{name} has {len(prefixes)} prefixes but {len(weights)} weights: give one weight per prefix"
        )


def parse_and_normalize_split(split: str) -> List[float]:
    """Parse "99,1,0" (or "99 1", "0.9,0.1") into normalised fractions for train, valid, test."""
    values = [float(v) for v in re.findall(r"[.0-9]+", split)]
    values = values + [0.0] * (len(Split) - len(values))
    if len(values) != len(Split) or any(v < 0.0 for v in values) or sum(values) <= 0.0:
        raise ValueError(
            f"--split ({split!r}) must hold at most {len(Split)} non-negative weights with a positive "
            "sum, e.g. '969,30,1'"
        )
    return normalize(values)


def convert_split_vector_to_split_matrix(
    vector_a: List[float], vector_b: Optional[List[float]] = None
) -> List[Optional[Tuple[float, float]]]:
    """Bookends of each split: [0.99, 0.01, 0.0] -> [(0, 0.99), (0.99, 1.0), None].

    With a second vector, each split's bookend is the overlap of the two (None when empty).
    """
    if vector_b is None:
        vector_b = vector_a
    expansion_a = _running_sum(vector_a)
    expansion_b = _running_sum(vector_b)
    matrix = []
    for i in range(len(vector_a)):
        begin = max(expansion_a[i], expansion_b[i])
        end = min(expansion_a[i + 1], expansion_b[i + 1])
        matrix.append(None if end <= begin else (begin, end))
    return matrix


def _running_sum(vector: List[float]) -> List[float]:
    """[a, b, c] -> [0, a, a+b, a+b+c], accumulated left to right (int 0 first, like Megatron)."""
    out = [0]
    for value in vector:
        out.append(out[-1] + value)
    return out
