"""`megatron.training.tokenizer.gpt2_tokenization.GPT2Tokenizer`: Megatron's class over the native encoder."""
import pytest
import regex

from megatron.training.tokenizer import gpt2_tokenization as gpt2
from tests.unit.tokenizer.tiny_assets import TEXT, write_gpt2_files


def test_gpt2_tokenizer_class(tmp_path):
    vocab, merges = write_gpt2_files(str(tmp_path))
    tok = gpt2.GPT2Tokenizer(vocab, merges, special_tokens=["<pad>", "<sep>"])
    assert len(tok) == len(tok.encoder) + 2
    assert tok.convert_tokens_to_ids(["<pad>", "<sep>"]) == [len(tok.encoder), len(tok.encoder) + 1]

    # tokenize == Megatron's loop: GPT-2 regex, byte-to-unicode, the rank-ordered BPE of each word
    expected_pieces = []
    for word in regex.findall(gpt2.GPT2_PATTERN, TEXT):
        mapped = "".join(tok.byte_encoder[b] for b in word.encode("utf-8"))
        expected_pieces.extend(tok.bpe(mapped).split(" "))
    assert tok.tokenize(TEXT) == expected_pieces
    ids = tok.encode(TEXT)
    assert ids == tok.convert_tokens_to_ids(expected_pieces)
    assert tok.decode(ids) == TEXT
    assert tok.convert_ids_to_tokens(ids[:3] + [len(tok.encoder)]) == expected_pieces[:3] + ["<pad>"]
    assert tok.convert_ids_to_tokens([len(tok.encoder)], skip_special_tokens=True) == []

    # save and reload through from_pretrained (a directory; special tokens come back too)
    out = tmp_path / "saved"
    out.mkdir()
    tok.save_vocabulary(str(out))
    again = gpt2.GPT2Tokenizer.from_pretrained(str(out))
    assert again.encode(TEXT) == ids and again.special_tokens == tok.special_tokens
    with pytest.raises(ValueError, match="download"):
        gpt2.GPT2Tokenizer.from_pretrained("gpt2")
    tok.set_special_tokens(None)
    assert len(tok) == len(tok.encoder)
