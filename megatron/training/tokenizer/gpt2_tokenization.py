"""GPT-2 byte-level BPE from `vocab.json` + `merges.txt`, encoded by a fast native library.

Design note (speed and identity): encoding goes through `tiktoken` when the files have GPT-2's
layout (ids 0-255 are the 256 single bytes, merge m produces id 256+m), because tiktoken's rank-ordered
BPE is then exactly GPT-2's and ~10x faster than `tokenizers` on one thread. Any other vocabulary
uses the Rust `tokenizers` BPE with GPT-2's byte-level pre-tokenizer. Both give GPT-2's ids; the
tests compare them on random text.
"""
import json
from functools import lru_cache
from typing import Dict, List, Optional, Tuple

import numpy

# GPT-2's pre-tokenisation regex (identical in tiktoken's r50k_base and in `tokenizers` ByteLevel).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
EOD_TOKEN = "<|endoftext|>"


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
