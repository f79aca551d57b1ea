"""A tiny sentence-split WordPiece corpus for the BERT/T5 dataset, parity and command-line tests.

`write_masked_corpus(directory)` writes `vocab.txt` (specials, whole words and `##` pieces, so whole-word
masking has multi-piece words), `corpus.jsonl` (documents of 1-6 sentences, seeded) and runs
`tools/preprocess_data.py --split-sentences` with `BertWordPieceLowerCase`; it returns
(vocab path, data prefix `<dir>/corpus_text_sentence`).
"""
import json
import os
import sys

import numpy as np

WORDS = ("the a king queen lord lady speaks runs walks sleeps castle river forest night day old young "
         "brave fair dark bright sword crown horse ship sea storm war peace").split()
PIECES = ["##s", "##ed", "##ing", "##ly", "##er"]
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def _sentence(rng) -> str:
    words = []
    for _ in range(int(rng.integers(3, 12))):
        word = str(rng.choice(WORDS))
        if rng.random() < 0.3:
            word += str(rng.choice(PIECES))[2:]
        words.append(word)
    return " ".join(words).capitalize() + "."


def write_masked_corpus(directory: str, num_docs: int = 60, seed: int = 0):
    """(vocab file, sentence-level data prefix) of a fresh tiny corpus in `directory`."""
    os.makedirs(directory, exist_ok=True)
    vocab = os.path.join(directory, "vocab.txt")
    with open(vocab, "w") as f:
        f.write("\n".join(SPECIALS + WORDS + PIECES + list(".,")) + "\n")
    rng = np.random.default_rng(seed)
    corpus = os.path.join(directory, "corpus.jsonl")
    with open(corpus, "w") as f:
        for _ in range(num_docs):
            text = " ".join(_sentence(rng) for _ in range(int(rng.integers(1, 7))))
            f.write(json.dumps({"text": text}) + "\n")
    tools = os.path.join(os.path.dirname(__file__), "..", "..", "..", "tools")
    sys.path.insert(0, os.path.abspath(tools))
    import preprocess_data

    prefix = os.path.join(directory, "corpus")
    rc = preprocess_data.main(["--input", corpus, "--output-prefix", prefix, "--tokenizer-type",
                               "BertWordPieceLowerCase", "--vocab-file", vocab, "--split-sentences",
                               "--workers", "1", "--no-progress-bar"])
    if rc != 0:
        raise RuntimeError(f"preprocess_data.py failed with status {rc}")
    return vocab, prefix + "_text_sentence"
