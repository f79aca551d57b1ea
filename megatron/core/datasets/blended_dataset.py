"""`BlendedDataset`: interleave several mid-level datasets by weight with Megatron's greedy rule.

Cache files: `{md5}-BlendedDataset-{split}-{description.txt,dataset_index.npy,dataset_sample_index.npy}`.
"""
import json
import logging
import os
import time
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple, Union

import numpy
import torch

from megatron.core.datasets import helpers
from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.megatron_dataset import MegatronDataset, md5_of_description
from megatron.core.datasets.utils import log_single_rank, normalize

logger = logging.getLogger(__name__)


class BlendedDataset(torch.utils.data.Dataset):
    """Blend of datasets.

    Args:
        datasets: the mid-level datasets (one split, one class).
        weights: blend weights (floats), or per-dataset sizes (ints) when size is None.
        size: samples to draw; None draws every sample of every dataset once.
        config: the dataset config.
    """

    def __init__(
        self,
        datasets: List[MegatronDataset],
        weights: List[Union[int, float]],
        size: Optional[int],
        config: BlendedMegatronDatasetConfig,
    ) -> None:
        problems = []
        if len(datasets) >= 32767:
            problems.append(f"{len(datasets)} datasets; at most 32766 can be blended")
        if len(datasets) != len(weights):
            problems.append(f"{len(datasets)} datasets but {len(weights)} weights")
        if any(w <= 0 for w in weights):
            problems.append(f"every weight must be > 0, got {list(weights)}")
        if len({d.index_split for d in datasets}) > 1:
            problems.append("datasets come from different splits")
        if problems:
            raise ValueError("BlendedDataset: " + "; ".join(problems))
        if size is not None:
            weights = normalize(weights)
        self.datasets = datasets
        self.split = datasets[0].index_split
        self.weights = weights
        self.size = size
        self.config = config
        unique_identifiers = OrderedDict()
        unique_identifiers["class"] = type(self).__name__
        unique_identifiers["datasets"] = [dataset.unique_identifiers for dataset in self.datasets]
        unique_identifiers["split"] = self.split.name
        unique_identifiers["weights"] = self.weights
        unique_identifiers["size"] = self.size
        self.unique_identifiers = unique_identifiers
        self.unique_description = json.dumps(
            unique_identifiers, indent=4, default=lambda obj: obj.unique_identifiers
        )
        self.unique_description_hash = md5_of_description(self.unique_description)
        self.dataset_index, self.dataset_sample_index = self._build_indices()

    def __len__(self) -> int:
        return self.dataset_index.shape[0]

    def __getitem__(self, idx: int) -> Dict[str, Union[int, numpy.ndarray]]:
        dataset_id = self.dataset_index[idx]
        dataset_sample_id = self.dataset_sample_index[idx]
        return {"dataset_id": dataset_id, **self.datasets[dataset_id][dataset_sample_id]}

    def _cache_paths(self) -> Optional[Dict[str, str]]:
        if not self.config.path_to_cache:
            return None
        base = f"{self.unique_description_hash}-{type(self).__name__}-{self.split.name}"
        return {
            affix: os.path.join(self.config.path_to_cache, f"{base}-{affix}")
            for affix in ("description.txt", "dataset_index.npy", "dataset_sample_index.npy")
        }

    def _build_indices(self) -> Tuple[numpy.ndarray, numpy.ndarray]:
        """Load or build (global rank 0) the dataset index and the dataset sample index."""
        paths = self._cache_paths()
        cache_hit = paths is not None and all(os.path.isfile(p) for p in paths.values())
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if paths is None or (not cache_hit and (not distributed or torch.distributed.get_rank() == 0)):
            t_beg = time.time()
            dataset_index, dataset_sample_index = self._compute_indices()
            if paths is not None:
                os.makedirs(self.config.path_to_cache, exist_ok=True)
                for affix, array in (("dataset_index.npy", dataset_index), ("dataset_sample_index.npy", dataset_sample_index)):
                    tmp = paths[affix] + f".tmp{os.getpid()}.npy"
                    numpy.save(tmp, array, allow_pickle=True)
                    os.replace(tmp, paths[affix])
                with open(paths["description.txt"], "wt") as writer:
                    writer.write(self.unique_description)
            log_single_rank(logger, logging.DEBUG, f"\t> time elapsed: {time.time() - t_beg:4f} seconds")
            return dataset_index, dataset_sample_index
        if not cache_hit:
            raise FileNotFoundError(
                f"BlendedDataset {self.split.name} cache is missing on this rank ({paths['dataset_index.npy']}): "
                "global rank 0 must build it first and the cache must be on a shared file system"
            )
        return (
            numpy.load(paths["dataset_index.npy"], allow_pickle=True, mmap_mode="r"),
            numpy.load(paths["dataset_sample_index.npy"], allow_pickle=True, mmap_mode="r"),
        )

    def _compute_indices(self) -> Tuple[numpy.ndarray, numpy.ndarray]:
        if self.size is not None:
            dataset_index = numpy.zeros(self.size, dtype=numpy.int16)
            dataset_sample_index = numpy.zeros(self.size, dtype=numpy.int64)
            helpers.build_blending_indices(
                dataset_index, dataset_sample_index, self.weights, len(self.datasets), self.size, False
            )
        else:
            size = int(sum(self.weights))
            dataset_index = numpy.zeros(size, dtype=numpy.int16)
            dataset_sample_index = numpy.zeros(size, dtype=numpy.int64)
            helpers.build_exhaustive_blending_indices(
                dataset_index, dataset_sample_index, self.weights, len(self.datasets)
            )
        ids, counts = numpy.unique(dataset_index, return_counts=True)
        for index, count in zip(ids, counts):
            available = len(self.datasets[index])
            if available < count:
                raise IndexError(
                    f"The {self.split.name} blend asks {count} samples of dataset {index} "
                    f"({self.datasets[index].dataset_path}) which has only {available}: raise "
                    f"--mid-level-dataset-surplus (now {self.config.mid_level_dataset_surplus}), e.g. ten-fold"
                )
        return dataset_index, dataset_sample_index
