"""BERT WordPiece (`BertWordPieceLowerCase` / `BertWordPieceCase`) over a `vocab.txt`.

Encoding uses the Rust `tokenizers` WordPiece with BERT's normaliser and pre-tokeniser (clean text,
CJK splitting, accent stripping when lower-casing, punctuation splitting, 200-char word limit), which
is the algorithm of Megatron's pure-Python `FullTokenizer`. `[BOS]`, `[EOS]` and `<extra_id_i>` are
appended to the vocab as Megatron does; eod is `[EOS]`.
"""
import collections
import os
from typing import Dict, List

from megatron.core.datasets.megatron_tokenizer import MegatronTokenizer


def load_vocab(vocab_file: str) -> Dict[str, int]:
    """vocab.txt: one token per line, id = line number."""
    vocab = collections.OrderedDict()
    with open(vocab_file, encoding="utf-8") as stream:
        for index, line in enumerate(stream):
            token = line.rstrip("\n").strip()
            if token in vocab:
                continue
            vocab[token] = index
    return vocab


class _BertWordPieceTokenizer(MegatronTokenizer):
    """BERT WordPiece tokenizer with `[BOS]`/`[EOS]` and T5 sentinels appended."""

    def __init__(self, vocab_file: str, lower_case: bool = True, vocab_extra_ids: int = 0):
        super().__init__(vocab_file, lower_case=lower_case, vocab_extra_ids=vocab_extra_ids)
        if vocab_file is None or not os.path.isfile(vocab_file):
            raise FileNotFoundError(f"--vocab-file {vocab_file}: BERT vocab.txt not found")
        self._vocab = load_vocab(vocab_file)
        missing = [t for t in ("[CLS]", "[SEP]", "[PAD]", "[MASK]", "[UNK]") if t not in self._vocab]
        if missing:
            raise ValueError(f"--vocab-file {vocab_file}: missing BERT special tokens {missing}")
        self._inv_vocab = {v: k for k, v in self._vocab.items()}
        self._encoder = _build_wordpiece(dict(self._vocab), lower_case)
        self.cls_id = self._vocab["[CLS]"]
        self.sep_id = self._vocab["[SEP]"]
        self.pad_id = self._vocab["[PAD]"]
        self.mask_id = self._vocab["[MASK]"]
        self._bos_token, self._eos_token = "[BOS]", "[EOS]"
        self.add_token(self._bos_token)
        self._bos_token_id = self._vocab[self._bos_token]
        self.add_token(self._eos_token)
        self._eos_token_id = self._vocab[self._eos_token]
        self._additional_special_tokens: List[str] = []
        self.add_additional_special_tokens([f"<extra_id_{i}>" for i in range(vocab_extra_ids)])

    def add_token(self, token: str) -> None:
        """Append `token` to the vocab unless present."""
        if token not in self._vocab:
            new_id = len(self._vocab)
            self._inv_vocab[new_id] = token
            self._vocab[token] = new_id

    def add_additional_special_tokens(self, tokens_list: List[str]) -> None:
        """Register sentinel tokens (appended to the vocab)."""
        self._additional_special_tokens = list(tokens_list)
        for token in tokens_list:
            self.add_token(token)

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def vocab(self):
        return self._vocab

    @property
    def inv_vocab(self):
        return self._inv_vocab

    def tokenize(self, text: str) -> List[int]:
        return self._encoder.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        tokens = [self._inv_vocab[int(i)] for i in ids]
        return " ".join(tokens).replace(" ##", "").strip()

    def detokenize(self, token_ids) -> str:
        return self.decode(token_ids)

    def decode_token_ids(self, token_ids) -> str:
        """Decode, dropping [PAD]/[CLS] and joining ## pieces."""
        result = ""
        for token in (self._inv_vocab[int(i)] for i in token_ids):
            if token in ("[PAD]", "[CLS]"):
                continue
            result += token[2:] if token.startswith("##") else " " + token
        return result

    @property
    def cls(self):
        return self.cls_id

    @property
    def sep(self):
        return self.sep_id

    @property
    def pad(self):
        return self.pad_id

    @property
    def mask(self):
        return self.mask_id

    @property
    def bos(self):
        return self._bos_token_id

    @property
    def eos(self):
        return self._eos_token_id

    @property
    def eod(self):
        return self.eos

    @property
    def bos_token(self):
        return self._bos_token

    @property
    def eos_token(self):
        return self._eos_token

    @property
    def additional_special_tokens(self):
        return self._additional_special_tokens

    @property
    def additional_special_tokens_ids(self):
        return [self._vocab.get(token) for token in self._additional_special_tokens]


def _build_wordpiece(vocab: Dict[str, int], lower_case: bool):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    tokenizer = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]", max_input_chars_per_word=200))
    tokenizer.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=lower_case, lowercase=lower_case
    )
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    return tokenizer
