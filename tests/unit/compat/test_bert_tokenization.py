"""Megatron's (Google BERT's) pure-Python WordPiece tokenizer in `bert_tokenization`, checked against the
`tokenizers` library's BertWordPiece on a small vocab built here, plus the tokenizer names of
`megatron.training.tokenizer.tokenizer` (reload_mergeable_ranks, _NullMultimodalTokenizer)."""
import argparse
import random

import pytest
from tokenizers import BertWordPieceTokenizer

from megatron.training.tokenizer import build_tokenizer
from megatron.training.tokenizer.bert_tokenization import (
    BasicTokenizer,
    FullTokenizer,
    WordpieceTokenizer,
    _BertWordPieceTokenizer,
    convert_ids_to_tokens,
    convert_to_unicode,
    convert_tokens_to_ids,
    load_vocab,
    printable_text,
    validate_case_matches_checkpoint,
    whitespace_tokenize,
)
from megatron.training.tokenizer.tokenizer import _NullMultimodalTokenizer, reload_mergeable_ranks
from megatron.training.tokenizer.tiktoken_tokenizer import reload_mergeable_ranks as tiktoken_ranks

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ["hello", "world", "un", "##aff", "##able", "the", "caf", "##e", "cafe", "naive", "x", "##y", "é", "Hello"]
# printable ASCII, Latin-1/Latin Extended (accents), CJK ideographs, kana, many space/control/format characters,
# combining marks, an emoji and an unassigned code point
POOL = [chr(c) for c in [*range(32, 127), *range(0xA0, 0x250), *range(0x4E00, 0x4E20), *range(0x3040, 0x3050),
                          0x2028, 0x2029, 0x0B, 0x0C, 0x85, 0x200B, 0x3000, 0x1680, 0xFEFF, 0xAD, 0x301, 0x1F600,
                          0x378, 0x1C, 0x1F, 0x09, 0x0A, 0x0D, 0x00, 0xFFFD]]
PRIVATE_USE = "\ue000"


@pytest.fixture(scope="module")
def vocab_file(tmp_path_factory):
    vocab = SPECIALS + WORDS + [c for c in POOL if not c.isspace()] + ["##" + c for c in POOL[:120]]
    vocab.append(PRIVATE_USE)
    path = tmp_path_factory.mktemp("bert") / "vocab.txt"
    path.write_text("\n".join(dict.fromkeys(vocab)) + "\n", encoding="utf-8")
    return str(path)


def _texts(seed, count, extra=()):
    rng = random.Random(seed)
    pool = POOL + list(extra) + [" "] * 8 + [" hello ", " world ", "unaffable", "Café", "naïve"]
    return ["".join(rng.choice(pool) for _ in range(rng.randint(1, 24))) for _ in range(count)]


@pytest.mark.parametrize("lower", [True, False])
def test_full_tokenizer_matches_the_tokenizers_library(vocab_file, lower):
    ours = FullTokenizer(vocab_file, do_lower_case=lower)
    reference = BertWordPieceTokenizer(vocab_file, lowercase=lower, strip_accents=lower, clean_text=True,
                                       handle_chinese_chars=True, wordpieces_prefix="##")
    for text in _texts(1 if lower else 2, 1500):
        assert ours.tokenize(text) == reference.encode(text, add_special_tokens=False).tokens, repr(text)
    # The one difference: the library's cleaning also drops private-use characters, BERT's keeps them.
    assert ours.tokenize("hello " + PRIVATE_USE) == ["hello", PRIVATE_USE]
    assert reference.encode("hello " + PRIVATE_USE, add_special_tokens=False).tokens == ["hello"]


@pytest.mark.parametrize("lower", [True, False])
def test_megatron_wordpiece_tokenizer_ids_equal_full_tokenizer(vocab_file, lower):
    fast = _BertWordPieceTokenizer(vocab_file, lower_case=lower)
    full = FullTokenizer(vocab_file, do_lower_case=lower)
    for text in _texts(3, 800, extra=[PRIVATE_USE]):
        assert fast.tokenize(text) == full.convert_tokens_to_ids(full.tokenize(text)), repr(text)
    assert fast.tokenizer.vocab is fast.vocab and fast.tokenizer.vocab["[EOS]"] == fast.eos  # Megatron's attribute


def test_basic_and_wordpiece_tokenizers(vocab_file):
    basic = BasicTokenizer(do_lower_case=True)
    assert basic.tokenize(" \tHeLLo!How  are U?  ") == ["hello", "!", "how", "are", "u", "?"]
    assert basic.tokenize("Café naïve") == ["cafe", "naive"]
    assert basic.tokenize("ab\u4e00c\x00d\ufffde\u200bf") == ["ab", "\u4e00", "cdef"]
    assert BasicTokenizer(do_lower_case=False).tokenize("HäLLo,x") == ["HäLLo", ",", "x"]
    vocab = {token: i for i, token in enumerate(["[UNK]", "want", "##want", "##ed", "wa", "un", "runn", "##ing"])}
    wordpiece = WordpieceTokenizer(vocab=vocab)
    assert wordpiece.tokenize("") == []
    assert wordpiece.tokenize("unwanted running") == ["un", "##want", "##ed", "runn", "##ing"]
    assert wordpiece.tokenize("unwantedX running") == ["[UNK]", "runn", "##ing"]
    assert WordpieceTokenizer(vocab, max_input_chars_per_word=5).tokenize("running want") == ["[UNK]", "want"]

    full = FullTokenizer(vocab_file)
    tokens = full.tokenize("unaffable hello")
    assert tokens == ["un", "##aff", "##able", "hello"]
    assert full.convert_ids_to_tokens(full.convert_tokens_to_ids(tokens)) == tokens
    assert full.vocab_size() == len(full.vocab)
    assert FullTokenizer.convert_tokens_to_string(["hello", "world", "!", "do", "n't", "un", "##aff"]) == \
        "hello world! don't unaff"
    assert FullTokenizer.convert_tokens_to_string(["a", "."], clean_up_tokenization_spaces=False) == "a ."


def test_module_helpers(tmp_path):
    path = tmp_path / "v.txt"
    path.write_text("a\n b \nc\na\n\n")
    assert load_vocab(str(path)) == {"a": 3, "b": 1, "c": 2, "": 4}  # a repeated token keeps its last line
    assert convert_to_unicode(b"caf\xc3\xa9\xff") == "café" and printable_text("x") == "x"
    with pytest.raises(ValueError, match="Unsupported string type"):
        convert_to_unicode(3)
    vocab = {"a": 0, "b": 1}
    assert convert_tokens_to_ids(vocab, ["b", "a"]) == [1, 0]
    assert convert_ids_to_tokens({0: "a", 1: "b"}, [1, 1]) == ["b", "b"]
    assert whitespace_tokenize("  a \t b\n") == ["a", "b"] and whitespace_tokenize("   ") == []
    validate_case_matches_checkpoint(True, "/ckpt/uncased_L-12_H-768_A-12/bert_model.ckpt")
    validate_case_matches_checkpoint(False, "/some/other/model.ckpt")
    with pytest.raises(ValueError, match="seems to be a lowercased model"):
        validate_case_matches_checkpoint(False, "/ckpt/uncased_L-12_H-768_A-12/bert_model.ckpt")
    with pytest.raises(ValueError, match="seems to be a cased model"):
        validate_case_matches_checkpoint(True, "gs://b/cased_L-24_H-1024_A-16/bert_model.ckpt")


def test_tokenizer_module_names():
    assert reload_mergeable_ranks is tiktoken_ranks
    args = argparse.Namespace(tokenizer_type="NullMultimodalTokenizer", vocab_size=99, rank=0,
                              make_vocab_size_divisible_by=128, tensor_model_parallel_size=1, padded_vocab_size=None)
    tokenizer = build_tokenizer(args)
    assert isinstance(tokenizer, _NullMultimodalTokenizer) and args.padded_vocab_size == 128
    assert tokenizer.tokenize("5 7") == [5, 7] and tokenizer.detokenize([5, 7]) == "5 7"
    assert tokenizer.eod == tokenizer.eos == 99 and tokenizer.vocab_size == 100
    assert tokenizer.convert_tokens_to_ids("4  <image>  6") == [4, -200, 6]
    assert tokenizer.convert_tokens_to_ids("8") == 8
    custom = _NullMultimodalTokenizer(10, image_token="<img>", image_token_id=-1)
    assert custom.convert_tokens_to_ids("<img>  1") == [-1, 1] and custom.cls == -1
