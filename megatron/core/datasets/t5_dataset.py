"""`T5MaskedWordPieceDataset`: Megatron's T5 span-corruption samples and attention masks.

Per sample (same per-index RNG as BERT): the sentences are concatenated and cut to the target length;
whole-word spans (lengths ~ Geometric(0.2), at most `masking_max_ngram`) are chosen; each span becomes the
next sentinel `<extra_id_k>` in the encoder input; the decoder reads `[BOS] (sentinel span)*` and predicts
`(sentinel span)* [EOS]`.
"""
from collections import deque
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy
import torch

from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.masked_dataset import MaskedWordPieceDataset, MaskedWordPieceDatasetConfig
from megatron.core.datasets.utils import Split


@dataclass
class T5MaskedWordPieceDatasetConfig(MaskedWordPieceDatasetConfig):
    """Configuration of the T5 dataset (`sequence_length` is the encoder length)."""

    sequence_length_encoder: Optional[int] = field(init=False, default=None)
    """Encoder sequence length (= `sequence_length`)."""

    sequence_length_decoder: int = None
    """Decoder sequence length (`--decoder-seq-length`)."""

    def __post_init__(self) -> None:
        """Check the T5 fields and set `sequence_length_encoder`."""
        super().__post_init__()
        problems = []
        if self.sequence_length_decoder is None or self.sequence_length_decoder < 2:
            problems.append(f"sequence_length_decoder ({self.sequence_length_decoder}) must be an int >= 2 "
                            "(--decoder-seq-length)")
        if not getattr(self.tokenizer, "additional_special_tokens_ids", None):
            problems.append("the tokenizer has no sentinel tokens (additional_special_tokens_ids): pass "
                            "--vocab-extra-ids (e.g. 100)")
        if problems:
            raise ValueError("invalid T5MaskedWordPieceDatasetConfig: " + "; ".join(problems))
        self.sequence_length_encoder = self.sequence_length


class T5MaskedWordPieceDataset(MaskedWordPieceDataset):
    """T5 pretraining samples: keys text_enc, text_dec, labels, loss_mask, truncated, enc_mask, dec_mask."""

    def __init__(self, indexed_dataset: IndexedDataset, dataset_path: str, indexed_indices: numpy.ndarray,
                 num_samples: Optional[int], index_split: Split, config: T5MaskedWordPieceDatasetConfig) -> None:
        super().__init__(indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config)
        # no [BOS]/[EOS] in the encoder input; two tokens of room as in Megatron
        self.sample_index = self._build_sample_index(self.config.sequence_length - 2, 1)

    @staticmethod
    def _key_config_attributes() -> List[str]:
        return MaskedWordPieceDataset._key_config_attributes() + ["sequence_length_decoder"]

    @staticmethod
    def config_attention_mask(encoder_tokens: torch.Tensor, decoder_tokens: torch.Tensor,
                              encoder_mask: torch.Tensor, decoder_mask: torch.Tensor, use_local: bool = False,
                              test_te_version: Optional[str] = None) -> Tuple:
        """(encoder, decoder, encoder-decoder) boolean masks, True = masked, from the padding masks [b, s]
        (True = padding, i.e. `enc_mask < 0.5`), as `pretrain_t5.get_batch` passes them.

        `use_local` (`--transformer-impl local`): Megatron's local form, [b, 1, s, s] masks built from the token
        ids (id 0 = pad), the decoder's ANDed with the causal history. Otherwise Megatron's Transformer Engine
        >= 1.10 form: encoder [b, 1, 1, s_enc], decoder None (the layer is causal and pads follow every real
        token) and, for the cross attention, the encoder's key mask [b, 1, 1, s_enc] (TE takes a (query, key)
        pair; the query half masks only padded decoder rows, which no loss reads). `test_te_version` is kept
        for Megatron's signature."""
        if use_local:
            enc = encoder_tokens >= 1
            dec = decoder_tokens >= 1
            causal = torch.tril(torch.ones(dec.size(1), dec.size(1), dtype=torch.bool, device=dec.device))
            enc_mask = (enc[:, None, :] & enc[:, :, None]).unsqueeze(1)  # [b, s] -> [b, 1, s, s]
            dec_mask = (dec[:, None, :] & dec[:, :, None] & causal).unsqueeze(1)  # [b, s] -> [b, 1, s, s]
            cross = (enc[:, None, :] & dec[:, :, None]).unsqueeze(1)  # -> [b, 1, s_dec, s_enc]
            return ~enc_mask, ~dec_mask, ~cross
        key_padding = encoder_mask.bool()[:, None, None, :]  # [b, s_enc] -> [b, 1, 1, s_enc]
        return key_padding, None, key_padding

    def __getitem__(self, idx: int) -> Dict[str, numpy.ndarray]:
        idx_beg, idx_end, target_sequence_length = (int(v) for v in self.sample_index[idx])
        sample = [self.dataset[i] for i in range(idx_beg, idx_end)]
        numpy_random_state = numpy.random.RandomState(seed=(self.config.random_seed + idx) % 2**32)
        tokens = [int(t) for sentence in sample for t in sentence]
        truncated = len(tokens) > target_sequence_length
        tokens = tokens[:target_sequence_length]
        tokens, _, _, _, masked_spans = self._create_masked_lm_predictions(
            tokens, target_sequence_length, numpy_random_state)
        tokenizer = self.config.tokenizer
        sentinels = deque(tokenizer.additional_special_tokens_ids)
        encoder_input, decoder_input, decoder_output = [], [tokenizer.bos], []
        start = 0
        for indices, labels in masked_spans:
            if not sentinels:
                raise ValueError(f"T5 sample {idx} has more spans than sentinels: raise --vocab-extra-ids.")
            sentinel = sentinels.popleft()
            encoder_input.extend(tokens[start : indices[0]])
            encoder_input.append(sentinel)
            decoder_input.extend([sentinel, *labels])
            decoder_output.extend([sentinel, *labels])
            start = indices[-1] + 1
        encoder_input.extend(tokens[start:])
        decoder_output.append(tokenizer.eos)
        return self._padded(idx, encoder_input, decoder_input, decoder_output, truncated)

    def _padded(self, idx, encoder_input, decoder_input, decoder_output, truncated) -> Dict[str, numpy.ndarray]:
        n_enc, n_dec = len(encoder_input), len(decoder_input)
        pads_enc = self.config.sequence_length_encoder - n_enc
        pads_dec = self.config.sequence_length_decoder - n_dec
        if pads_enc < 0 or pads_dec < 0:
            raise ValueError(f"T5 sample {idx}: encoder {n_enc} / decoder {n_dec} tokens exceed --encoder-seq-length "
                             f"({self.config.sequence_length_encoder}) / --decoder-seq-length "
                             f"({self.config.sequence_length_decoder}): raise --decoder-seq-length.")
        pad = self.config.tokenizer.pad
        loss_mask = numpy.zeros(self.config.sequence_length_decoder, dtype=numpy.int64)
        loss_mask[:n_dec] = 1
        return {
            "text_enc": numpy.pad(numpy.array(encoder_input, dtype=numpy.int64), (0, pads_enc), constant_values=pad),
            "text_dec": numpy.pad(numpy.array(decoder_input, dtype=numpy.int64), (0, pads_dec), constant_values=pad),
            "labels": numpy.pad(numpy.array(decoder_output, dtype=numpy.int64), (0, pads_dec), constant_values=-1),
            "loss_mask": loss_mask,
            "truncated": int(truncated),
            "enc_mask": numpy.array([1] * n_enc + [0] * pads_enc, dtype=numpy.int64),
            "dec_mask": numpy.array([1] * n_dec + [0] * pads_dec, dtype=numpy.int64),
        }

    def _get_token_mask(self, numpy_random_state: numpy.random.RandomState) -> Optional[int]:
        """Every masked position becomes [MASK] (no random draw)."""
        return self.config.tokenizer.mask


__all__ = ["T5MaskedWordPieceDataset", "T5MaskedWordPieceDatasetConfig"]
