"""`CustomTikTokenizer` (`--tokenizer-type TikTokenizer`): Megatron's JSON list of BPE ranks via tiktoken.

The first `num_special_tokens` ids are the special tokens (`<unk> <s> </s>` must be among them, the
rest are `<SPECIAL_i>` fillers); BPE ranks are shifted up by that many ids.
"""
import base64
import json
import os
from pathlib import Path
from typing import Dict, List, Optional

from megatron.core.datasets.megatron_tokenizer import MegatronTokenizer

PATTERN_TIKTOKEN = r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
PATTERN_TIKTOKEN_V2 = (
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+"
    "|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*"
    "|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)
_REQUIRED_SPECIALS = ["<unk>", "<s>", "</s>"]


def reload_mergeable_ranks(path: str, max_vocab: Optional[int] = None) -> Dict[bytes, int]:
    """Read `[{"rank", "token_bytes" (base64), "token_str"}, ...]` into tiktoken's bytes->rank map."""
    if not path.endswith(".json") or not os.path.isfile(path):
        raise FileNotFoundError(f"--tokenizer-model {path}: TikTokenizer needs an existing .json vocab file")
    with open(path, encoding="utf-8") as stream:
        vocab = json.load(stream)
    if not isinstance(vocab, list):
        raise ValueError(f"--tokenizer-model {path}: expected a JSON list of {{rank, token_bytes, token_str}}")
    if max_vocab is not None:
        vocab = vocab[:max_vocab]
    ranks: Dict[bytes, int] = {}
    for i, entry in enumerate(vocab):
        if set(entry) != {"rank", "token_bytes", "token_str"} or entry["rank"] != i:
            raise ValueError(f"--tokenizer-model {path}: entry {i} must be {{rank: {i}, token_bytes, token_str}}")
        merge = base64.b64decode(entry["token_bytes"])
        if i < 256 and merge != bytes([i]):
            raise ValueError(f"--tokenizer-model {path}: entry {i} must be the single byte {i}")
        ranks[merge] = i
    if len(ranks) != len(vocab):
        raise ValueError(f"--tokenizer-model {path}: duplicate token_bytes")
    return ranks


class CustomTikTokenizer(MegatronTokenizer):
    """tiktoken BPE with reserved special-token ids at the front."""

    def __init__(
        self,
        path: str,
        pattern: str,
        vocab_size: Optional[int],
        num_special_tokens: int,
        special_tokens: Optional[List[str]],
    ):
        super().__init__(
            path, pattern=pattern, vocab_size=vocab_size, num_special_tokens=num_special_tokens, special_tokens=special_tokens
        )
        import tiktoken

        self._vocab_size = 2**17 if vocab_size is None else vocab_size
        specials = list(_REQUIRED_SPECIALS) if special_tokens is None else list(special_tokens)
        problems = []
        if len(specials) != len(set(specials)):
            problems.append(f"--tiktoken-special-tokens has duplicates: {specials}")
        if not len(specials) <= num_special_tokens < self._vocab_size:
            problems.append(
                f"need len(--tiktoken-special-tokens) ({len(specials)}) <= --tiktoken-num-special-tokens "
                f"({num_special_tokens}) < --vocab-size ({self._vocab_size})"
            )
        if not set(_REQUIRED_SPECIALS) <= set(specials):
            problems.append(f"--tiktoken-special-tokens must include {_REQUIRED_SPECIALS}")
        if problems:
            raise ValueError("TikTokenizer: " + "; ".join(problems))
        specials += [f"<SPECIAL_{i}>" for i in range(len(specials), num_special_tokens)]
        inner = reload_mergeable_ranks(path, max_vocab=self._vocab_size - num_special_tokens)
        shifted = {t: i + num_special_tokens for t, i in inner.items()}
        special_ids = {t: i for i, t in enumerate(specials)}
        self._unk_id = special_ids["<unk>"]
        self._bos_id = special_ids["<s>"]
        self._eos_id = special_ids["</s>"]
        self._model = tiktoken.Encoding(
            name=Path(path).parent.name, pat_str=pattern, mergeable_ranks=shifted, special_tokens=special_ids
        )
        self._token_to_id = dict(shifted)
        self._token_to_id.update(special_ids)
        self._id_to_token = {v: k for k, v in self._token_to_id.items()}

    @property
    def bos(self) -> int:
        return self._bos_id

    @property
    def eos(self) -> int:
        return self._eos_id

    @property
    def unk(self) -> int:
        return self._unk_id

    @property
    def eod(self) -> int:
        return self._eos_id

    @property
    def vocab(self):
        return self._token_to_id

    @property
    def inv_vocab(self):
        return self._id_to_token

    def tokenize(self, s: str, bos: bool = False, eos: bool = False) -> List[int]:
        tokens = self._model.encode_ordinary(s)
        if bos:
            tokens = [self.bos, *tokens]
        if eos:
            tokens = [*tokens, self.eos]
        return tokens

    def tokenize_batch(self, texts: List[str]) -> List[List[int]]:
        """Encode many texts at once."""
        return self._model.encode_ordinary_batch(texts, num_threads=1)

    def detokenize(self, tokens: List[int]) -> str:
        return self._model.decode([int(t) for t in tokens])

    def offsets(self, ids: list, text: str) -> list:
        return self._model.decode_with_offsets([int(i) for i in ids])[1]

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def encoder(self):
        return self._token_to_id

    @property
    def decoder(self):
        return self._id_to_token
