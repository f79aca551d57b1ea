"""Train a BERT WordPiece `vocab.txt` on a JSONL corpus with the `tokenizers` package (offline, seconds).

The vocabulary has Megatron's BERT layout: `[PAD]` = 0, then `[UNK] [CLS] [SEP] [MASK]`, then the learned
pieces (continuations spelled `##piece`), one token per line, id = line number. `--lower-case` matches
`--tokenizer-type BertWordPieceLowerCase` (BERT); without it the vocabulary is cased, for
`BertWordPieceCase` (Megatron's T5 recipes). The T5 sentinels (`--vocab-extra-ids`) are added by the
tokenizer at run time, not stored here.

Usage: python examples/bert/train_wordpiece_vocab.py --input corpus.jsonl --output vocab.txt
       [--vocab-size 2000] [--lower-case] [--json-key text]
"""
import argparse
import json
import sys
from typing import Iterator, List, Optional

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def _texts(path: str, key: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)[key]


def train_vocab(input_path: str, output_path: str, vocab_size: int, lower_case: bool, json_key: str = "text") -> int:
    """Write the vocabulary file; return its number of tokens."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=lower_case, strip_accents=lower_case)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                        continuing_subword_prefix="##", show_progress=False)
    tokenizer.train_from_iterator(_texts(input_path, json_key), trainer)
    by_id = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    with open(output_path, "w", encoding="utf-8") as f:
        f.write("".join(token + "\n" for token, _ in by_id))
    return len(by_id)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description="Train a BERT WordPiece vocab.txt.")
    parser.add_argument("--input", required=True, help="JSONL corpus, one document per line")
    parser.add_argument("--output", required=True, help="vocab.txt to write")
    parser.add_argument("--vocab-size", type=int, default=2000)
    parser.add_argument("--lower-case", action="store_true", help="lower-case and strip accents (uncased BERT)")
    parser.add_argument("--json-key", default="text")
    args = parser.parse_args(argv)
    count = train_vocab(args.input, args.output, args.vocab_size, args.lower_case, args.json_key)
    print(f"wrote {count} tokens to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
