"""GPT datasets: `GPTDatasetConfig`, `GPTDataset` (over an `IndexedDataset`) and `MockGPTDataset`.

Design note (format compatibility): the document, sample and shuffle indices, the order in which one
`numpy.random.RandomState(random_seed)` is consumed, and the cache file names
`{md5}-GPTDataset-{split}-{document_index,sample_index,shuffle_index}.npy` + `description.txt` are
Megatron's, so a run here reads the same sample stream as Megatron and reuses its caches.
"""
import logging
import os
import time
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import numpy
import torch

from megatron.core.datasets import helpers
from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.megatron_dataset import MegatronDataset
from megatron.core.datasets.megatron_tokenizer import MegatronTokenizer
from megatron.core.datasets.utils import Split, log_single_rank

logger = logging.getLogger(__name__)

_PAD_TOKEN_ID = -1
_SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80


@dataclass
class GPTDatasetConfig(BlendedMegatronDatasetConfig):
    """Configuration of the GPT datasets."""

    reset_position_ids: Optional[bool] = None
    """Restart position ids after every EOD (`--reset-position-ids`); required."""

    reset_attention_mask: Optional[bool] = None
    """Stop attention across EOD boundaries (`--reset-attention-mask`); required."""

    eod_mask_loss: Optional[bool] = None
    """Zero the loss mask at EOD tokens (`--eod-mask-loss`); required."""

    create_attention_mask: bool = True
    """Build the [1, S, S] attention mask in the dataset (off: `--no-create-attention-mask-in-dataloader`)."""

    drop_last_partial_validation_sequence: bool = True
    """Drop the last partial sample of the validation split (otherwise it is padded)."""

    add_extra_token_to_sequence: bool = True
    """Read S+1 tokens per sample so tokens and labels both have length S."""

    object_storage_cache_path: Optional[str] = None
    """Local cache for object-storage indices (object storage is not supported here)."""

    def __post_init__(self) -> None:
        """Check the required GPT fields."""
        super().__post_init__()
        missing = [
            name
            for name in ("tokenizer", "reset_position_ids", "reset_attention_mask", "eod_mask_loss")
            if getattr(self, name) is None
        ]
        if missing:
            raise ValueError(
                f"GPTDatasetConfig needs {', '.join(missing)}: pass a tokenizer and the three bools "
                "(--reset-position-ids, --reset-attention-mask, --eod-mask-loss)"
            )


class GPTDataset(MegatronDataset):
    """The GPT dataset: fixed-length samples cut from a shuffled stream of documents.

    Args:
        indexed_dataset: the low-level dataset (sequences).
        dataset_path: its path prefix (for bookkeeping and the cache hash).
        indexed_indices: the sequence ids in this split.
        num_samples: samples to build (None: one epoch).
        index_split: the split.
        config: the GPT dataset config.
    """

    def __init__(
        self,
        indexed_dataset: IndexedDataset,
        dataset_path: Optional[str],
        indexed_indices: numpy.ndarray,
        num_samples: Optional[int],
        index_split: Split,
        config: GPTDatasetConfig,
    ) -> None:
        super().__init__(indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config)
        self.masks_and_position_ids_are_cacheable = not any(
            [config.reset_position_ids, config.reset_attention_mask, config.eod_mask_loss]
        )
        self._cached_masks = None
        try:
            self._pad_token_id = self.config.tokenizer.pad
        except Exception:
            self._pad_token_id = _PAD_TOKEN_ID
        if self._pad_token_id is None:
            self._pad_token_id = _PAD_TOKEN_ID
        self.document_index, self.sample_index, self.shuffle_index = self._build_document_sample_shuffle_indices()

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: IndexedDataset) -> int:
        """GPT splits over sequences."""
        return low_level_dataset.sequence_lengths.shape[0]

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: GPTDatasetConfig) -> IndexedDataset:
        """Open the `.bin`/`.idx` pair."""
        return IndexedDataset(dataset_path, multimodal=False, mmap=config.mmap_bin_files)

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def __getitem__(self, idx: Optional[int]) -> Dict[str, torch.Tensor]:
        """The sample dict; idx None gives a fully loss-masked padding sample."""
        text, _ = self._query_document_sample_shuffle_indices(0 if idx is None else idx)
        text = torch.from_numpy(text).long()
        if self.config.add_extra_token_to_sequence:
            tokens = text[:-1].contiguous()
            labels = text[1:].contiguous()
        else:
            tokens = text
            labels = torch.roll(text, shifts=-1, dims=0)
            labels[-1] = self._pad_token_id
        if self.masks_and_position_ids_are_cacheable and self._cached_masks is not None:
            attention_mask, loss_mask, position_ids = self._cached_masks
            loss_mask = loss_mask.clone()
        else:
            attention_mask, loss_mask, position_ids = _get_ltor_masks_and_position_ids(
                tokens,
                self.config.tokenizer.eod,
                self.config.reset_position_ids,
                self.config.reset_attention_mask,
                self.config.eod_mask_loss,
                self.config.create_attention_mask,
            )
            if self.masks_and_position_ids_are_cacheable:
                self._cached_masks = (attention_mask, loss_mask.clone(), position_ids)
        loss_mask[labels == self._pad_token_id] = 0.0
        tokens[tokens == self._pad_token_id] = 0
        labels[labels == self._pad_token_id] = 0
        if idx is None:
            loss_mask = torch.zeros_like(loss_mask)
        sample = {"tokens": tokens, "labels": labels}
        if self.config.create_attention_mask:
            sample["attention_mask"] = attention_mask
        sample["loss_mask"] = loss_mask
        sample["position_ids"] = position_ids
        return sample

    def _query_document_sample_shuffle_indices(self, idx: int) -> Tuple[numpy.ndarray, numpy.ndarray]:
        """The sample's token ids (padded to S + extra) and the document ids it touches."""
        extra = int(self.config.add_extra_token_to_sequence)
        idx = self.shuffle_index[idx]
        doc_beg, offset_beg = self.sample_index[idx]
        doc_end, offset_end = self.sample_index[idx + 1]
        document_ids, parts = [], []
        if doc_beg == doc_end:
            document_ids.append(self.document_index[doc_beg])
            parts.append(
                self.dataset.get(
                    self.document_index[doc_beg], offset=int(offset_beg), length=int(offset_end - offset_beg + extra)
                )
            )
        else:
            for i in range(doc_beg, doc_end + 1):
                document_ids.append(self.document_index[i])
                offset = 0 if i > doc_beg else int(offset_beg)
                length = None if i < doc_end else int(offset_end) + extra
                parts.append(self.dataset.get(self.document_index[i], offset=offset, length=length))
        length = sum(map(len, parts))
        wanted = self.config.sequence_length + extra
        if length < wanted:
            parts.append(numpy.full(wanted - length, self._pad_token_id, dtype=numpy.int64))
        return (
            numpy.concatenate(parts, dtype=numpy.int64),
            numpy.array(document_ids, dtype=numpy.int64),
        )

    def _cache_paths(self) -> Optional[Dict[str, str]]:
        path_to_cache = self.config.path_to_cache
        if path_to_cache is None and not self.config.mock:
            path_to_cache = os.path.join(self.dataset.path_prefix, "cache", f"{type(self).__name__}_indices")
        if not path_to_cache:
            return None
        base = f"{self.unique_description_hash}-{type(self).__name__}-{self.index_split.name}"
        affixes = ("description.txt", "document_index.npy", "sample_index.npy", "shuffle_index.npy")
        return {affix: os.path.join(path_to_cache, f"{base}-{affix}") for affix in affixes}

    def _build_document_sample_shuffle_indices(self) -> Tuple[numpy.ndarray, numpy.ndarray, numpy.ndarray]:
        """Load the three indices from the cache, or build them (global rank 0 only) and save them."""
        paths = self._cache_paths()
        cache_hit = paths is not None and all(os.path.isfile(p) for p in paths.values())
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if paths is None or (not cache_hit and (not distributed or torch.distributed.get_rank() == 0)):
            log_single_rank(logger, logging.INFO, f"Build and save the {type(self).__name__} {self.index_split.name} indices")
            self.built_anew_on_cache_miss = True
            t_beg = time.time()
            indices = self._compute_indices()
            if paths is not None:
                _save_indices(paths, self.unique_description, indices)
            log_single_rank(logger, logging.DEBUG, f"\t> time elapsed: {time.time() - t_beg:4f} seconds")
            return indices
        if not cache_hit:
            raise FileNotFoundError(
                f"{type(self).__name__} {self.index_split.name} index cache is missing on this rank "
                f"({paths['document_index.npy']}): global rank 0 must build it first (use "
                "BlendedMegatronDatasetBuilder, which orders the build with a barrier), and the cache "
                "directory must be on a file system shared by all ranks"
            )
        log_single_rank(logger, logging.INFO, f"Load the {type(self).__name__} {self.index_split.name} indices")
        return tuple(
            numpy.load(paths[a], allow_pickle=True, mmap_mode="r")
            for a in ("document_index.npy", "sample_index.npy", "shuffle_index.npy")
        )

    def _compute_indices(self) -> Tuple[numpy.ndarray, numpy.ndarray, numpy.ndarray]:
        """The build algorithm; the RNG is consumed document index first, then shuffle index."""
        extra = int(self.config.add_extra_token_to_sequence)
        sequence_length = self.config.sequence_length
        num_tokens_per_epoch = self._get_num_tokens_per_epoch()
        num_epochs = self._get_num_epochs(num_tokens_per_epoch)
        separate_final_epoch = False
        num_samples_sans_final_epoch = None
        if num_epochs > 1:
            num_samples_sans_final_epoch = ((num_epochs - 1) * num_tokens_per_epoch - extra) // sequence_length
            num_samples_from_final_epoch = self.num_samples - num_samples_sans_final_epoch
            num_samples_per_epoch = (num_tokens_per_epoch - extra) // sequence_length
            separate_final_epoch = num_samples_from_final_epoch < int(
                _SEPARATE_FINAL_EPOCH_THRESHOLD * num_samples_per_epoch
            )
        numpy_random_state = numpy.random.RandomState(self.config.random_seed)
        document_index = _build_document_index(self.indices, num_epochs, numpy_random_state, separate_final_epoch)
        drop_last = True
        if self.index_split == Split.valid:
            drop_last = self.config.drop_last_partial_validation_sequence
        sample_index = helpers.build_sample_idx(
            self.dataset.sequence_lengths,
            document_index,
            sequence_length,
            num_epochs,
            num_tokens_per_epoch,
            drop_last,
            extra,
        )
        num_built = sample_index.shape[0] - 1
        first = num_samples_sans_final_epoch if separate_final_epoch else num_built
        shuffle_index = _build_shuffle_index(first, num_built, numpy_random_state)
        log_single_rank(logger, logging.INFO, f"> total number of samples: {num_built}")
        log_single_rank(logger, logging.INFO, f"> total number of epochs: {num_epochs}")
        return document_index, sample_index, shuffle_index

    def _get_num_tokens_per_epoch(self) -> int:
        """Tokens in this split."""
        return int(numpy.sum(self.dataset.sequence_lengths[self.indices], dtype=numpy.int64))

    def _get_num_epochs(self, num_tokens_per_epoch: int) -> int:
        """Smallest E with E*T >= num_samples*S + extra (1 when num_samples is None)."""
        if self.num_samples is None:
            return 1
        if num_tokens_per_epoch <= 0:
            raise ValueError(
                f"{type(self).__name__} {self.index_split.name} split of {self.dataset_path} has no tokens "
                f"but {self.num_samples} samples were requested: check --split and the data"
            )
        requested = self.num_samples * self.config.sequence_length + int(self.config.add_extra_token_to_sequence)
        return max(1, -(-requested // num_tokens_per_epoch))


def _save_indices(paths: Dict[str, str], description: str, indices) -> None:
    """Write the cache files; each goes to a temp name first so readers never see a partial file."""
    os.makedirs(os.path.dirname(paths["description.txt"]), exist_ok=True)
    for affix, array in zip(("document_index.npy", "sample_index.npy", "shuffle_index.npy"), indices):
        tmp = paths[affix] + f".tmp{os.getpid()}.npy"
        numpy.save(tmp, array, allow_pickle=True)
        os.replace(tmp, paths[affix])
    tmp = paths["description.txt"] + f".tmp{os.getpid()}"
    with open(tmp, "wt") as writer:
        writer.write(description)
    os.replace(tmp, paths["description.txt"])


def _build_document_index(
    documents: numpy.ndarray,
    num_epochs: int,
    numpy_random_state: numpy.random.RandomState,
    separate_final_epoch: bool,
) -> numpy.ndarray:
    """The split's ids tiled num_epochs times (int32) and shuffled; a separate final epoch is shuffled on its own."""
    if not separate_final_epoch or num_epochs == 1:
        document_index = numpy.tile(numpy.asarray(documents), num_epochs).astype(numpy.int32)
        numpy_random_state.shuffle(document_index)
        return document_index
    first = _build_document_index(documents, num_epochs - 1, numpy_random_state, False)
    last = _build_document_index(documents, 1, numpy_random_state, False)
    return numpy.concatenate((first, last))


def _build_shuffle_index(num_samples: int, total_size: int, numpy_random_state: numpy.random.RandomState) -> numpy.ndarray:
    """arange(num_samples) shuffled, then arange(num_samples, total_size) shuffled separately."""
    dtype_ = numpy.uint32
    if total_size >= (numpy.iinfo(numpy.uint32).max - 1):
        dtype_ = numpy.int64
    first = numpy.arange(0, num_samples, 1, dtype=dtype_)
    numpy_random_state.shuffle(first)
    if num_samples == total_size:
        return first
    last = numpy.arange(num_samples, total_size, 1, dtype=dtype_)
    numpy_random_state.shuffle(last)
    return numpy.concatenate((first, last))


def _get_ltor_masks_and_position_ids(
    data: torch.Tensor,
    eod_token: int,
    reset_position_ids: bool,
    reset_attention_mask: bool,
    eod_mask_loss: bool,
    create_attention_mask: bool,
):
    """Causal attention mask ([1, S, S] bool, True = masked), loss mask (float) and position ids (int64)."""
    seq_length = data.numel()
    is_eod = data == eod_token
    loss_mask = torch.ones(seq_length, dtype=torch.float, device=data.device)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0
    # Document id of each position: the number of EODs strictly before it.
    doc_ids = torch.cumsum(is_eod.long(), dim=0) - is_eod.long()
    position_ids = torch.arange(seq_length, dtype=torch.long, device=data.device)
    if reset_position_ids:
        doc_start = torch.zeros(seq_length, dtype=torch.long, device=data.device)
        eod_positions = torch.nonzero(is_eod, as_tuple=False).reshape(-1)  # [k, 1] -> [k]
        starts = torch.cat([torch.zeros(1, dtype=torch.long, device=data.device), eod_positions + 1])
        doc_start = starts[doc_ids]
        position_ids = position_ids - doc_start
    attention_mask = None
    if create_attention_mask:
        allowed = torch.tril(torch.ones((seq_length, seq_length), dtype=torch.bool, device=data.device))
        if reset_attention_mask:
            allowed = allowed & (doc_ids[:, None] == doc_ids[None, :])
        attention_mask = (~allowed).unsqueeze(0)  # [S, S] -> [1, S, S]
    return attention_mask, loss_mask, position_ids


class MockGPTLowLevelDataset:
    """Synthetic documents: 100000 lengths from default_rng(0).integers(1, 4096); doc = 1..len-1, eod."""

    seed: int = 0
    """The fixed RNG seed of the lengths."""

    size: int = 100000
    """Number of synthetic documents."""

    max_sequence_length: int = 4096
    """Exclusive upper bound of the document lengths."""

    def __init__(self, tokenizer: MegatronTokenizer) -> None:
        self.tokenizer = tokenizer
        largest = self.max_sequence_length - 2
        vocab_size = getattr(tokenizer, "vocab_size", None)
        if vocab_size is not None and (vocab_size <= largest or tokenizer.eod >= vocab_size):
            raise ValueError(
                f"mock data (no --data-path) uses token ids up to {largest} plus eod ({tokenizer.eod}), but the "
                f"tokenizer vocab size is {vocab_size}: use --vocab-size {largest} or more with "
                "--tokenizer-type NullTokenizer (its vocab is --vocab-size + 1), or pass --data-path"
            )
        rng = numpy.random.default_rng(seed=self.seed)
        self.sequence_lengths = rng.integers(low=1, high=self.max_sequence_length, size=self.size, dtype=numpy.int32)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> numpy.ndarray:
        length = int(self.sequence_lengths[idx])
        return numpy.concatenate([numpy.arange(1, length, dtype=numpy.int64), [self.tokenizer.eod]]).astype(numpy.int64)

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> numpy.ndarray:
        """Slice of a synthetic document."""
        if length is None:
            length = int(self.sequence_lengths[idx]) - offset
        return self[idx][offset : offset + length]


class MockGPTDataset(GPTDataset):
    """GPTDataset over `MockGPTLowLevelDataset` (never cached)."""

    def __init__(
        self,
        dataset: MockGPTLowLevelDataset,
        dataset_path: Optional[str],
        indices: numpy.ndarray,
        num_samples: int,
        index_split: Split,
        config: GPTDatasetConfig,
    ) -> None:
        if not config.mock:
            raise ValueError("MockGPTDataset needs a mock config (no blend and no blend_per_split)")
        super().__init__(dataset, dataset_path, indices, num_samples, index_split, config)

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: MockGPTLowLevelDataset) -> int:
        """Number of synthetic documents."""
        return len(low_level_dataset)

    @staticmethod
    def build_low_level_dataset(dataset_path: Optional[str], config: GPTDatasetConfig) -> MockGPTLowLevelDataset:
        """The synthetic low-level dataset."""
        return MockGPTLowLevelDataset(config.tokenizer)
