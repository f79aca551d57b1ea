"""`MegatronTokenizer`: the abstract tokenizer every dataset and training tokenizer derives from.

Its `unique_identifiers` (class name, file paths, options as strings) are serialised into the
dataset cache hash, so they must be built exactly the way Megatron builds them.
"""
import json
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Any

import numpy


class MegatronTokenizer(ABC):
    """Abstract tokenizer.

    Args:
        tokenizer_paths: the files (or directories) the tokenizer was built from.
        tokenizer_options: options that change the tokenization; stored as strings.
    """

    def __init__(self, *tokenizer_paths: str, **tokenizer_options: Any):
        self.unique_identifiers = OrderedDict()
        self.unique_identifiers["class"] = type(self).__name__
        self.unique_identifiers["tokenizer_path"] = list(tokenizer_paths)
        for option in tokenizer_options:
            self.unique_identifiers[option] = str(tokenizer_options[option])
        self.unique_description = json.dumps(self.unique_identifiers, indent=4)
        super().__init__()

    @abstractmethod
    def tokenize(self, text: str) -> numpy.ndarray:
        """Convert text to token ids."""

    def detokenize(self, ids: numpy.ndarray) -> str:
        """Convert token ids back to text."""
        raise NotImplementedError(f"{type(self).__name__} has no method 'detokenize'")

    def offsets(self, ids: list, text: str) -> list:
        """Character offset in `text` where each token of `ids` starts."""
        raise NotImplementedError(f"{type(self).__name__} has no method 'offsets'")

    @property
    @abstractmethod
    def vocab(self):
        """Dictionary from vocab text token to id."""

    @property
    @abstractmethod
    def inv_vocab(self):
        """Dictionary from vocab id to text token."""

    @property
    @abstractmethod
    def vocab_size(self):
        """The vocabulary size (unpadded)."""

    def _missing(self, name: str):
        raise NotImplementedError(f"{type(self).__name__} has no attribute '{name}'")

    @property
    def cls(self):
        """The CLS token id."""
        self._missing("cls")

    @property
    def sep(self):
        """The SEP token id."""
        self._missing("sep")

    @property
    def pad(self):
        """The PAD token id."""
        self._missing("pad")

    @property
    def eod(self):
        """The end-of-document token id."""
        self._missing("eod")

    @property
    def bos(self):
        """The beginning-of-sequence token id."""
        self._missing("bos")

    @property
    def eos(self):
        """The end-of-sequence token id."""
        self._missing("eos")

    @property
    def mask(self):
        """The MASK token id."""
        self._missing("mask")
