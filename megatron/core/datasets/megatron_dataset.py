"""`MegatronDataset`: the mid-level dataset base (one split of one low-level dataset).

It computes `unique_identifiers`, `unique_description` and its md5 `unique_description_hash`, which
name the cache files; the serialisation matches Megatron so caches are shared between the two.
"""
import hashlib
import json
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Any, Dict, Iterable, List, Optional, Union

import numpy
import torch

from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.utils import Split

LowLevelDataset = Union[IndexedDataset, Iterable]


def md5_of_description(description: str) -> str:
    """The md5 hex digest used in cache file names."""
    return hashlib.md5(description.encode("utf-8")).hexdigest()


def _identifiers_of(obj: Any) -> Any:
    """JSON fallback: objects (tokenizers) are serialised as their `unique_identifiers`."""
    if hasattr(obj, "unique_identifiers"):
        return obj.unique_identifiers
    return type(obj).__name__


class MegatronDataset(ABC, torch.utils.data.Dataset):
    """Base of the mid-level datasets.

    Args:
        dataset: the low-level dataset.
        dataset_path: the real path prefix on disk (None for mock data).
        indices: the low-level element ids exposed by this split.
        num_samples: samples to build (None: one epoch).
        index_split: which split this is.
        config: the dataset config.
    """

    def __init__(
        self,
        dataset: LowLevelDataset,
        dataset_path: Optional[str],
        indices: numpy.ndarray,
        num_samples: Optional[int],
        index_split: Split,
        config: BlendedMegatronDatasetConfig,
    ) -> None:
        self.dataset = dataset
        self.dataset_path = dataset_path
        self.indices = indices
        self.num_samples = num_samples
        self.index_split = index_split
        self.config = config
        self.unique_identifiers = OrderedDict()
        self.unique_identifiers["class"] = type(self).__name__
        self.unique_identifiers["dataset_path"] = self.dataset_path
        self.unique_identifiers["num_samples"] = self.num_samples
        self.unique_identifiers["index_split"] = self.index_split.name
        for attr in self._key_config_attributes():
            self.unique_identifiers[attr] = getattr(self.config, attr)
        self.unique_description = json.dumps(
            self.unique_identifiers, indent=4, default=_identifiers_of
        )
        self.unique_description_hash = md5_of_description(self.unique_description)
        self.built_anew_on_cache_miss = False

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: LowLevelDataset) -> int:
        """Number of low-level elements the split fractions apply to."""
        raise NotImplementedError

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: BlendedMegatronDatasetConfig) -> LowLevelDataset:
        """Open the low-level dataset at `dataset_path`."""
        raise NotImplementedError

    @staticmethod
    def _key_config_attributes() -> List[str]:
        """Config attributes that identify the dataset in the cache hash (in this order)."""
        return ["random_seed", "sequence_length", "split", "split_matrix", "tokenizer"]

    @abstractmethod
    def __len__(self) -> int:
        """Number of samples."""

    @abstractmethod
    def __getitem__(self, idx: int) -> Dict[str, Any]:
        """One sample."""
