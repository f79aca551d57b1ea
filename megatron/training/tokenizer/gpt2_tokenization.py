"""GPT-2 byte-level BPE from `vocab.json` + `merges.txt`, encoded by a fast native library.

Design note (speed and identity): encoding goes through `tiktoken` when the files have GPT-2's
layout (ids 0-255 are the 256 single bytes, merge m produces id 256+m), because tiktoken's rank-ordered
BPE is then exactly GPT-2's and ~10x faster than `tokenizers` on one thread. Any other vocabulary
uses the Rust `tokenizers` BPE with GPT-2's byte-level pre-tokenizer. Both give GPT-2's ids; the
tests compare them on random text.
"""
import json
import logging
import os
from functools import lru_cache
from typing import Dict, List, Optional, Tuple

import numpy

# GPT-2's pre-tokenisation regex (identical in tiktoken's r50k_base and in `tokenizers` ByteLevel).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
EOD_TOKEN = "<|endoftext|>"

# Megatron's (and the original pytorch-pretrained-bert's) download locations of GPT-2's files. Nothing here
# downloads them: they are kept because user code reads these tables to find the file names of a model.
PRETRAINED_VOCAB_ARCHIVE_MAP = {"gpt2": "https://s3.amazonaws.com/models.huggingface.co/bert/gpt2-vocab.json"}
PRETRAINED_MERGES_ARCHIVE_MAP = {"gpt2": "https://s3.amazonaws.com/models.huggingface.co/bert/gpt2-merges.txt"}
PRETRAINED_VOCAB_POSITIONAL_EMBEDDINGS_SIZE_MAP = {"gpt2": 1024}
VOCAB_NAME = "vocab.json"
MERGES_NAME = "merges.txt"
SPECIAL_TOKENS_NAME = "special_tokens.txt"


@lru_cache(maxsize=1)
def bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def read_vocab_and_merges(vocab_file: str, merge_file: str) -> Tuple[Dict[str, int], List[Tuple[str, str]]]:
    """Load vocab.json and merges.txt (skipping a `#version` header line and blank lines)."""
    with open(vocab_file, encoding="utf-8") as stream:
        encoder = json.load(stream)
    if not isinstance(encoder, dict):
        raise ValueError(f"{vocab_file}: expected a JSON object mapping tokens to ids (GPT-2 vocab.json)")
    with open(merge_file, encoding="utf-8") as stream:
        lines = stream.read().split("\n")
    if lines and lines[0].startswith("#version"):
        lines[0] = ""
    merges = [tuple(line.split(" ")) for line in lines if line]
    if any(len(pair) != 2 for pair in merges):
        bad = next(i for i, line in enumerate(lines, 1) if line and len(line.split(" ")) != 2)
        raise ValueError(f"{merge_file}:{bad}: a merge line must hold two tokens separated by one space")
    return encoder, merges


def get_pairs(word) -> set:
    """The set of adjacent symbol pairs of `word` (a tuple of symbols), the candidates of the next BPE merge."""
    return set(zip(word[:-1], word[1:]))


@lru_cache(maxsize=1)
def unicode_to_bytes() -> Dict[str, int]:
    """Inverse of `bytes_to_unicode`."""
    return {c: b for b, c in bytes_to_unicode().items()}


@lru_cache(maxsize=1)
def _to_latin1_table() -> Dict[int, int]:
    """str.translate table from GPT-2's byte characters to the latin-1 character of the same byte."""
    return {ord(c): b for c, b in unicode_to_bytes().items()}


def token_bytes(token: str) -> bytes:
    """The raw bytes a GPT-2 vocab string stands for (one C-level translate, fast for 50k tokens)."""
    return token.translate(_to_latin1_table()).encode("latin-1")


def _has_gpt2_layout(encoder: Dict[str, int], merges: List[Tuple[str, str]]) -> bool:
    byte_chars = bytes_to_unicode()
    if sorted(encoder.get(byte_chars[b], -1) for b in range(256)) != list(range(256)):
        return False
    return all(encoder.get(a + b) == 256 + m for m, (a, b) in enumerate(merges))


def build_fast_encoder(encoder: Dict[str, int], merges: List[Tuple[str, str]]):
    """An object with `encode_ordinary_batch`/`encode_ordinary`, or None when no fast path applies."""
    try:
        import tiktoken
    except ImportError:
        return None
    if not _has_gpt2_layout(encoder, merges):
        return None
    table = _to_latin1_table()
    limit = 256 + len(merges)
    ranks = {token.translate(table).encode("latin-1"): rank for token, rank in encoder.items() if rank < limit}
    specials = {EOD_TOKEN: encoder[EOD_TOKEN]} if EOD_TOKEN in encoder else {}
    return tiktoken.Encoding(name="megatron_gpt2_bpe", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens=specials)


def build_rust_tokenizer(encoder: Dict[str, int], merges: List[Tuple[str, str]]):
    """A `tokenizers.Tokenizer` doing GPT-2 byte-level BPE (no special-token parsing)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.BPE(vocab=encoder, merges=merges, fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


class GPT2BPE:
    """GPT-2 BPE encoder/decoder over vocab.json + merges.txt.

    Args:
        vocab_file: GPT-2 `vocab.json`.
        merge_file: GPT-2 `merges.txt`.
    """

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        self.encoder, merges = read_vocab_and_merges(vocab_file, merge_file)
        self.decoder = {v: k for k, v in self.encoder.items()}
        self._fast = build_fast_encoder(self.encoder, merges)
        self._rust = None if self._fast is not None else build_rust_tokenizer(self.encoder, merges)
        self._byte_decoder = {c: b for b, c in bytes_to_unicode().items()}

    def encode(self, text: str) -> List[int]:
        """Token ids of `text` (special-token strings are encoded as plain text, like Megatron)."""
        if self._fast is not None:
            return self._fast.encode_ordinary(text)
        return self._rust.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: List[str], num_threads: Optional[int] = None) -> List[List[int]]:
        """Token ids of many texts at once."""
        if self._fast is not None:
            if num_threads and num_threads > 1:
                return self._fast.encode_ordinary_batch(texts, num_threads=num_threads)
            encode = self._fast.encode_ordinary
            return [encode(t) for t in texts]
        return [e.ids for e in self._rust.encode_batch(texts, add_special_tokens=False)]

    def encode_batch_numpy(self, texts: List[str]) -> List[numpy.ndarray]:
        """Token ids of many texts as int64 arrays (avoids building Python int lists on the fast path)."""
        if self._fast is not None:
            encode = self._fast.encode_to_numpy
            return [encode(t, allowed_special=set(), disallowed_special=()) for t in texts]
        return [numpy.asarray(e.ids, dtype=numpy.int64) for e in self._rust.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: List[int]) -> str:
        """Text of `ids` (invalid UTF-8 replaced)."""
        data = bytearray()
        for i in ids:
            data.extend(self._byte_decoder[c] for c in self.decoder[int(i)])
        return data.decode("utf-8", errors="replace")


class GPT2Tokenizer:
    """Megatron's (pytorch-pretrained-bert's) GPT-2 tokenizer class, over the fast `GPT2BPE` encoder.

    Args:
        vocab_file: GPT-2 `vocab.json`.
        merges_file: GPT-2 `merges.txt`.
        errors: how invalid UTF-8 is decoded (`bytes.decode`'s `errors`).
        special_tokens: extra tokens given ids after the vocabulary (`set_special_tokens`).
        max_len: longest id sequence `convert_tokens_to_ids` expects (longer ones log a warning).

    `tokenize` returns the BPE pieces (vocabulary strings in GPT-2's byte-to-unicode alphabet); `encode` and
    `decode` go through the native encoder and give the same ids as Megatron's pure-Python loop.
    """

    def __init__(self, vocab_file: str, merges_file: str, errors: str = "replace", special_tokens=None,
                 max_len: Optional[int] = None):
        self.max_len = max_len if max_len is not None else int(1e12)
        self._bpe = GPT2BPE(vocab_file, merges_file)
        self.encoder = self._bpe.encoder
        self.decoder = self._bpe.decoder
        self.errors = errors
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = unicode_to_bytes()
        _, merges = read_vocab_and_merges(vocab_file, merges_file)
        self.bpe_ranks = {merge: rank for rank, merge in enumerate(merges)}
        self.cache: Dict[str, str] = {}
        self.special_tokens: Dict[str, int] = {}
        self.special_tokens_decoder: Dict[int, str] = {}
        self.set_special_tokens(special_tokens)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str, cache_dir: Optional[str] = None, *inputs, **kwargs):
        """Load from a directory holding `vocab.json` and `merges.txt` (and optionally `special_tokens.txt`).

        The names of PRETRAINED_VOCAB_ARCHIVE_MAP ('gpt2') would need a download, which this library never
        does: they raise a ValueError saying to pass the directory of downloaded files instead.
        """
        if pretrained_model_name_or_path in PRETRAINED_VOCAB_ARCHIVE_MAP:
            raise ValueError(f"GPT2Tokenizer.from_pretrained({pretrained_model_name_or_path!r}) would download "
                             f"{PRETRAINED_VOCAB_ARCHIVE_MAP[pretrained_model_name_or_path]}: download "
                             f"{VOCAB_NAME} and {MERGES_NAME} yourself and pass their directory.")
        vocab_file = os.path.join(pretrained_model_name_or_path, VOCAB_NAME)
        merges_file = os.path.join(pretrained_model_name_or_path, MERGES_NAME)
        special_file = os.path.join(pretrained_model_name_or_path, SPECIAL_TOKENS_NAME)
        if "special_tokens" not in kwargs and os.path.exists(special_file):
            with open(special_file, encoding="utf-8") as stream:
                kwargs["special_tokens"] = stream.read().split("\n")[:-1]
        return cls(vocab_file, merges_file, *inputs, **kwargs)

    def __len__(self) -> int:
        return len(self.encoder) + len(self.special_tokens)

    def set_special_tokens(self, special_tokens) -> None:
        """Give `special_tokens` the ids len(vocab), len(vocab) + 1, ... (none: clear them)."""
        if not special_tokens:
            self.special_tokens, self.special_tokens_decoder = {}, {}
            return
        self.special_tokens = {token: len(self.encoder) + i for i, token in enumerate(special_tokens)}
        self.special_tokens_decoder = {i: token for token, i in self.special_tokens.items()}

    def bpe(self, token: str) -> str:
        """BPE of one pre-tokenized word (already in the byte-to-unicode alphabet), pieces joined by spaces."""
        if token in self.cache:
            return self.cache[token]
        word = tuple(token)
        pairs = get_pairs(word)
        while pairs:
            best = min(pairs, key=lambda pair: self.bpe_ranks.get(pair, float("inf")))
            if best not in self.bpe_ranks:
                break
            merged, i = [], 0
            while i < len(word):
                if i < len(word) - 1 and (word[i], word[i + 1]) == best:
                    merged.append(word[i] + word[i + 1])
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = tuple(merged)
            pairs = get_pairs(word)
        self.cache[token] = " ".join(word)
        return self.cache[token]

    def tokenize(self, text: str) -> List[str]:
        """The BPE pieces of `text`."""
        return [self.decoder[i] for i in self._bpe.encode(text)]

    def convert_tokens_to_ids(self, tokens):
        """Id of a token string, or ids of a list of them (special tokens first; unknown pieces get 0)."""
        if isinstance(tokens, str):
            return self.special_tokens.get(tokens, self.encoder.get(tokens, 0))
        ids = [self.special_tokens.get(t, self.encoder.get(t, 0)) for t in tokens]
        if len(ids) > self.max_len:
            logging.getLogger(__name__).warning(
                "Token indices sequence length is longer than the specified maximum sequence length for this "
                "OpenAI GPT model (%d > %d). Running this sequence through the model will result in indexing errors",
                len(ids), self.max_len)
        return ids

    def convert_ids_to_tokens(self, ids, skip_special_tokens: bool = False) -> List[str]:
        """Token strings of `ids` (special tokens dropped with `skip_special_tokens`)."""
        tokens = []
        for i in ids:
            if i in self.special_tokens_decoder:
                if not skip_special_tokens:
                    tokens.append(self.special_tokens_decoder[i])
            else:
                tokens.append(self.decoder[i])
        return tokens

    def encode(self, text: str) -> List[int]:
        """Ids of `text`."""
        return self._bpe.encode(text)

    def decode(self, tokens: List[int]) -> str:
        """Text of vocabulary ids `tokens`."""
        text = "".join(self.decoder[int(t)] for t in tokens)
        return bytearray(self.byte_decoder[c] for c in text).decode("utf-8", errors=self.errors)

    def save_vocabulary(self, vocab_path: str):
        """Write vocab.json, merges.txt and special_tokens.txt into the directory `vocab_path`; return their paths."""
        if not os.path.isdir(vocab_path):
            raise ValueError(f"GPT2Tokenizer.save_vocabulary: {vocab_path!r} is not a directory")
        vocab_file = os.path.join(vocab_path, VOCAB_NAME)
        merge_file = os.path.join(vocab_path, MERGES_NAME)
        special_file = os.path.join(vocab_path, SPECIAL_TOKENS_NAME)
        with open(vocab_file, "w", encoding="utf-8") as stream:
            json.dump(self.encoder, stream, ensure_ascii=False)
        with open(merge_file, "w", encoding="utf-8") as stream:
            stream.write("#version: 0.2\n")
            for (a, b), _ in sorted(self.bpe_ranks.items(), key=lambda item: item[1]):
                stream.write(f"{a} {b}\n")
        with open(special_file, "w", encoding="utf-8") as stream:
            for token, _ in sorted(self.special_tokens.items(), key=lambda item: item[1]):
                stream.write(token + "\n")
        return vocab_file, merge_file, special_file
