"""Tokenizers: build_tokenizer, padding, special tokens, unique_identifiers, GPT-2 id identity."""
import base64
import json
import os
from types import SimpleNamespace

import pytest

from megatron.training.tokenizer import build_tokenizer
from megatron.training.tokenizer.gpt2_tokenization import GPT2BPE, build_rust_tokenizer, read_vocab_and_merges
from tests.unit.tokenizer.tiny_assets import TEXT, write_gpt2_files


def args(**kw):
    base = dict(rank=0, make_vocab_size_divisible_by=128, tensor_model_parallel_size=1, vocab_extra_ids=0,
                vocab_file=None, merge_file=None, tokenizer_model=None, vocab_size=None)
    base.update(kw)
    return SimpleNamespace(**base)


def test_null_tokenizer_and_padding(capsys):
    a = args(tokenizer_type="NullTokenizer", vocab_size=1000, tensor_model_parallel_size=2)
    tok = build_tokenizer(a)
    out = capsys.readouterr().out
    assert " > padded vocab (size: 1001) with 23 dummy tokens (new size: 1024)" in out
    assert a.padded_vocab_size == 1024 and tok.eod == 1000 and tok.vocab_size == 1001
    assert tok.tokenize("3 1 4") == [3, 1, 4] and tok.detokenize([3, 1, 4]) == "3 1 4"
    a2 = args(tokenizer_type="NullTokenizer", vocab_size=1000, padded_vocab_size=4096)
    build_tokenizer(a2)
    assert a2.padded_vocab_size == 4096  # set from a checkpoint: untouched
    with pytest.raises(ValueError, match="--vocab-size"):
        build_tokenizer(args(tokenizer_type="NullTokenizer"))


def test_gpt2_bpe_fast_and_rust_paths_agree(tmp_path):
    for layout in (True, False):
        vocab, merges = write_gpt2_files(str(tmp_path / str(layout)), gpt2_layout=layout)
        bpe = GPT2BPE(vocab, merges)
        assert (bpe._fast is not None) == layout
        rust = build_rust_tokenizer(*read_vocab_and_merges(vocab, merges))
        lines = TEXT.splitlines() + [TEXT, "  leading and trailing  ", "<|endoftext|> is plain text"]
        for line in lines:
            ids = bpe.encode(line)
            assert ids == rust.encode(line, add_special_tokens=False).ids
            assert bpe.decode(ids) == line
        assert [list(x) for x in bpe.encode_batch_numpy(lines)] == bpe.encode_batch(lines)
    a = args(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    tok = build_tokenizer(a)
    assert tok.eod == 0 and tok.vocab_size == len(json.load(open(vocab)))
    assert dict(tok.unique_identifiers) == {"class": "_GPT2BPETokenizer", "tokenizer_path": [vocab, merges]}
    with pytest.raises(NotImplementedError):
        _ = tok.pad
    with pytest.raises(FileNotFoundError, match="--vocab-file"):
        build_tokenizer(args(tokenizer_type="GPT2BPETokenizer", vocab_file=str(tmp_path / "nope.json"), merge_file=merges))
    with pytest.raises(ValueError, match="--merge-file"):
        build_tokenizer(args(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab))


def test_bert_wordpiece(tmp_path):
    from tokenizers import BertWordPieceTokenizer

    trainer = BertWordPieceTokenizer(lowercase=True)
    trainer.train_from_iterator([TEXT] * 5, vocab_size=200, show_progress=False)
    trainer.save_model(str(tmp_path))
    vocab_file = str(tmp_path / "vocab.txt")
    n = len(open(vocab_file).read().splitlines())
    tok = build_tokenizer(args(tokenizer_type="BertWordPieceLowerCase", vocab_file=vocab_file, vocab_extra_ids=2))
    assert tok.bos == n and tok.eos == n + 1 and tok.eod == tok.eos and tok.vocab_size == n + 4
    assert tok.additional_special_tokens_ids == [n + 2, n + 3]
    assert tok.pad == tok.vocab["[PAD]"] and tok.cls == tok.vocab["[CLS]"]
    ids = tok.tokenize("The QUICK brown fox")
    assert tok.decode(ids) == "the quick brown fox"
    assert tok.unique_identifiers["lower_case"] == "True" and tok.unique_identifiers["vocab_extra_ids"] == "2"


def test_sentencepiece_family(tmp_path):
    import sentencepiece as spm

    prefix = str(tmp_path / "sp")
    spm.SentencePieceTrainer.train(sentence_iterator=iter(TEXT.splitlines() * 20), model_prefix=prefix,
                                   vocab_size=120, model_type="bpe", minloglevel=2)
    model = prefix + ".model"
    sp = build_tokenizer(args(tokenizer_type="SentencePieceTokenizer", tokenizer_model=model, vocab_extra_ids=1))
    base = spm.SentencePieceProcessor(model_file=model)
    n = len(base)
    assert [sp.cls, sp.sep, sp.eod, sp.mask] == [n, n + 1, n + 2, n + 3]
    assert sp.pad == n + 4 and sp.bos == base.bos_id() and sp.eos == base.eos_id()  # pad_id -1 -> new <PAD>
    assert sp.additional_special_tokens_ids == [n + 5] and sp.vocab_size == n + 6
    assert sp.tokenize("the<EOD>fox") == base.encode_as_ids("the") + [sp.eod] + base.encode_as_ids("fox")
    gpt = build_tokenizer(args(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=model))
    assert gpt.eod == base.eos_id() and gpt.pad == base.pad_id() and gpt.vocab_size == n
    assert gpt.unique_identifiers["class"] == "_GPTSentencePieceTokenizer"
    llama = build_tokenizer(args(tokenizer_type="Llama2Tokenizer", tokenizer_model=model))
    assert llama.tokenize("the fox")[0] == base.bos_id() and llama.eod == base.eos_id()


def test_tiktokenizer(tmp_path):
    entries = [{"rank": i, "token_bytes": base64.b64encode(bytes([i])).decode(), "token_str": ""} for i in range(256)]
    entries.append({"rank": 256, "token_bytes": base64.b64encode(b"th").decode(), "token_str": "th"})
    path = str(tmp_path / "tok.json")
    json.dump(entries, open(path, "w"))
    a = args(tokenizer_type="TikTokenizer", tokenizer_model=path, tiktoken_pattern="v2", vocab_size=300,
             tiktoken_num_special_tokens=10, tiktoken_special_tokens=None)
    tok = build_tokenizer(a)
    assert tok.bos == 1 and tok.eos == 2 and tok.eod == 2 and tok.vocab_size == 300
    assert tok.tokenize("the") == [256 + 10, ord("e") + 10]
    assert tok.detokenize(tok.tokenize("the cat", bos=False)) == "the cat"
    assert tok.unique_identifiers["num_special_tokens"] == "10"
    with pytest.raises(ValueError, match="tiktoken-pattern"):
        build_tokenizer(args(tokenizer_type="TikTokenizer", tokenizer_model=path))
