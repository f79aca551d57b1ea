"""Pretraining data loaders: Megatron's batch samplers and `build_pretraining_data_loader`.

`MegatronPretrainingSampler` (`--dataloader-type single`) walks global sample ids from
`consumed_samples` upward in chunks of micro_batch_size * DP; DP rank r takes chunk[r*mbs:(r+1)*mbs].
`MegatronPretrainingRandomSampler` (`cyclic`) reshuffles each epoch with `torch.randperm` seeded by the
epoch number. Both resume exactly at `consumed_samples`, so a restarted run sees the samples it would
have seen.
"""
from typing import Iterator, List, Optional

import torch

from megatron.core import parallel_state
from megatron.core.datasets.utils import Split
from megatron.training.dist_signal_handler import DistributedSignalHandler
from megatron.training.global_vars import get_args


def _check_sampler_args(total_samples, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size) -> None:
    problems = []
    if total_samples <= 0:
        problems.append(f"the dataset has no samples (total_samples={total_samples})")
    if consumed_samples >= total_samples:
        problems.append(
            f"consumed_samples ({consumed_samples}) >= total_samples ({total_samples}): the run already used "
            "every sample; build more samples (raise --train-iters/--train-samples) or start over"
        )
    if micro_batch_size <= 0:
        problems.append(f"--micro-batch-size ({micro_batch_size}) must be > 0")
    if data_parallel_size <= 0 or not 0 <= data_parallel_rank < data_parallel_size:
        problems.append(f"data parallel rank {data_parallel_rank} is not in [0, {data_parallel_size})")
    if problems:
        raise ValueError("data sampler: " + "; ".join(problems))


class MegatronPretrainingSampler:
    """Sequential batch sampler (`--dataloader-type single`)."""

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        drop_last: bool = True,
    ):
        _check_sampler_args(total_samples, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size)
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        return self.total_samples

    def get_start_end_idx(self):
        """This rank's slice of a global chunk."""
        start_idx = self.data_parallel_rank * self.micro_batch_size
        return start_idx, start_idx + self.micro_batch_size

    def __iter__(self) -> Iterator[List[int]]:
        chunk = self.micro_batch_times_data_parallel_size
        start, end = self.get_start_end_idx()
        first = self.consumed_samples
        full_end = first + (self.total_samples - first) // chunk * chunk
        for base in range(first, full_end, chunk):
            yield list(range(base + start, base + end))
        if full_end < self.total_samples and not self.drop_last:
            yield list(range(full_end, self.total_samples))[start:end]


class MegatronPretrainingRandomSampler:
    """Shuffled batch sampler (`--dataloader-type cyclic`); optional per-rank buckets (`--data-sharding`)."""

    def __init__(
        self,
        dataset,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        data_sharding: bool,
    ):
        _check_sampler_args(total_samples, max(consumed_samples, 0) % max(total_samples, 1), micro_batch_size,
                            data_parallel_rank, data_parallel_size)
        self.dataset = dataset
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.data_sharding = data_sharding
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.last_batch_size = total_samples % self.micro_batch_times_data_parallel_size

    def __len__(self) -> int:
        return self.total_samples

    def __iter__(self) -> Iterator[List[int]]:
        active_total_samples = self.total_samples - self.last_batch_size
        if active_total_samples <= 0:
            raise ValueError(
                f"cyclic sampler: {self.total_samples} samples are fewer than one global micro-batch "
                f"({self.micro_batch_times_data_parallel_size})"
            )
        self.epoch = self.consumed_samples // active_total_samples
        current_epoch_samples = self.consumed_samples % active_total_samples
        if current_epoch_samples % self.micro_batch_times_data_parallel_size != 0:
            raise ValueError(
                f"consumed_samples ({self.consumed_samples}) is not a multiple of micro-batch * DP "
                f"({self.micro_batch_times_data_parallel_size}) within the epoch"
            )
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(self.epoch)
        generator = torch.Generator()
        generator.manual_seed(self.epoch)
        if self.data_sharding:
            bucket_size = (self.total_samples // self.micro_batch_times_data_parallel_size) * self.micro_batch_size
            bucket_offset = current_epoch_samples // self.data_parallel_size
            start_idx = self.data_parallel_rank * bucket_size
            random_idx = torch.randperm(bucket_size, generator=generator).tolist()
            idx_range = [start_idx + x for x in random_idx[bucket_offset:]]
        else:
            full_bucket_size = (self.total_samples // self.micro_batch_size) * self.micro_batch_size
            idx_range_total = torch.randperm(full_bucket_size, generator=generator).tolist()
            idx_range = idx_range_total[current_epoch_samples:][self.data_parallel_rank :: self.data_parallel_size]
        batch = []
        for idx in idx_range:
            batch.append(idx)
            if len(batch) == self.micro_batch_size:
                self.consumed_samples += self.micro_batch_times_data_parallel_size
                yield batch
                batch = []


def _dataset_split(dataset) -> Optional[Split]:
    for name in ("split", "index_split"):
        value = getattr(dataset, name, None)
        if isinstance(value, Split):
            return value
    return None


def _worker_init_fn(exit_signal):
    def init(_worker_id: int) -> None:
        handler = DistributedSignalHandler(exit_signal) if exit_signal is not None else DistributedSignalHandler()
        handler.__enter__()

    return init


def build_pretraining_data_loader(dataset, consumed_samples: int):
    """A DataLoader over `dataset` resuming at `consumed_samples` (None when dataset is None).

    Reads `--dataloader-type`, `--micro-batch-size`, `--num-workers` and `--data-sharding` from the
    global args, and the DP rank/size from parallel_state. `external` returns the dataset itself.
    """
    if dataset is None:
        return None
    args = get_args()
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    dataloader_type = getattr(args, "dataloader_type", None) or "single"
    full_validation = getattr(args, "full_validation", False) and _dataset_split(dataset) == Split.valid
    if full_validation:
        batch_sampler = MegatronPretrainingSampler(len(dataset), 0, args.micro_batch_size, dp_rank, dp_size)
    elif dataloader_type == "single":
        batch_sampler = MegatronPretrainingSampler(len(dataset), consumed_samples, args.micro_batch_size, dp_rank, dp_size)
    elif dataloader_type == "cyclic":
        batch_sampler = MegatronPretrainingRandomSampler(
            dataset, len(dataset), consumed_samples, args.micro_batch_size, dp_rank, dp_size,
            getattr(args, "data_sharding", True),
        )
    elif dataloader_type == "external":
        return dataset
    else:
        raise ValueError(f"--dataloader-type {dataloader_type!r} is not one of single, cyclic, external")
    num_workers = getattr(args, "num_workers", 0) or 0
    worker_init = None
    if getattr(args, "exit_signal_handler", False) and num_workers > 0:
        worker_init = _worker_init_fn(getattr(args, "exit_signal", None))
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=batch_sampler,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=num_workers > 0,
        worker_init_fn=worker_init,
    )
