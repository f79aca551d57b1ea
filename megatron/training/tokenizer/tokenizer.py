"""`build_tokenizer(args)` and the GPT-2 BPE / Null tokenizers; the other kinds live in sibling modules.

The class names (with their leading underscores) and constructor options are Megatron's: they are
written into `unique_identifiers`, which feed the dataset cache hash.
"""
import math
import os
from typing import List

import numpy

from megatron.core.datasets.megatron_tokenizer import MegatronTokenizer
from megatron.training.tokenizer.bert_tokenization import _BertWordPieceTokenizer
from megatron.training.tokenizer.gpt2_tokenization import EOD_TOKEN, GPT2BPE
from megatron.training.tokenizer.huggingface_tokenizer import _HuggingFaceTokenizer
from megatron.training.tokenizer.sentencepiece_tokenizers import (
    NoClsSepMaskMixin,
    _GPTSentencePieceTokenizer,
    _Llama2Tokenizer,
    _SentencePieceTokenizer,
)
from megatron.training.tokenizer.tiktoken_tokenizer import (  # noqa: F401  reload_mergeable_ranks: Megatron's name here
    PATTERN_TIKTOKEN,
    PATTERN_TIKTOKEN_V2,
    CustomTikTokenizer,
    reload_mergeable_ranks,
)

__all__ = [
    "build_tokenizer",
    "_vocab_size_with_padding",
    "_BertWordPieceTokenizer",
    "_GPT2BPETokenizer",
    "_SentencePieceTokenizer",
    "_GPTSentencePieceTokenizer",
    "_Llama2Tokenizer",
    "_HuggingFaceTokenizer",
    "CustomTikTokenizer",
    "reload_mergeable_ranks",
    "_NullTokenizer",
    "_NullMultimodalTokenizer",
]

TOKENIZER_TYPES = (
    "BertWordPieceLowerCase",
    "BertWordPieceCase",
    "GPT2BPETokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "HuggingFaceTokenizer",
    "Llama2Tokenizer",
    "TikTokenizer",
    "NullTokenizer",
    "NullMultimodalTokenizer",
    "SFTTokenizer",
)


def _require(args, problems: List[str], *flags: str) -> None:
    for flag in flags:
        if getattr(args, flag.lstrip("-").replace("-", "_"), None) is None:
            problems.append(f"--tokenizer-type {args.tokenizer_type} needs {flag}")


def _construct(args, **kwargs) -> MegatronTokenizer:
    """Instantiate the tokenizer named by args.tokenizer_type (raises one ValueError listing every gap)."""
    kind = args.tokenizer_type
    problems: List[str] = []
    needs = {
        "BertWordPieceLowerCase": ("--vocab-file",),
        "BertWordPieceCase": ("--vocab-file",),
        "GPT2BPETokenizer": ("--vocab-file", "--merge-file"),
        "SentencePieceTokenizer": ("--tokenizer-model",),
        "GPTSentencePieceTokenizer": ("--tokenizer-model",),
        "HuggingFaceTokenizer": ("--tokenizer-model",),
        "Llama2Tokenizer": ("--tokenizer-model",),
        "TikTokenizer": ("--tokenizer-model",),
        "NullTokenizer": ("--vocab-size",),
        "NullMultimodalTokenizer": ("--vocab-size",),
        "SFTTokenizer": ("--tokenizer-model",),
    }
    if kind not in needs:
        raise ValueError(
            f"--tokenizer-type {kind!r} is not supported here; choose one of {', '.join(TOKENIZER_TYPES)}"
        )
    _require(args, problems, *needs[kind])
    extra_ids = getattr(args, "vocab_extra_ids", 0) or 0
    if kind == "TikTokenizer" and getattr(args, "tiktoken_pattern", None) not in ("v1", "v2"):
        problems.append(f"--tiktoken-pattern must be v1 or v2 for TikTokenizer, got {getattr(args, 'tiktoken_pattern', None)!r}")
    if problems:
        raise ValueError("tokenizer arguments: " + "; ".join(problems))
    if kind in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        return _BertWordPieceTokenizer(args.vocab_file, lower_case=kind == "BertWordPieceLowerCase", vocab_extra_ids=extra_ids)
    if kind == "GPT2BPETokenizer":
        return _GPT2BPETokenizer(args.vocab_file, args.merge_file)
    if kind == "SentencePieceTokenizer":
        return _SentencePieceTokenizer(args.tokenizer_model, vocab_extra_ids=extra_ids)
    if kind == "GPTSentencePieceTokenizer":
        return _GPTSentencePieceTokenizer(args.tokenizer_model)
    if kind == "HuggingFaceTokenizer":
        return _HuggingFaceTokenizer(args.tokenizer_model, **kwargs)
    if kind == "Llama2Tokenizer":
        return _Llama2Tokenizer(args.tokenizer_model)
    if kind == "TikTokenizer":
        return CustomTikTokenizer(
            path=args.tokenizer_model,
            pattern=PATTERN_TIKTOKEN if args.tiktoken_pattern == "v1" else PATTERN_TIKTOKEN_V2,
            vocab_size=getattr(args, "vocab_size", None),
            num_special_tokens=getattr(args, "tiktoken_num_special_tokens", 1000),
            special_tokens=getattr(args, "tiktoken_special_tokens", None),
        )
    if kind == "SFTTokenizer":
        from megatron.training.tokenizer.sft_tokenizer import SFTTokenizer

        return SFTTokenizer(args.tokenizer_model, getattr(args, "sft_tokenizer_prompt_format", "nemotron-h-aligned"))
    if kind == "NullMultimodalTokenizer":
        return _NullMultimodalTokenizer(args.vocab_size)
    return _NullTokenizer(args.vocab_size)


def build_tokenizer(args, **kwargs) -> MegatronTokenizer:
    """Build the tokenizer for `args` and set `args.padded_vocab_size` unless it is already set."""
    rank = getattr(args, "rank", 0) or 0
    if rank == 0:
        print(f"> building {args.tokenizer_type} tokenizer ...", flush=True)
    tokenizer = _construct(args, **kwargs)
    if getattr(args, "padded_vocab_size", None) is None:
        args.padded_vocab_size = _vocab_size_with_padding(tokenizer.vocab_size, args)
    return tokenizer


def _vocab_size_with_padding(orig_vocab_size: int, args, logging_enabled: bool = True) -> int:
    """Round the vocab up to a multiple of make_vocab_size_divisible_by * tensor_model_parallel_size."""
    divisible_by = getattr(args, "make_vocab_size_divisible_by", 128) or 1
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    multiple = divisible_by * tp
    after = int(math.ceil(orig_vocab_size / multiple) * multiple)
    if (getattr(args, "rank", 0) or 0) == 0 and logging_enabled:
        print(
            f" > padded vocab (size: {orig_vocab_size}) with {after - orig_vocab_size} dummy tokens "
            f"(new size: {after})",
            flush=True,
        )
    return after


class _GPT2BPETokenizer(MegatronTokenizer):
    """GPT-2 byte-level BPE (`--vocab-file` vocab.json, `--merge-file` merges.txt); no pad token."""

    def __init__(self, vocab_file: str, merge_file: str):
        super().__init__(vocab_file, merge_file)
        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not _is_file(path):
                raise FileNotFoundError(f"{flag} {path}: file not found")
        self.tokenizer = GPT2BPE(vocab_file, merge_file)
        if EOD_TOKEN not in self.tokenizer.encoder:
            raise ValueError(f"--vocab-file {vocab_file}: has no {EOD_TOKEN} token; it is not a GPT-2 vocab.json")
        self.eod_id = self.tokenizer.encoder[EOD_TOKEN]

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer.encoder)

    @property
    def vocab(self):
        return self.tokenizer.encoder

    @property
    def inv_vocab(self):
        return self.tokenizer.decoder

    def tokenize(self, text: str) -> List[int]:
        return self.tokenizer.encode(text)

    def tokenize_batch(self, texts: List[str]) -> List[List[int]]:
        """Token ids of many texts (fast path used by tools/preprocess_data.py)."""
        return self.tokenizer.encode_batch(texts)

    def tokenize_batch_numpy(self, texts: List[str]) -> List[numpy.ndarray]:
        """Token ids of many texts as numpy arrays (the preprocessing fast path)."""
        return self.tokenizer.encode_batch_numpy(texts)

    def detokenize(self, token_ids) -> str:
        return self.tokenizer.decode(token_ids)

    @property
    def eod(self) -> int:
        return self.eod_id


class _NullTokenizer(NoClsSepMaskMixin, MegatronTokenizer):
    """Text is whitespace-separated integer ids; eod = vocab_size and the vocab reports vocab_size + 1."""

    def __init__(self, vocab_size: int):
        super().__init__(None, vocab_size=vocab_size)
        self._vocab_size_without_eod = int(vocab_size)
        self._eod_id = int(vocab_size)

    def tokenize(self, text: str) -> List[int]:
        return [int(x) for x in text.split(" ")]

    def detokenize(self, ids) -> str:
        return " ".join(str(int(x)) for x in numpy.asarray(ids).reshape(-1))  # [...] -> [n]

    def offsets(self, ids: list, text: str) -> list:
        offsets, start = [], 0
        for id_ in ids:
            offsets.append(start)
            start += 1 + len(str(id_))
        return offsets

    @property
    def vocab_size(self) -> int:
        return self._vocab_size_without_eod + 1

    @property
    def vocab(self):
        raise NotImplementedError("_NullTokenizer has no vocab")

    @property
    def inv_vocab(self):
        raise NotImplementedError("_NullTokenizer has no inv_vocab")

    @property
    def eod(self):
        return self._eod_id

    @property
    def additional_special_tokens_ids(self):
        return None


# LLaVA's image placeholder token and its id (Megatron's multimodal defaults).
IMAGE_TOKEN = "<image>"
DEFAULT_IMAGE_TOKEN_INDEX = -200


class _NullMultimodalTokenizer(_NullTokenizer):
    """`_NullTokenizer` for multimodal data: `convert_tokens_to_ids` also maps the image placeholder
    (`image_token`, default `<image>`) to `image_token_id` (default -200, LLaVA's index)."""

    def __init__(self, vocab_size: int, image_token: str = None, image_token_id: int = None):
        super().__init__(vocab_size)
        self._image_token = image_token if image_token is not None else IMAGE_TOKEN
        self._image_token_id = image_token_id if image_token_id is not None else DEFAULT_IMAGE_TOKEN_INDEX

    def convert_tokens_to_ids(self, tokens: str):
        """Ids of `tokens` (integers and image placeholders separated by two spaces); one id unwrapped."""
        ids = [self._image_token_id if t == self._image_token else int(t) for t in tokens.split("  ")]
        return ids if len(ids) > 1 else ids[0]

    @property
    def eos(self) -> int:
        return self._eod_id


def _is_file(path) -> bool:
    return path is not None and os.path.isfile(path)
