"""`_HuggingFaceTokenizer`: a `transformers` tokenizer loaded from a local directory (never the hub)."""
import os
from typing import List

from megatron.core.datasets.megatron_tokenizer import MegatronTokenizer


class _HuggingFaceTokenizer(MegatronTokenizer):
    """`tokenize` = `tokenizer(text).input_ids` (includes the tokenizer's default specials); eod = eos."""

    def __init__(self, pretrained_model_name_or_path: str, **kwargs):
        super().__init__(pretrained_model_name_or_path, **kwargs)
        if pretrained_model_name_or_path is None or not os.path.isdir(pretrained_model_name_or_path):
            raise FileNotFoundError(
                f"--tokenizer-model {pretrained_model_name_or_path}: HuggingFaceTokenizer needs a local "
                "directory (with tokenizer.json or vocab files); hub downloads are not used"
            )
        import transformers

        self._tokenizer = transformers.AutoTokenizer.from_pretrained(
            pretrained_model_name_or_path=pretrained_model_name_or_path, local_files_only=True, **kwargs
        )
        self._vocab = self._tokenizer.get_vocab()
        self._inv_vocab = {token_id: token for token, token_id in self._vocab.items()}

    @property
    def vocab_size(self) -> int:
        return len(self._tokenizer)

    @property
    def vocab(self):
        return self._vocab

    @property
    def inv_vocab(self):
        return self._inv_vocab

    @property
    def decoder(self):
        return self._inv_vocab

    def tokenize(self, text: str, **kwargs) -> List[int]:
        return self._tokenizer(text, **kwargs).input_ids

    def detokenize(self, token_ids, **kwargs) -> str:
        return self._tokenizer.decode(token_ids, **kwargs)

    def offsets(self, ids: list, text: str) -> list:
        retok = self._tokenizer(text)
        offsets, next_start = [], 0
        for i in range(len(ids)):
            span = retok.token_to_chars(i)
            if span is not None:
                offsets.append(span.start)
                next_start = span.end
            else:
                offsets.append(next_start)
        return offsets

    @property
    def eod(self):
        return self._tokenizer.eos_token_id

    @property
    def bos(self):
        return self._tokenizer.bos_token_id

    @property
    def eos(self):
        return self._tokenizer.eos_token_id

    @property
    def mask(self):
        return self._tokenizer.mask_token_id
