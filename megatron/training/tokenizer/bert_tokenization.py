"""BERT WordPiece (`BertWordPieceLowerCase` / `BertWordPieceCase`) over a `vocab.txt`.

`_BertWordPieceTokenizer` encodes with the Rust `tokenizers` WordPiece set up with BERT's normaliser and
pre-tokeniser (clean text, CJK splitting, accent stripping when lower-casing, punctuation splitting, 200-char
word limit), the algorithm of Google BERT's `tokenization.py` that Megatron ships as `FullTokenizer`
(`BasicTokenizer` + `WordpieceTokenizer`), which is also here, in Python, for code that uses it directly.
`[BOS]`, `[EOS]` and `<extra_id_i>` are appended to the vocab as Megatron does; eod is `[EOS]`.

Design note (text cleaning): the Rust normaliser's own cleaning also drops private-use and unassigned code
points, which BERT's keeps; so the text is cleaned here, BERT's way (`_clean_text_table`), and the Rust
normaliser's cleaning is off. A test holds the two encoders to the same tokens on random Unicode text.
"""
import collections
import os
import re
import sys
import unicodedata
from functools import lru_cache
from typing import Dict, List, Optional

from megatron.core.datasets.megatron_tokenizer import MegatronTokenizer


def load_vocab(vocab_file: str) -> Dict[str, int]:
    """vocab.txt: one token per line (stripped), id = line number; a repeated token keeps its last line's id,
    as in BERT's reader."""
    vocab = collections.OrderedDict()
    with open(vocab_file, encoding="utf-8") as stream:
        for index, line in enumerate(stream):
            vocab[convert_to_unicode(line).strip()] = index
    return vocab


_LOWER_CASED_MODELS = ("uncased_L-24_H-1024_A-16", "uncased_L-12_H-768_A-12", "multilingual_L-12_H-768_A-12",
                       "chinese_L-12_H-768_A-12")
_CASED_MODELS = ("cased_L-12_H-768_A-12", "cased_L-24_H-1024_A-16", "multi_cased_L-12_H-768_A-12")


def validate_case_matches_checkpoint(do_lower_case: bool, init_checkpoint: Optional[str]) -> None:
    """Raise ValueError when `do_lower_case` contradicts the casing of a Google BERT release named in
    `init_checkpoint` (`.../<model_name>/bert_model.ckpt`); other paths are not checked."""
    if not init_checkpoint:
        return
    match = re.match("^.*?([A-Za-z0-9_-]+)/bert_model.ckpt", init_checkpoint)
    if match is None:
        return
    model_name = match.group(1)
    if model_name in _LOWER_CASED_MODELS and not do_lower_case:
        actual, case_name, opposite = "False", "lowercased", "True"
    elif model_name in _CASED_MODELS and do_lower_case:
        actual, case_name, opposite = "True", "cased", "False"
    else:
        return
    raise ValueError(f"You passed in `--do_lower_case={actual}` with `--init_checkpoint={init_checkpoint}`. However, "
                     f"`{model_name}` seems to be a {case_name} model, so you should pass in "
                     f"`--do_lower_case={opposite}` so that the fine-tuning matches how the model was pre-training.")


def convert_to_unicode(text) -> str:
    """`text` as str (bytes decoded as UTF-8, undecodable bytes dropped)."""
    if isinstance(text, str):
        return text
    if isinstance(text, bytes):
        return text.decode("utf-8", "ignore")
    raise ValueError(f"Unsupported string type: {type(text)}")


def printable_text(text) -> str:
    """`text` in a form fit for printing (str on Python 3)."""
    return convert_to_unicode(text)


def convert_by_vocab(vocab, items) -> list:
    """`[vocab[item] for item in items]` (KeyError for an item not in `vocab`)."""
    return [vocab[item] for item in items]


def convert_tokens_to_ids(vocab, tokens) -> list:
    """Token strings to ids."""
    return convert_by_vocab(vocab, tokens)


def convert_ids_to_tokens(inv_vocab, ids) -> list:
    """Ids to token strings."""
    return convert_by_vocab(inv_vocab, ids)


def whitespace_tokenize(text: str) -> List[str]:
    """`text` split on runs of whitespace (no empty pieces)."""
    return text.strip().split()


def _is_whitespace(char: str) -> bool:
    """Space, tab, newline, carriage return or a Unicode space separator (Zs)."""
    return char in " \t\n\r" or unicodedata.category(char) == "Zs"


def _is_control(char: str) -> bool:
    """A control or format character (Cc, Cf), tab/newline/carriage return excepted (they are whitespace)."""
    return char not in "\t\n\r" and unicodedata.category(char) in ("Cc", "Cf")


def _is_punctuation(char: str) -> bool:
    """Any non-letter, non-digit printable ASCII character, or a Unicode punctuation character (P*)."""
    cp = ord(char)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(char).startswith("P")


@lru_cache(maxsize=None)
def _clean_text_table() -> Dict[int, Optional[str]]:
    """`str.translate` table of BERT's text cleaning: NUL, U+FFFD and control characters removed, whitespace
    characters made spaces (built once per process, ~0.2 s)."""
    table: Dict[int, Optional[str]] = {0: None, 0xFFFD: None}
    for cp in range(sys.maxunicode + 1):
        char = chr(cp)
        if _is_control(char):
            table[cp] = None
        elif _is_whitespace(char):
            table[cp] = " "
    return table


_CJK_RANGES = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F), (0x2B740, 0x2B81F),
               (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))


class BasicTokenizer:
    """Text to words: drop NUL/U+FFFD/control characters, whitespace to spaces, a space around every CJK
    ideograph, split on whitespace, lower-case and strip accents (NFD, marks removed) when `do_lower_case`,
    then split punctuation characters off as words of their own."""

    def __init__(self, do_lower_case: bool = True):
        self.do_lower_case = do_lower_case

    def tokenize(self, text) -> List[str]:
        """The words of `text`."""
        text = self._tokenize_chinese_chars(self._clean_text(convert_to_unicode(text)))
        words = []
        for token in whitespace_tokenize(text):
            if self.do_lower_case:
                token = self._run_strip_accents(token.lower())
            words.extend(self._run_split_on_punc(token))
        return whitespace_tokenize(" ".join(words))

    def _run_strip_accents(self, text: str) -> str:
        return "".join(c for c in unicodedata.normalize("NFD", text) if unicodedata.category(c) != "Mn")

    def _run_split_on_punc(self, text: str) -> List[str]:
        pieces: List[List[str]] = []
        start_new_word = True
        for char in text:
            if _is_punctuation(char):
                pieces.append([char])
                start_new_word = True
                continue
            if start_new_word:
                pieces.append([])
            start_new_word = False
            pieces[-1].append(char)
        return ["".join(piece) for piece in pieces]

    def _tokenize_chinese_chars(self, text: str) -> str:
        return "".join(f" {c} " if self._is_chinese_char(ord(c)) else c for c in text)

    def _is_chinese_char(self, cp: int) -> bool:
        """Whether code point `cp` is a CJK Unified Ideograph (the blocks BERT lists; not kana or hangul)."""
        return any(low <= cp <= high for low, high in _CJK_RANGES)

    def _clean_text(self, text: str) -> str:
        return text.translate(_clean_text_table())


class WordpieceTokenizer:
    """Words to word pieces, greedily longest-match-first: each word becomes the longest vocab prefix, then
    the longest `##`-prefixed vocab continuation, and so on; a word with an unmatched rest, or longer than
    `max_input_chars_per_word` characters, becomes `unk_token`."""

    def __init__(self, vocab, unk_token: str = "[UNK]", max_input_chars_per_word: int = 200):
        self.vocab = vocab
        self.unk_token = unk_token
        self.max_input_chars_per_word = max_input_chars_per_word

    def tokenize(self, text) -> List[str]:
        """The word pieces of the whitespace-separated words of `text`."""
        output = []
        for word in whitespace_tokenize(convert_to_unicode(text)):
            output.extend(self._pieces(word))
        return output

    def _pieces(self, word: str) -> List[str]:
        if len(word) > self.max_input_chars_per_word:
            return [self.unk_token]
        pieces, start = [], 0
        while start < len(word):
            end, piece = len(word), None
            while start < end:
                candidate = word[start:end] if start == 0 else "##" + word[start:end]
                if candidate in self.vocab:
                    piece = candidate
                    break
                end -= 1
            if piece is None:
                return [self.unk_token]
            pieces.append(piece)
            start = end
        return pieces


class FullTokenizer:
    """BERT's end-to-end tokenizer: `BasicTokenizer` then `WordpieceTokenizer` over `vocab_file`."""

    def __init__(self, vocab_file: str, do_lower_case: bool = True):
        self.vocab = load_vocab(vocab_file)
        self.inv_vocab = {v: k for k, v in self.vocab.items()}
        self.basic_tokenizer = BasicTokenizer(do_lower_case=do_lower_case)
        self.wordpiece_tokenizer = WordpieceTokenizer(vocab=self.vocab)

    def tokenize(self, text) -> List[str]:
        """Word-piece strings of `text`."""
        return [piece for word in self.basic_tokenizer.tokenize(text)
                for piece in self.wordpiece_tokenizer.tokenize(word)]

    def convert_tokens_to_ids(self, tokens) -> list:
        """Word-piece strings to ids."""
        return convert_by_vocab(self.vocab, tokens)

    def convert_ids_to_tokens(self, ids) -> list:
        """Ids to word-piece strings."""
        return convert_by_vocab(self.inv_vocab, ids)

    @staticmethod
    def convert_tokens_to_string(tokens, clean_up_tokenization_spaces: bool = True) -> str:
        """Join word pieces into text (`##` continuations glued on); optionally remove the space before
        punctuation and English contractions ("do n't" -> "don't")."""
        text = " ".join(tokens).replace(" ##", "").strip()
        if clean_up_tokenization_spaces:
            for spaced, joined in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                                   (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
                text = text.replace(spaced, joined)
        return text

    def vocab_size(self) -> int:
        """Number of vocab entries (a method, as in BERT's code)."""
        return len(self.vocab)


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
        # Megatron's attribute: the Python FullTokenizer, sharing this tokenizer's (growing) vocab
        self.tokenizer = FullTokenizer(vocab_file, do_lower_case=lower_case)
        self.tokenizer.vocab = self.tokenizer.wordpiece_tokenizer.vocab = self._vocab
        self.tokenizer.inv_vocab = self._inv_vocab
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
        return self._encoder.encode(convert_to_unicode(text).translate(_clean_text_table()),
                                    add_special_tokens=False).ids

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
    tokenizer.normalizer = normalizers.BertNormalizer(  # text cleaned beforehand, see the design note
        clean_text=False, handle_chinese_chars=True, strip_accents=lower_case, lowercase=lower_case
    )
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    return tokenizer
