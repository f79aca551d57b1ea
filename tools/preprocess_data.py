"""Tokenize JSONL into Megatron `.bin/.idx` files: `{output_prefix}_{key}_{document|sentence}`.

Megatron-LM's flags and output layout, with its quirks fixed (docs/data.md):
- `--split-sentences` runs in one pass (Megatron writes `*_ss.json` and exits, needing a second run);
- every `--json-keys` key is finalized (Megatron finalizes only the last key without partitions).

Speed: workers receive ~1 MB chunks of lines, batch-encode them (tiktoken/`tokenizers`), and send back
numpy arrays that the main process appends in bulk; output is byte-identical for any worker count.
Errors (missing tokenizer file, malformed JSON line, missing key, empty input) stop the run with one
message naming the file and line; the `.partial` outputs are removed, so no complete-looking pair is
ever left behind.
"""
import argparse
import glob
import gzip
import itertools
import json
import multiprocessing
import os
import sys
import time
from types import SimpleNamespace
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.core.datasets._indexed_format import DType, IndexedDatasetBuilder  # noqa: E402
from megatron.training.tokenizer import build_tokenizer  # noqa: E402
from megatron.training.tokenizer.sentence_splitter import build_sentence_splitter  # noqa: E402
from megatron.training.tokenizer.tokenizer import TOKENIZER_TYPES  # noqa: E402

CHUNK_BYTES = 1 << 20


class PreprocessError(Exception):
    """A user-facing input problem (printed without a traceback)."""


def _add_tokenizer_args(parser: argparse.ArgumentParser) -> None:
    """Megatron's tokenizer flag group (defined here so this tool never imports torch)."""
    group = parser.add_argument_group(title="tokenizer")
    group.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer / TikTokenizer vocab size")
    group.add_argument("--vocab-file", type=str, default=None, help="vocab.json (GPT-2) or vocab.txt (BERT)")
    group.add_argument("--merge-file", type=str, default=None, help="merges.txt (GPT-2)")
    group.add_argument("--vocab-extra-ids", type=int, default=0, help="T5 sentinel tokens")
    group.add_argument("--tokenizer-type", type=str, default=None, choices=list(TOKENIZER_TYPES))
    group.add_argument("--tokenizer-model", type=str, default=None, help="SentencePiece / HF / TikToken model")
    group.add_argument("--tiktoken-pattern", type=str, default=None, help="v1 or v2")
    group.add_argument("--tiktoken-num-special-tokens", type=int, default=1000)
    group.add_argument("--tiktoken-special-tokens", type=str, nargs="+", default=None)


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Megatron's preprocess_data.py flags."""
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    group = parser.add_argument_group(title="input data")
    group.add_argument("--input", type=str, required=True, help="JSONL file (or .gz, or a glob)")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract from each JSON line")
    group.add_argument("--split-sentences", action="store_true", help="split documents into sentences")
    group.add_argument("--keep-newlines", action="store_true", help="keep newlines between sentences")
    _add_tokenizer_args(parser)
    group = parser.add_argument_group(title="tokenization process")
    group.add_argument("--append-eod", action="store_true", help="append an <eod> token to each document")
    group.add_argument("--lang", type=str, default="english", help="language for sentence splitting")
    group = parser.add_argument_group(title="output data")
    group.add_argument("--output-prefix", type=str, required=True, help="path prefix of the outputs")
    group = parser.add_argument_group(title="runtime")
    group.add_argument("--workers", type=int, required=True, help="number of worker processes")
    group.add_argument("--partitions", type=int, default=1, help="split the input into this many partitions")
    group.add_argument("--log-interval", type=int, default=1000, help="documents between progress updates")
    group.add_argument("--keep-sequential-samples", action="store_true",
                       help="partitions hold contiguous blocks of lines instead of round-robin")
    group.add_argument("--no-progress-bar", action="store_true", help="plain log lines instead of a tqdm bar")
    args = parser.parse_args(argv)
    problems = []
    if args.tokenizer_type is None:
        problems.append("--tokenizer-type is required")
    if args.workers < 1:
        problems.append(f"--workers ({args.workers}) must be >= 1")
    if args.partitions < 1 or args.workers % args.partitions != 0:
        problems.append(f"--workers ({args.workers}) must be divisible by --partitions ({args.partitions})")
    if problems:
        parser.error("; ".join(problems))
    args.rank = 1
    args.make_vocab_size_divisible_by = 128
    args.tensor_model_parallel_size = 1
    args.vocab_extra_ids = 0
    args.keep_empty = False
    return args


def _open_input(path: str):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def input_files(pattern: str) -> List[str]:
    """The input file(s): a path, or a glob expanded in sorted order."""
    if os.path.isfile(pattern):
        return [pattern]
    files = sorted(glob.glob(pattern))
    if not files:
        raise PreprocessError(f"--input {pattern}: no such file")
    return files


def read_chunks(paths: List[str], partitions: int, sequential: bool) -> Iterator[Tuple[str, int, bytes]]:
    """(file, first line number, block of whole lines) in Megatron's partition order."""
    for path in paths:
        if partitions == 1:
            yield from _read_blocks(path)
        else:
            yield from _read_partitioned(path, partitions, sequential)


def _read_blocks(path: str) -> Iterator[Tuple[str, int, bytes]]:
    """~CHUNK_BYTES blocks cut at line ends; workers split them (the main process stays idle)."""
    line_no, carry = 1, b""
    with _open_input(path) as stream:
        while True:
            data = stream.read(CHUNK_BYTES)
            if not data:
                break
            data = carry + data
            cut = data.rfind(b"\n") + 1
            if cut == 0:
                carry = data
                continue
            block, carry = data[:cut], data[cut:]
            yield path, line_no, block
            line_no += block.count(b"\n")
    if carry:
        yield path, line_no, carry


def _read_partitioned(path: str, partitions: int, sequential: bool) -> Iterator[Tuple[str, int, List]]:
    """Lines grouped by partition (round-robin, or contiguous with --keep-sequential-samples)."""
    total = None
    if sequential:
        with _open_input(path) as stream:
            total = sum(1 for _ in stream)
    for part in range(partitions):
        with _open_input(path) as stream:
            chunk, size = [], 0
            for index, line in enumerate(stream):
                owner = index * partitions // total if sequential else index % partitions
                if owner != part:
                    continue
                chunk.append((index + 1, line))
                size += len(line)
                if size >= CHUNK_BYTES:
                    yield path, 0, chunk
                    chunk, size = [], 0
            if chunk:
                yield path, 0, chunk


class Encoder:
    """Per-worker state: the tokenizer and the sentence splitter, built once per process."""

    tokenizer = None
    splitter = None
    args = None

    @classmethod
    def initializer(cls, args: argparse.Namespace, tokenizer=None) -> None:
        cls.args = args
        cls.tokenizer = tokenizer if tokenizer is not None else build_tokenizer(args)
        cls.splitter = build_sentence_splitter(args.lang, args.keep_newlines) if args.split_sentences else None

    @classmethod
    def encode_chunk(cls, job):
        """Tokenize a chunk: per key (flat tokens, sentence lengths, sentences per doc), docs, bytes."""
        path, first_line, block = job
        if isinstance(block, bytes):
            lines = [(first_line + i, line) for i, line in enumerate(block.split(b"\n")) if line.strip()]
            n_bytes = len(block)
        else:
            lines = [(i, line) for i, line in block if line.strip()]
            n_bytes = sum(len(line) for _, line in block)
        docs = []
        for line_no, line in lines:
            try:
                data = json.loads(line)
            except ValueError as err:
                return ("error", f"{path}:{line_no}: malformed JSON line ({err})")
            if not isinstance(data, dict):
                return ("error", f"{path}:{line_no}: a JSON object is expected, got {type(data).__name__}")
            missing = [k for k in cls.args.json_keys if k not in data]
            if missing:
                return ("error", f"{path}:{line_no}: key(s) {missing} missing (--json-keys {' '.join(cls.args.json_keys)}; "
                                 f"the line has {sorted(data)[:10]})")
            docs.append(data)
        out = {key: cls._encode_key([d[key] for d in docs]) for key in cls.args.json_keys}
        return ("ok", out, len(docs), n_bytes)

    @classmethod
    def _sentences(cls, value) -> List[str]:
        if isinstance(value, list):
            return [str(v) for v in value]
        if cls.splitter is None:
            return [value]
        text = str(value)
        step = 1000000
        return [s for i in range(0, len(text), step) for s in cls.splitter.tokenize(text[i : i + step])]

    @classmethod
    def _encode_key(cls, values: list):
        """(flat tokens, sentence lengths, sentences per document) of one key over a chunk's documents.

        Documents with no tokens are skipped entirely: no document entry and no EOD (spec §6.2).
        """
        sentences_per_doc = [cls._sentences(v) for v in values]
        flat_sentences = list(itertools.chain.from_iterable(sentences_per_doc))
        if hasattr(cls.tokenizer, "tokenize_batch_numpy"):
            arrays = cls.tokenizer.tokenize_batch_numpy(flat_sentences)
        elif hasattr(cls.tokenizer, "tokenize_batch"):
            arrays = cls.tokenizer.tokenize_batch(flat_sentences)
        else:
            arrays = [cls.tokenizer.tokenize(s) for s in flat_sentences]
        lens = np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays))
        doc_of_sentence = np.repeat(np.arange(len(values)), [len(s) for s in sentences_per_doc])
        keep = lens > 0
        kept_lens, doc_of_sentence = lens[keep], doc_of_sentence[keep]
        seqs_per_doc = np.bincount(doc_of_sentence, minlength=len(values))
        seqs_per_doc = seqs_per_doc[seqs_per_doc > 0]
        eod = cls.args.append_eod and len(kept_lens) > 0
        last_sentence = np.cumsum(seqs_per_doc) - 1
        out_lens = kept_lens.copy()
        if eod:
            out_lens[last_sentence] += 1
        flat = np.empty(int(out_lens.sum()), dtype=cls.args.output_dtype)
        if eod:
            # Each document's tokens followed by its EOD: fill the EOD slots, then every other slot.
            ends = np.cumsum(out_lens)[last_sentence] - 1
            is_token = np.ones(len(flat), dtype=bool)
            is_token[ends] = False
            flat[ends] = cls.tokenizer.eod
            flat[is_token] = _concatenate(arrays, int(kept_lens.sum()))
        else:
            flat[:] = _concatenate(arrays, len(flat))
        return flat, out_lens.astype(np.int32), seqs_per_doc


def _concatenate(arrays, total: int) -> np.ndarray:
    """All token id sequences back to back (numpy arrays or lists)."""
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    if isinstance(arrays[0], np.ndarray):
        return np.concatenate(arrays)
    return np.fromiter(itertools.chain.from_iterable(arrays), dtype=np.int64, count=total)


def _output_prefix(args, key: str) -> str:
    level = "sentence" if args.split_sentences else "document"
    return f"{args.output_prefix}_{key}_{level}"


def _progress(args, total_bytes: int):
    if args.no_progress_bar:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total_bytes, unit="B", unit_scale=True, desc="preprocess", file=sys.stderr, mininterval=0.5)


def process(args: argparse.Namespace) -> Dict[str, object]:
    """Run the whole preprocessing; returns counters (documents, tokens, bytes, seconds)."""
    paths = input_files(args.input)
    for path in paths:
        if os.path.getsize(path) == 0:
            raise PreprocessError(f"--input {path}: the file is empty")
    tokenizer = build_tokenizer(args)
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    args.output_dtype = dtype
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    builders = {key: IndexedDatasetBuilder(_output_prefix(args, key) + ".bin", dtype=dtype) for key in args.json_keys}
    stats = {"documents": 0, "tokens": 0, "bytes": 0}
    start = time.time()
    total_bytes = sum(os.path.getsize(p) for p in paths) * (1 if args.partitions == 1 else args.partitions)
    bar = _progress(args, total_bytes)
    chunks = read_chunks(paths, args.partitions, args.keep_sequential_samples)
    try:
        if args.workers == 1:
            Encoder.initializer(args, tokenizer)
            results = map(Encoder.encode_chunk, chunks)
            pool = None
        else:
            # Fork after building the tokenizer so workers inherit it instead of rebuilding it.
            Encoder.tokenizer = tokenizer
            pool = multiprocessing.get_context("fork").Pool(
                args.workers, initializer=Encoder.initializer, initargs=(args, tokenizer)
            )
            results = pool.imap(Encoder.encode_chunk, chunks, chunksize=1)
        for result in results:
            if result[0] == "error":
                raise PreprocessError(result[1])
            _, per_key, n_docs, n_bytes = result
            for key, (flat, lens, seqs_per_doc) in per_key.items():
                builders[key].add_documents(flat, lens, seqs_per_doc)
                stats["tokens"] += len(flat)
            stats["documents"] += n_docs
            stats["bytes"] += n_bytes
            _report(args, bar, stats, start, n_bytes)
        if pool is not None:
            pool.close()
            pool.join()
        if stats["documents"] == 0:
            raise PreprocessError(f"--input {args.input}: no JSON lines found (empty input)")
    except BaseException:
        if "pool" in locals() and pool is not None:
            pool.terminate()
        for builder in builders.values():
            builder.abort()
        raise
    finally:
        if bar is not None:
            bar.close()
    for key, builder in builders.items():
        builder.finalize(_output_prefix(args, key) + ".idx")
    stats["seconds"] = time.time() - start
    return stats


def _report(args, bar, stats, start, n_bytes) -> None:
    elapsed = max(time.time() - start, 1e-9)
    rate = {"docs/s": f"{stats['documents'] / elapsed:.0f}", "MB/s": f"{stats['bytes'] / elapsed / 1e6:.2f}"}
    if bar is not None:
        bar.update(n_bytes)
        bar.set_postfix(rate, refresh=False)
    elif stats["documents"] // args.log_interval != (stats["documents"] - 1) // args.log_interval or stats["documents"] < 2:
        print(f"Processed {stats['documents']} documents ({rate['docs/s']} docs/s, {rate['MB/s']} MB/s).",
              file=sys.stderr, flush=True)


def main(argv: Optional[List[str]] = None) -> int:
    args = get_args(argv)
    try:
        stats = process(args)
    except (PreprocessError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    seconds = stats["seconds"]
    print(
        f"Done: {stats['documents']} documents, {stats['tokens']} tokens, {stats['bytes'] / 1e6:.1f} MB in "
        f"{seconds:.2f} s ({stats['tokens'] / max(seconds, 1e-9) / 1e6:.2f} M tokens/s); outputs: "
        + ", ".join(_output_prefix(args, k) for k in args.json_keys),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
