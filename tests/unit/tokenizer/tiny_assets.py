"""Tiny tokenizer files and corpora built on the fly (tests never need downloaded assets)."""
import json
import os

from megatron.training.tokenizer.gpt2_tokenization import bytes_to_unicode

TEXT = (
    "The quick brown fox jumps over the lazy dog. Dr. Smith isn't here; he'll be back at 5 p.m.!\n"
    "Über café naïve résumé 東京 — emojis 🙂 and tabs\tand   spaces.  Numbers 12345 and 3.14159.\n"
    "To be, or not to be: that is the question. Whether 'tis nobler in the mind to suffer.\n"
)


def write_gpt2_files(directory: str, gpt2_layout: bool = True, vocab_size: int = 400):
    """Train a byte-level BPE on TEXT; write vocab.json/merges.txt (GPT-2 id layout if gpt2_layout)."""
    from tokenizers import ByteLevelBPETokenizer

    trainer = ByteLevelBPETokenizer()
    trainer.train_from_iterator([TEXT] * 20, vocab_size=vocab_size, min_frequency=2, show_progress=False)
    model = json.loads(trainer._tokenizer.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    if gpt2_layout:
        chars = bytes_to_unicode()
        vocab = {chars[b]: b for b in range(256)}
        for a, b in merges:
            vocab.setdefault(a + b, len(vocab))
        vocab["<|endoftext|>"] = len(vocab)
    else:
        vocab = {"<|endoftext|>": 0}  # special first, like a `tokenizers`-trained vocab: not GPT-2's layout
        vocab.update({token: i + 1 for token, i in model["vocab"].items()})
    os.makedirs(directory, exist_ok=True)
    vocab_file = os.path.join(directory, "vocab.json")
    merge_file = os.path.join(directory, "merges.txt")
    with open(vocab_file, "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(merge_file, "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
        for a, b in merges:
            f.write(f"{a} {b}\n")
    return vocab_file, merge_file


def write_jsonl(path: str, texts, key: str = "text"):
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({key: t}) + "\n")
    return path
