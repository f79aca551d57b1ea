"""`MaskedWordPieceDataset`: the shared part of the BERT and T5 datasets (Megatron's module and names).

Low-level unit: a DOCUMENT of sentences (the `.bin/.idx` written by `tools/preprocess_data.py
--split-sentences`); splits are contiguous document ranges. The sample index (`helpers.build_mapping`)
is cached as `{md5}-{class}-description.txt` / `{md5}-{class}-sample_index.npy` under `path_to_cache`
(default `<data prefix dir>/cache/{class}_indices`), built by global rank 0 and read by the others.
Masking (`_create_masked_lm_predictions`) follows Megatron draw for draw with the sample's
`numpy.random.RandomState((seed + idx) % 2**32)`, so samples equal Megatron's for the same files and flags.
"""
import logging
import os
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy
import torch

from megatron.core.datasets import helpers
from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.megatron_dataset import MegatronDataset
from megatron.core.datasets.utils import Split, log_single_rank

logger = logging.getLogger(__name__)


@dataclass
class MaskedWordPieceDatasetConfig(BlendedMegatronDatasetConfig):
    """Configuration of the masked word-piece datasets."""

    masking_probability: float = None
    """Fraction of tokens to mask (`--mask-prob`)."""

    short_sequence_probability: float = None
    """Probability of a sample shorter than the maximum (`--short-seq-prob`)."""

    masking_max_ngram: int = None
    """Longest masked n-gram (in whole words)."""

    masking_do_full_word: bool = None
    """Mask whole words: `##` pieces join the word before them."""

    masking_do_permutation: bool = None
    """Permute masked n-grams (not supported: Megatron's scripts never set it)."""

    masking_use_longer_ngrams: bool = None
    """Favour longer n-grams (reverse the 1/n probabilities)."""

    masking_use_geometric_distribution: bool = None
    """Draw n-gram lengths from Geometric(0.2) (SpanBERT) instead of 1/n."""

    def __post_init__(self) -> None:
        """Check the masking fields."""
        super().__post_init__()
        problems = []
        if self.tokenizer is None:
            problems.append("a tokenizer is required")
        for name in ("masking_probability", "short_sequence_probability"):
            value = getattr(self, name)
            if value is None or not 0.0 <= value <= 1.0:
                problems.append(f"{name} ({value}) must be a probability in [0, 1]")
        if self.masking_max_ngram is None or self.masking_max_ngram < 1:
            problems.append(f"masking_max_ngram ({self.masking_max_ngram}) must be a positive int")
        for name in ("masking_do_full_word", "masking_use_longer_ngrams", "masking_use_geometric_distribution"):
            if getattr(self, name) is None:
                problems.append(f"{name} is required (True or False)")
        if self.masking_do_permutation:
            problems.append("masking_do_permutation=True is not supported: pass False (as pretrain_bert/t5 do)")
        if problems:
            raise ValueError("invalid MaskedWordPieceDatasetConfig: " + "; ".join(problems))


class MaskedWordPieceDataset(MegatronDataset):
    """Base of `BERTMaskedWordPieceDataset` and `T5MaskedWordPieceDataset` (sample index + masking)."""

    def __init__(self, indexed_dataset: IndexedDataset, dataset_path: str, indexed_indices: numpy.ndarray,
                 num_samples: Optional[int], index_split: Split, config: MaskedWordPieceDatasetConfig) -> None:
        super().__init__(indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config)

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: IndexedDataset) -> int:
        """Number of documents."""
        return low_level_dataset.document_indices.shape[0] - 1

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: MaskedWordPieceDatasetConfig) -> IndexedDataset:
        """The sentence-level indexed dataset at `dataset_path`."""
        return IndexedDataset(dataset_path, mmap=config.mmap_bin_files)

    @staticmethod
    def _key_config_attributes() -> List[str]:
        return MegatronDataset._key_config_attributes() + [
            "masking_probability",
            "short_sequence_probability",
            "masking_max_ngram",
            "masking_do_full_word",
            "masking_do_permutation",
            "masking_use_longer_ngrams",
            "masking_use_geometric_distribution",
        ]

    def __len__(self) -> int:
        return self.sample_index.shape[0]

    def cache_paths(self) -> Tuple[str, str]:
        """(description file, sample index file) of this dataset's cache."""
        path_to_cache = self.config.path_to_cache
        if path_to_cache is None:
            path_to_cache = os.path.join(self.dataset.path_prefix, "cache", f"{type(self).__name__}_indices")
        base = os.path.join(path_to_cache, f"{self.unique_description_hash}-{type(self).__name__}-")
        return base + "description.txt", base + "sample_index.npy"

    def _build_sample_index(self, sequence_length: int, min_sentences_per_sample: int) -> numpy.ndarray:
        """The [n, 3] sample index from the cache, or built (global rank 0) and saved."""
        if len(self.indices) == 0:
            raise ValueError(
                f"{type(self).__name__}: the {self.index_split.name} split of {self.dataset_path} holds no document "
                f"(split {self.config.split!r} of {self.numel_low_level_dataset(self.dataset)} documents): give it "
                "a larger share in --split or use a larger corpus.")
        path_to_description, path_to_sample_index = self.cache_paths()
        cache_hit = all(map(os.path.isfile, (path_to_description, path_to_sample_index)))
        num_epochs = numpy.iinfo(numpy.int32).max - 1 if self.num_samples is not None else 1
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if not cache_hit and (not distributed or torch.distributed.get_rank() == 0):
            log_single_rank(logger, logging.INFO,
                            f"Build and save the {type(self).__name__} {self.index_split.name} indices")
            self.built_anew_on_cache_miss = True
            indices = numpy.append(self.indices, self.indices[-1] + 1)  # + the upper bound of the last document
            sample_index = helpers.build_mapping(
                self.dataset.document_indices[indices], self.dataset.sequence_lengths, num_epochs, self.num_samples,
                sequence_length, self.config.short_sequence_probability, self.config.random_seed, False,
                min_sentences_per_sample)
            os.makedirs(os.path.dirname(path_to_sample_index), exist_ok=True)
            with open(path_to_description, "wt") as writer:
                writer.write(self.unique_description)
            tmp = f"{path_to_sample_index}.tmp{os.getpid()}.npy"
            numpy.save(tmp, sample_index, allow_pickle=True)
            os.replace(tmp, path_to_sample_index)
            return sample_index
        if not cache_hit:
            raise FileNotFoundError(
                f"{type(self).__name__} {self.index_split.name} index cache is missing on this rank "
                f"({path_to_sample_index}): global rank 0 builds it first (BlendedMegatronDatasetBuilder orders "
                "the build with a barrier); the cache directory must be shared by all ranks")
        log_single_rank(logger, logging.INFO, f"Load the {type(self).__name__} {self.index_split.name} indices")
        return numpy.load(path_to_sample_index, allow_pickle=True, mmap_mode="r")

    def _candidates(self, token_ids: List[int]) -> List[List[int]]:
        """Positions grouped into maskable units (whole words with full-word masking); CLS/SEP excluded."""
        tokenizer = self.config.tokenizer
        special = (tokenizer.cls, tokenizer.sep)
        inv_vocab = tokenizer.inv_vocab
        candidates: List[List[int]] = []
        for i, token_id in enumerate(token_ids):
            if token_id in special:
                continue
            continuation = str(inv_vocab[token_id]).startswith("##")
            if self.config.masking_do_full_word and candidates and continuation:
                candidates[-1].append(i)
            else:
                candidates.append([i])
        return candidates

    def _ngram_length(self, numpy_random_state, nvals: numpy.ndarray, nprobs: numpy.ndarray) -> int:
        if self.config.masking_use_geometric_distribution:
            return min(int(numpy_random_state.geometric(0.2)), self.config.masking_max_ngram)  # SpanBERT, p = 0.2
        return int(numpy_random_state.choice(nvals, p=nprobs))

    def _create_masked_lm_predictions(self, token_ids: List[int], target_sequence_length: int,
                                      numpy_random_state: numpy.random.RandomState):
        """(masked ids, masked positions, original ids there, None, spans [(positions, original ids)])."""
        candidates = self._candidates(token_ids)
        n_maskings = min(self.config.masking_probability * target_sequence_length,
                         max(1, int(round(len(token_ids) * self.config.masking_probability))))
        nvals = numpy.arange(self.config.masking_max_ngram, dtype=numpy.int64) + 1
        nprobs = 1.0 / nvals
        nprobs = nprobs / nprobs.sum(keepdims=True)
        if self.config.masking_use_longer_ngrams:
            nprobs = nprobs[::-1]
        # [candidate][n - 1] -> the n candidates starting there (fewer near the end)
        candidate_ngrams = [[candidates[i : i + n] for n in nvals] for i in range(len(candidates))]
        numpy_random_state.shuffle(candidate_ngrams)
        masked_token_ids = list(token_ids)
        masked: List[Tuple[int, int]] = []
        spans = []
        masked_indices = set()
        for ngrams in candidate_ngrams:
            if len(masked) >= n_maskings:
                break
            n = self._ngram_length(numpy_random_state, nvals, nprobs)
            while True:
                ngram_indices = [index for candidate in ngrams[n - 1] for index in candidate]
                n -= 1
                if n_maskings >= len(masked) + len(ngram_indices):
                    break
                if n == 0:
                    ngram_indices = None
                    break
            if ngram_indices is None or any(index in masked_indices for index in ngram_indices):
                continue
            for index in ngram_indices:
                masked_indices.add(index)
                mask = self._get_token_mask(numpy_random_state)
                masked_token_ids[index] = token_ids[index] if mask is None else mask
                masked.append((index, token_ids[index]))
            spans.append((ngram_indices, [token_ids[index] for index in ngram_indices]))
        numpy_random_state.shuffle(candidate_ngrams)  # Megatron draws this second shuffle too
        masked.sort(key=lambda pair: pair[0])
        spans.sort(key=lambda span: span[0][0])
        return masked_token_ids, [p for p, _ in masked], [label for _, label in masked], None, spans

    def _get_token_mask(self, numpy_random_state: numpy.random.RandomState) -> Optional[int]:
        """The id replacing a masked token (None: keep it)."""
        raise NotImplementedError


__all__ = ["MaskedWordPieceDataset", "MaskedWordPieceDatasetConfig"]
