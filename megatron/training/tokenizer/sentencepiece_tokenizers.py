"""SentencePiece-based tokenizers: `_SentencePieceTokenizer`, `_GPTSentencePieceTokenizer`, `_Llama2Tokenizer`."""
import os
from typing import List

from megatron.core.datasets.megatron_tokenizer import MegatronTokenizer


def _load_processor(model_file: str):
    if model_file is None or not os.path.isfile(model_file):
        raise FileNotFoundError(f"--tokenizer-model {model_file}: SentencePiece model file not found")
    import sentencepiece

    return sentencepiece.SentencePieceProcessor(model_file=model_file)


class NoClsSepMaskMixin:
    """For tokenizers without [CLS]/[SEP]/[MASK]: each reads -1, as in Megatron (list it before the base)."""

    @property
    def cls(self):
        return -1

    @property
    def sep(self):
        return -1

    @property
    def mask(self):
        return -1


class _SentencePieceTokenizer(MegatronTokenizer):
    """SentencePiece model plus `<CLS> <SEP> <EOD> <MASK>`, pad/bos/eos pieces and `<extra_id_i>` sentinels."""

    def __init__(self, model_file: str, vocab_extra_ids: int = 0):
        super().__init__(model_file, vocab_extra_ids=vocab_extra_ids)
        self.tokenizer = _load_processor(model_file)
        self._initalize(vocab_extra_ids)

    def _populate_vocab(self) -> None:
        self._vocab, self._inv_vocab = {}, {}
        for i in range(len(self.tokenizer)):
            piece = self.tokenizer.id_to_piece(i)
            self._inv_vocab[i] = piece
            self._vocab[piece] = i

    def _add_special_token(self, token: str) -> int:
        if token not in self._vocab:
            next_id = len(self._vocab)
            self._vocab[token] = next_id
            self._inv_vocab[next_id] = token
        self._special_tokens[token] = self._vocab[token]
        self._inv_special_tokens[self._vocab[token]] = token
        return self._vocab[token]

    def _piece_or(self, piece_id: int, fallback: str) -> str:
        try:
            return self.tokenizer.id_to_piece(piece_id)
        except (IndexError, RuntimeError, ValueError):
            return fallback

    def _initalize(self, vocab_extra_ids: int) -> None:
        self._populate_vocab()
        self._special_tokens, self._inv_special_tokens, self._t5_tokens = {}, {}, []
        self._cls_id = self._add_special_token("<CLS>")
        self._sep_id = self._add_special_token("<SEP>")
        self._eod_id = self._add_special_token("<EOD>")
        self._mask_id = self._add_special_token("<MASK>")
        self._pad_id = self._add_special_token(self._piece_or(self.tokenizer.pad_id(), "<PAD>"))
        self._bos_id = self._add_special_token(self._piece_or(self.tokenizer.bos_id(), "<BOS>"))
        self._eos_id = self._add_special_token(self._piece_or(self.tokenizer.eos_id(), "<EOS>"))
        for i in range(vocab_extra_ids):
            token = f"<extra_id_{i}>"
            self._add_special_token(token)
            self._t5_tokens.append(token)

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def vocab(self):
        return self._vocab

    @property
    def inv_vocab(self):
        return self._inv_vocab

    @property
    def decoder(self):
        return self._inv_vocab

    @property
    def encoder(self):
        return self._vocab

    def tokenize(self, text: str) -> List[int]:
        """Encode, mapping literal special-token strings in the text to their ids."""
        ids, idx = [], 0
        while True:
            found = {}
            for token in self._special_tokens:
                pos = text.find(token, idx)
                if pos >= 0:
                    found[token] = pos - idx
            if not found:
                break
            next_token = min(found, key=found.get)
            next_idx = idx + found[next_token]
            ids.extend(self.tokenizer.encode_as_ids(text[idx:next_idx]))
            ids.append(self._special_tokens[next_token])
            idx = next_idx + len(next_token)
        ids.extend(self.tokenizer.encode_as_ids(text[idx:]))
        return ids

    def detokenize(self, ids) -> str:
        text, last = "", 0
        ids = [int(i) for i in ids]
        for i, token_id in enumerate(ids):
            if token_id in self._inv_special_tokens:
                text += self.tokenizer.decode_ids(ids[last:i]) + " "
                text += self._inv_special_tokens[token_id] + " "
                last = i + 1
        return text + self.tokenizer.decode_ids(ids[last:])

    @property
    def cls(self):
        return self._cls_id

    @property
    def sep(self):
        return self._sep_id

    @property
    def pad(self):
        return self._pad_id

    @property
    def bos(self):
        return self._bos_id

    @property
    def eod(self):
        return self._eod_id

    @property
    def eos(self):
        return self._eos_id

    @property
    def mask(self):
        return self._mask_id

    @property
    def additional_special_tokens_ids(self):
        return [self.vocab[k] for k in self._t5_tokens]


class _GPTSentencePieceTokenizer(NoClsSepMaskMixin, _SentencePieceTokenizer):
    """SentencePiece with no added tokens: eod = eos_id, pad = pad_id (may be -1)."""

    def __init__(self, model_file: str):
        super().__init__(model_file, vocab_extra_ids=0)

    def _initalize(self, vocab_extra_ids: int) -> None:
        self._populate_vocab()
        self._pad_id = self.tokenizer.pad_id()
        self._bos_id = self.tokenizer.bos_id()
        self._eos_id = self.tokenizer.eos_id()

    def tokenize(self, text: str) -> List[int]:
        return self.tokenizer.encode_as_ids(text)

    def detokenize(self, ids) -> str:
        return self.tokenizer.decode_ids([int(i) for i in ids])

    @property
    def eod(self):
        return self._eos_id

    @property
    def additional_special_tokens_ids(self):
        return None


class _Llama2Tokenizer(NoClsSepMaskMixin, _SentencePieceTokenizer):
    """Llama-2 SentencePiece: `tokenize(s, bos=True, eos=False)` prepends BOS; eod = eos."""

    def __init__(self, model_file: str):
        super().__init__(model_file, vocab_extra_ids=0)

    def _initalize(self, vocab_extra_ids: int) -> None:
        self._populate_vocab()
        self.n_words = self.tokenizer.vocab_size()
        self.bos_id = self.tokenizer.bos_id()
        self.eos_id = self.tokenizer.eos_id()
        self.pad_id = self.tokenizer.pad_id()

    def tokenize(self, s: str, bos: bool = True, eos: bool = False) -> List[int]:
        if not isinstance(s, str):
            raise TypeError(f"Llama2Tokenizer.tokenize needs a str, got {type(s).__name__}")
        ids = self.tokenizer.encode(s)
        if bos:
            ids = [self.bos_id] + ids
        if eos:
            ids = ids + [self.eos_id]
        return ids

    def detokenize(self, ids) -> str:
        return self.tokenizer.decode_ids([int(i) for i in ids])

    @property
    def eod(self):
        return self.eos_id

    @property
    def additional_special_tokens_ids(self):
        return None
