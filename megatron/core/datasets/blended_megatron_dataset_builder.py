"""`BlendedMegatronDatasetBuilder`: build the train/valid/test datasets for a blend on every rank.

Design note (rank order): global rank 0 builds (and caches) each index first; a barrier follows; the
other ranks then load the cache. Barriers happen only when torch.distributed is initialised, and every
rank calls them the same number of times whether or not it builds (`is_built_on_rank`).
"""
import logging
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, List, Optional, Type

import numpy
import torch

from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.megatron_dataset import MegatronDataset
from megatron.core.datasets.utils import Split, log_single_rank, normalize

logger = logging.getLogger(__name__)

MidLevelDataset = MegatronDataset


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


class BlendedMegatronDatasetBuilder:
    """Builds `[train, valid, test]` datasets (None where a split is empty or not built on this rank).

    Args:
        cls: the mid-level dataset class (e.g. GPTDataset, MockGPTDataset).
        sizes: samples wanted per split (None entries allowed: one epoch / exhaustive).
        is_built_on_rank: returns True where datasets are needed (global rank 0 must return True).
        config: the dataset config.
    """

    def __init__(
        self,
        cls: Type[MidLevelDataset],
        sizes: List[Optional[int]],
        is_built_on_rank: Callable[[], bool],
        config: BlendedMegatronDatasetConfig,
    ):
        self.cls = cls
        self.sizes = list(sizes)
        self.is_built_on_rank = is_built_on_rank
        self.config = config
        if len(self.sizes) != len(Split):
            raise ValueError(f"sizes must have {len(Split)} entries (train, valid, test), got {self.sizes}")
        if not config.mock:
            for split in Split:
                blend = config.blend if config.blend_per_split is None else config.blend_per_split[split.value]
                if blend is None or (config.blend_per_split is None and config.split_matrix[split.value] is None):
                    continue
                if self.sizes[split.value] is None and blend[1] is not None:
                    raise ValueError(
                        f"the {split.name} split has blend weights but no requested size: weighted blends "
                        "need a sample count (set --train-iters/--train-samples and --eval-iters)"
                    )
        if _distributed() and torch.distributed.get_rank() == 0 and not is_built_on_rank():
            raise ValueError("is_built_on_rank() must return True on global rank 0")

    def build(self) -> List[Optional[Any]]:
        """Build every split; must be called on all ranks."""
        datasets = self._build_blended_dataset_splits()
        for dataset in datasets:
            if dataset is None or len(dataset) == 0:
                continue
            if isinstance(dataset, BlendedDataset):
                if dataset.size is not None and dataset.size != len(dataset):
                    raise RuntimeError(f"BlendedDataset size {len(dataset)} != requested {dataset.size}")
            elif dataset.num_samples is not None and dataset.num_samples > len(dataset):
                raise RuntimeError(f"{type(dataset).__name__} has {len(dataset)} samples < requested {dataset.num_samples}")
        return datasets

    def _build_blended_dataset_splits(self) -> List[Optional[Any]]:
        if self.config.mock:
            return self._build_megatron_dataset_splits(None, self.config.split_matrix, self.sizes)
        if self.config.blend:
            prefixes, weights = self.config.blend
            if len(prefixes) == 1 and weights is None:
                return self._build_megatron_dataset_splits(prefixes[0], self.config.split_matrix, self.sizes)
            return self._build_blend(prefixes, weights, self.config.split_matrix, self.sizes, list(range(len(Split))))
        result: List[Optional[Any]] = [None] * len(Split)
        for i in range(len(Split)):
            blend = self.config.blend_per_split[i]
            if blend is None:
                continue
            split_spoof: List[Optional[tuple]] = [None] * len(Split)
            split_spoof[i] = (0.0, 1.0)
            sizes_spoof: List[Optional[int]] = [0] * len(Split)
            sizes_spoof[i] = self.sizes[i]
            prefixes, weights = blend
            if len(prefixes) == 1:
                result[i] = self._build_megatron_dataset_splits(prefixes[0], split_spoof, sizes_spoof)[i]
            else:
                result[i] = self._build_blend(prefixes, weights, split_spoof, sizes_spoof, [i])[i]
        return result

    def _build_blend(self, prefixes, weights, split, sizes, split_ids) -> List[Optional[Any]]:
        """Mid-level datasets for each prefix, then one BlendedDataset per split in split_ids."""
        if weights is not None:
            weights = normalize(weights)
            target = _get_size_per_split_per_dataset(weights, sizes)
            buffered = _get_size_per_split_per_dataset(weights, sizes, surplus=self.config.mid_level_dataset_surplus)
        else:
            buffered = [[None for _ in Split] for _ in prefixes]
        megatron_datasets = self._build_megatron_datasets_parallel(prefixes, split, buffered)
        blended: List[Optional[Any]] = [None] * len(Split)
        for i in split_ids:
            if split[i] is None:
                continue
            if weights is not None and sizes[i] is not None:
                weights_i = weights
                size_i = sum(target[d][i] for d in range(len(prefixes)))
            else:
                try:
                    weights_i = [len(d) for d in megatron_datasets[i]]
                except TypeError:
                    weights_i = [0 for _ in prefixes]
                size_i = min(sizes[i], sum(weights_i)) if sizes[i] is not None else None
            blended[i] = self.build_generic_dataset(
                BlendedDataset, self.is_built_on_rank, True, megatron_datasets[i], weights_i, size_i, self.config
            )
        return blended

    def _build_megatron_datasets_parallel(self, prefixes, split, sizes_per_dataset) -> List[List[Optional[Any]]]:
        """Build each prefix's splits with a thread pool; rank 0 first, then a barrier, then the rest."""
        megatron_datasets: List[List[Optional[Any]]] = [[] for _ in Split]

        def build_all(num_workers: int) -> None:
            with ThreadPoolExecutor(max_workers=max(1, num_workers)) as executor:
                futures = [
                    executor.submit(self._build_megatron_dataset_splits, prefixes[i], split, sizes_per_dataset[i], False)
                    for i in range(len(prefixes))
                ]
                for future in futures:
                    for j, dataset in enumerate(future.result()):
                        megatron_datasets[j].append(dataset)

        threads = self.config.num_dataset_builder_threads
        if _distributed():
            rank = torch.distributed.get_rank()
            if rank == 0:
                build_all(threads)
            torch.distributed.barrier()
            if rank != 0:
                build_all(threads)
        else:
            build_all(threads)
        return megatron_datasets

    def _build_megatron_dataset_splits(
        self, dataset_path: Optional[str], split, sizes, synchronize_ranks: bool = True
    ) -> List[Optional[MidLevelDataset]]:
        """The mid-level dataset of each split of one low-level dataset (split by `numel_low_level_dataset`)."""
        if _distributed() and not self.is_built_on_rank():
            for i in range(len(Split)):
                if split[i] is not None and synchronize_ranks:
                    torch.distributed.barrier()
            return [None] * len(Split)
        low_level_dataset = self.cls.build_low_level_dataset(dataset_path, self.config)
        num_elements = self.cls.numel_low_level_dataset(low_level_dataset)
        mid_level_datasets: List[Optional[MidLevelDataset]] = []
        for i, split_enum in enumerate(Split):
            if split[i] is None:
                mid_level_datasets.append(None)
                continue
            beg = int(round(split[i][0] * float(num_elements)))
            end = int(round(split[i][1] * float(num_elements)))
            indices = numpy.arange(start=beg, stop=end, step=1, dtype=numpy.int32)
            mid_level_datasets.append(
                self.build_generic_dataset(
                    self.cls, self.is_built_on_rank, synchronize_ranks,
                    low_level_dataset, dataset_path, indices, sizes[i], split_enum, self.config,
                )
            )
        return mid_level_datasets

    @staticmethod
    def build_generic_dataset(cls: Callable, is_built_on_rank: Callable, synchronize_ranks: bool, *args: Any):
        """Construct `cls(*args)`: on rank 0 first, barrier (if synchronize_ranks), then on the others."""
        if not _distributed():
            return cls(*args)
        rank = torch.distributed.get_rank()
        dataset = None
        if rank == 0 and is_built_on_rank():
            try:
                dataset = cls(*args)
            except OSError as err:
                raise OSError(
                    "Failed to write dataset indices to the cache directory: pass a writable "
                    f"--data-cache-path (config.path_to_cache) ({err})"
                ) from err
        if synchronize_ranks:
            torch.distributed.barrier()
        if rank != 0 and is_built_on_rank():
            dataset = cls(*args)
        return dataset


def _get_size_per_split_per_dataset(
    normalized_weights: List[float], target_size_per_split: List[Optional[int]], surplus: float = 0.0
) -> List[List[int]]:
    """Samples to request per dataset per split: ceil(ceil(size * w) * (1 + surplus))."""
    if not numpy.isclose(sum(normalized_weights), 1.0):
        raise ValueError(f"blend weights must be normalised, got {normalized_weights}")
    return [
        [
            int(math.ceil(math.ceil(target_size * weight) * (1 + surplus))) if target_size is not None else None
            for target_size in target_size_per_split
        ]
        for weight in normalized_weights
    ]
