"""`SFTDataset`: Megatron-LM's supervised fine-tuning dataset (`--sft`), one conversation per sample.

Low-level data: a JSONL file (the `--data-path` / per-split paths name the file itself) whose lines hold
`{"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}`; one conversation is one
low-level element, so `--split` takes contiguous ranges of conversations. Sample `idx` is conversation
`indices[idx % len(indices)]` (no shuffling inside the dataset; it wraps around), as in Megatron.

Sample construction with S = `--seq-length` (Megatron's `SFTDataset.__getitem__`):
1. tokens and target of the conversation (`SFTTokenizer.tokenize_conversation`), truncated to S - 1;
2. `eod` appended to both, both padded with `pad` to S + 1;
3. `tokens = t[:-1]`, `labels = target[1:]` (prompt positions hold IGNORE_INDEX = -100);
4. `loss_mask` is 1 except where the label is `pad` or -100; `position_ids = arange(S)`.
So the loss covers exactly the assistant answers and the closing eod. With `--create-attention-mask-in-
dataloader` (the default) a causal mask is added (Megatron's branch there is broken; it needs the flag off).

Packed conversations (this framework; Megatron rejects the combination): with `--reset-attention-mask`
consecutive conversations (each with its eod, each truncated to S) are packed greedily into samples of S + 1
tokens, and attention (and with `--reset-position-ids` the positions) restart after every eod, through the
same document masking as pretraining. The packing plan is built once per dataset (every conversation is
tokenized); sample `idx` is pack `idx % number of packs`.
"""
import json
from typing import Dict, List, Optional

import numpy
import torch

from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, _get_ltor_masks_and_position_ids
from megatron.core.datasets.megatron_dataset import MegatronDataset
from megatron.core.datasets.utils import Split
from megatron.training.tokenizer.sft_tokenizer import IGNORE_INDEX


class SFTLowLevelDataset:
    """The conversations of one JSONL file, in file order."""

    def __init__(self, path: str):
        self.path = path
        self.conversations: List[List[Dict[str, str]]] = []
        with open(path) as handle:
            for line_number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{line_number}: not valid JSON ({err.msg})") from None
                messages = record.get("messages") if isinstance(record, dict) else None
                if not isinstance(messages, list) or not messages:
                    raise ValueError(f"{path}:{line_number}: expected {{\"messages\": [{{\"role\": ..., "
                                     "\"content\": ...}, ...]}} with at least one message")
                self.conversations.append(messages)
        if not self.conversations:
            raise ValueError(f"{path}: no conversations (an SFT data file is JSONL with a messages list per line)")

    def __len__(self) -> int:
        return len(self.conversations)

    def __getitem__(self, idx: int) -> List[Dict[str, str]]:
        return self.conversations[idx]


class SFTDataset(MegatronDataset):
    """Megatron-LM's `SFTDataset(dataset, dataset_path, indices, num_samples, index_split, config)`."""

    def __init__(self, dataset: SFTLowLevelDataset, dataset_path: Optional[str], indices: numpy.ndarray,
                 num_samples: Optional[int], index_split: Split, config: GPTDatasetConfig) -> None:
        super().__init__(dataset, dataset_path, indices, num_samples, index_split, config)
        if config.reset_position_ids and not config.reset_attention_mask:
            raise ValueError("--sft with --reset-position-ids needs --reset-attention-mask too (it packs "
                             "conversations): add --reset-attention-mask or remove --reset-position-ids")
        if len(indices) == 0 and (num_samples or 0) > 0:
            raise ValueError(f"{dataset_path}: the {index_split.name} split has no conversations: change --split "
                             "or add conversations")
        self.packs = self._plan_packs() if config.reset_attention_mask and len(indices) else None

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: SFTLowLevelDataset) -> int:
        """Number of conversations."""
        return len(low_level_dataset)

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: GPTDatasetConfig) -> SFTLowLevelDataset:
        """Read the JSONL file `dataset_path`."""
        return SFTLowLevelDataset(dataset_path)

    def _conversation(self, position: int):
        """(tokens, target) of `indices[position]`, truncated to S - 1, each followed by eod."""
        tokenizer = self.config.tokenizer
        conversation = self.dataset[int(self.indices[position])]
        tokens, target = tokenizer.tokenize_conversation(conversation, return_target=True,
                                                         add_generation_prompt=False)
        limit = self.config.sequence_length - 1
        return (numpy.append(tokens[:limit], tokenizer.eod).astype(numpy.int64),
                numpy.append(target[:limit], tokenizer.eod).astype(numpy.int64))

    def _plan_packs(self) -> List[List[int]]:
        """Greedy packing of consecutive conversations into S + 1 token bins (lists of index positions)."""
        capacity = self.config.sequence_length + 1
        packs, current, used = [], [], 0
        for position in range(len(self.indices)):
            length = len(self._conversation(position)[0])
            if current and used + length > capacity:
                packs.append(current)
                current, used = [], 0
            current.append(position)
            used += length
        packs.append(current)
        return packs

    def __len__(self) -> int:
        if len(self.indices) == 0:
            return 0
        return self.num_samples if self.num_samples is not None else len(self.indices)

    def __getitem__(self, idx: Optional[int]) -> Dict[str, torch.Tensor]:
        """The sample dict of conversation `indices[idx % len(indices)]` (or of pack `idx % packs` with
        --reset-attention-mask); idx None: a fully masked sample."""
        tokenizer = self.config.tokenizer
        seq_length = self.config.sequence_length
        position = 0 if idx is None else idx
        if self.packs is not None:
            pieces = [self._conversation(p) for p in self.packs[position % len(self.packs)]]
        else:
            pieces = [self._conversation(position % len(self.indices))]
        tokens = numpy.concatenate([piece[0] for piece in pieces])
        target = numpy.concatenate([piece[1] for piece in pieces])
        pad = tokenizer.pad
        padding = [pad] * (seq_length + 1 - len(tokens))
        full_tokens = numpy.concatenate([tokens, padding]).astype(numpy.int64)
        full_target = numpy.concatenate([target, padding]).astype(numpy.int64)
        tokens_t = torch.from_numpy(full_tokens[:-1].copy())  # [S]
        labels_t = torch.from_numpy(full_target[1:].copy())  # [S]
        loss_mask = torch.ones(seq_length, dtype=torch.float)
        loss_mask[(labels_t == pad) | (labels_t == IGNORE_INDEX)] = 0.0
        if idx is None:
            loss_mask.zero_()
        sample = {"tokens": tokens_t, "labels": labels_t}
        reset = bool(self.config.reset_attention_mask)
        attention_mask, _, position_ids = _get_ltor_masks_and_position_ids(
            tokens_t, tokenizer.eod, bool(self.config.reset_position_ids), reset, False,
            bool(self.config.create_attention_mask))
        if self.config.create_attention_mask:
            sample["attention_mask"] = attention_mask
        sample["loss_mask"] = loss_mask
        sample["position_ids"] = position_ids
        return sample
