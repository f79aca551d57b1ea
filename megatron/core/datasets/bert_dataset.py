"""`BERTMaskedWordPieceDataset`: Megatron's BERT samples (sentence-order pairs, 80/10/10 masking).

Per sample `idx` (row `[first, end)` of sentences with a target length), with
`RandomState((seed + idx) % 2**32)`: with the binary head the sentences split at a pivot into A and B,
swapped with probability 0.5 (`is_random`, the sentence-ORDER label); the pair is trimmed from random
ends to the target; `[CLS] A [SEP] (B [SEP])` is masked; everything is padded with the pad id.
"""
from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy

from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.masked_dataset import MaskedWordPieceDataset, MaskedWordPieceDatasetConfig
from megatron.core.datasets.utils import Split


@dataclass
class BERTMaskedWordPieceDatasetConfig(MaskedWordPieceDatasetConfig):
    """Configuration of the BERT dataset."""

    classification_head: bool = None
    """Build sentence-order pairs for the binary head (`--bert-no-binary-head` turns it off)."""

    def __post_init__(self) -> None:
        """Check the BERT fields."""
        super().__post_init__()
        if self.classification_head is None:
            raise ValueError("BERTMaskedWordPieceDatasetConfig needs classification_head (True or False).")


def _trim(split_a: List[int], split_b: List[int], target: int, numpy_random_state) -> bool:
    """Delete tokens from a random end of the longer segment until the pair fits; whether any were cut."""
    if len(split_a) + len(split_b) <= target:
        return False
    while len(split_a) + len(split_b) > target:
        split = split_a if len(split_a) > len(split_b) else split_b
        if numpy_random_state.random() < 0.5:
            del split[0]
        else:
            del split[-1]
    return True


class BERTMaskedWordPieceDataset(MaskedWordPieceDataset):
    """BERT pretraining samples: keys text, types, labels, is_random, padding_mask, loss_mask, truncated."""

    def __init__(self, indexed_dataset: IndexedDataset, dataset_path: str, indexed_indices: numpy.ndarray,
                 num_samples: Optional[int], index_split: Split, config: BERTMaskedWordPieceDatasetConfig) -> None:
        super().__init__(indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config)
        self.token_lookup = list(self.config.tokenizer.inv_vocab.keys())
        # [CLS] A [SEP] B [SEP]: three special tokens; the binary head needs two sentences per sample
        self.sample_index = self._build_sample_index(self.config.sequence_length - 3,
                                                     2 if self.config.classification_head else 1)

    @staticmethod
    def _key_config_attributes() -> List[str]:
        return MaskedWordPieceDataset._key_config_attributes() + ["classification_head"]

    def _segments(self, sample: List[numpy.ndarray], numpy_random_state):
        pivot, is_next_random = len(sample), False
        if self.config.classification_head:
            if len(sample) < 2:
                raise ValueError(f"a BERT sample with the binary head needs two sentences, got {len(sample)}: "
                                 "preprocess with --split-sentences or pass --bert-no-binary-head.")
            pivot = 1
            if len(sample) >= 3:
                pivot = numpy_random_state.randint(low=1, high=len(sample))
            is_next_random = numpy_random_state.random() < 0.5
        split_a = [int(t) for sentence in sample[:pivot] for t in sentence]
        split_b = [int(t) for sentence in sample[pivot:] for t in sentence]
        if is_next_random:
            split_a, split_b = split_b, split_a
        return split_a, split_b, is_next_random

    def __getitem__(self, idx: int) -> Dict[str, numpy.ndarray]:
        idx_beg, idx_end, target_sequence_length = (int(v) for v in self.sample_index[idx])
        sample = [self.dataset[i] for i in range(idx_beg, idx_end)]
        numpy_random_state = numpy.random.RandomState(seed=(self.config.random_seed + idx) % 2**32)
        split_a, split_b, is_next_random = self._segments(sample, numpy_random_state)
        truncated = _trim(split_a, split_b, target_sequence_length, numpy_random_state)
        tokenizer = self.config.tokenizer
        tokens = [tokenizer.cls, *split_a, tokenizer.sep]
        assignments = [0] * (len(split_a) + 2)
        if split_b:
            tokens += [*split_b, tokenizer.sep]
            assignments += [1] * (len(split_b) + 1)
        tokens, masked_positions, masked_labels, _, _ = self._create_masked_lm_predictions(
            tokens, target_sequence_length, numpy_random_state)
        length = len(tokens)
        pads = self.config.sequence_length - length
        if pads < 0:
            raise ValueError(f"BERT sample {idx} has {length} tokens, more than sequence_length "
                             f"({self.config.sequence_length}).")
        pad = tokenizer.pad
        labels = numpy.full(self.config.sequence_length, -1, dtype=numpy.int64)
        labels[masked_positions] = masked_labels
        loss_mask = numpy.zeros(self.config.sequence_length, dtype=numpy.int64)
        loss_mask[masked_positions] = 1
        return {
            "text": numpy.pad(numpy.array(tokens, dtype=numpy.int64), (0, pads), constant_values=pad),
            "types": numpy.pad(numpy.array(assignments, dtype=numpy.int64), (0, pads), constant_values=pad),
            "labels": labels,
            "is_random": int(is_next_random),
            "padding_mask": numpy.pad(numpy.ones(length, dtype=numpy.int64), (0, pads), constant_values=pad),
            "loss_mask": loss_mask,
            "truncated": int(truncated),
        }

    def _get_token_mask(self, numpy_random_state: numpy.random.RandomState) -> Optional[int]:
        """80% [MASK], 10% a random vocabulary id, 10% unchanged (None)."""
        if numpy_random_state.random() < 0.8:
            return self.config.tokenizer.mask
        if numpy_random_state.random() >= 0.5:
            return self.token_lookup[numpy_random_state.randint(0, len(self.token_lookup))]
        return None


__all__ = ["BERTMaskedWordPieceDataset", "BERTMaskedWordPieceDatasetConfig"]
