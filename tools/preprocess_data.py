"""Tokenize JSONL into Megatron `.bin/.idx` files: `{output_prefix}_{key}_{document|sentence}`.

Megatron-LM's flags and output layout, with its quirks fixed (docs/data.md):
- `--split-sentences` runs in one pass (Megatron writes `*_ss.json` and exits, needing a second run);
- every `--json-keys` key is finalized (Megatron finalizes only the last key without partitions).

Speed: the main process only plans byte ranges of the input (cut at line ends, ~1 MB, shrinking
towards the end of the file); each worker reads and parses its own ranges, encodes them (tiktoken for
GPT-2 BPE) and appends the tokens to its own file, returning only the length arrays; the main process
copies the workers' byte ranges into the `.bin` in input order (`os.copy_file_range`) and writes the
`.idx` from the lengths. With one worker the tokens go straight into the `.bin`. Output is
byte-identical for any worker count. (`.gz` input and `--partitions` are read by the main process.)
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
import shutil
import sys
import tempfile
import time
from typing import Callable, Dict, Iterator, List, Optional, Tuple

if "numpy" not in sys.modules:
    # Run as a script: this tool never calls BLAS, and one OpenBLAS thread keeps numpy's import from
    # starting a busy thread per core (~0.1 CPU-s of start-up on 2 cores).
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.core.datasets._indexed_format import DType, write_index  # noqa: E402
from megatron.training.tokenizer import build_tokenizer  # noqa: E402
from megatron.training.tokenizer.sentence_splitter import build_sentence_splitter  # noqa: E402
from megatron.training.tokenizer.tokenizer import TOKENIZER_TYPES  # noqa: E402

CHUNK_BYTES = 1 << 20
MIN_CHUNK_BYTES = 1 << 16


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


def iter_jobs(paths: List[str], partitions: int, sequential: bool, workers: int) -> Iterator[Tuple]:
    """Work items `(path, where, payload)` in output order.

    A plain file is cut into byte ranges ending at line ends (`where` = (start, end), payload None): the
    workers read and parse their own ranges, so the main process never touches the text. A `.gz` file
    is read by the main process in blocks of whole lines (`where` = first line number, payload the
    bytes); `--partitions` sends numbered lines (`where` None, payload [(line number, line), ...]).
    """
    for path in paths:
        if partitions > 1:
            yield from ((path, None, chunk) for chunk in _read_partitioned(path, partitions, sequential))
        elif path.endswith(".gz"):
            yield from _read_blocks(path)
        else:
            yield from ((path, where, None) for where in line_ranges(path, workers))


def line_ranges(path: str, workers: int) -> List[Tuple[int, int]]:
    """Byte ranges of `path` that each end after a newline (or at the end of the file).

    Ranges shrink towards the end of the file (an eighth of what is left per worker, between
    MIN_CHUNK_BYTES and CHUNK_BYTES), so the workers run out of work at nearly the same moment.
    """
    size = os.path.getsize(path)
    ranges, start = [], 0
    with open(path, "rb") as stream:
        while start < size:
            step = min(CHUNK_BYTES, max(MIN_CHUNK_BYTES, (size - start) // (8 * workers)))
            end = start + step
            if end >= size:
                end = size
            else:
                pos = end - 1
                stream.seek(pos)
                while True:
                    window = stream.read(MIN_CHUNK_BYTES)
                    cut = window.find(b"\n")
                    if not window or cut >= 0:
                        end = pos + cut + 1 if cut >= 0 else size
                        break
                    pos += len(window)
            ranges.append((start, end))
            start = end
    return ranges


def _read_blocks(path: str) -> Iterator[Tuple[str, int, bytes]]:
    """(path, first line number, ~CHUNK_BYTES of whole lines) of a file read sequentially (`.gz`)."""
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


def _read_partitioned(path: str, partitions: int, sequential: bool) -> Iterator[List[Tuple[int, bytes]]]:
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
                    yield chunk
                    chunk, size = [], 0
            if chunk:
                yield chunk


def _count_lines_before(path: str, offset: int) -> int:
    """Newlines in the first `offset` bytes of `path` (only used to name the line of an error)."""
    count = 0
    with open(path, "rb") as stream:
        while offset > 0:
            data = stream.read(min(offset, CHUNK_BYTES))
            if not data:
                break
            count += data.count(b"\n")
            offset -= len(data)
    return count


def job_lines(job: Tuple) -> Tuple[List[Tuple[int, bytes]], int, Callable[[int], int]]:
    """(non-blank (index, line) pairs, bytes covered, index -> line number) of one work item."""
    path, where, payload = job
    if payload is None:
        start, end = where
        with open(path, "rb") as stream:
            stream.seek(start)
            data = stream.read(end - start)
        lines = data.split(b"\n")
        return [(i, x) for i, x in enumerate(lines) if x and not x.isspace()], len(data), (
            lambda i: _count_lines_before(path, start) + i + 1
        )
    if isinstance(payload, bytes):
        lines = payload.split(b"\n")
        return [(i, x) for i, x in enumerate(lines) if x and not x.isspace()], len(payload), (lambda i: where + i)
    return [(n, x) for n, x in payload if x and not x.isspace()], sum(len(x) for _, x in payload), (lambda n: n)


class Encoder:
    """Per-worker state: the tokenizer, the sentence splitter and where this process writes tokens.

    Each process appends its tokens to its own file per key (`sinks`) and returns only the lengths
    arrays and the byte range it wrote; the main process copies the ranges into the output in order.
    """

    tokenizer = None
    splitter = None
    args = None
    parts_dir: Optional[str] = None
    sinks: Dict[str, Tuple[str, int]] = {}
    offsets: Dict[str, int] = {}

    @classmethod
    def initializer(cls, args: argparse.Namespace, tokenizer=None, parts_dir=None, sinks=None) -> None:
        cls.args = args
        cls.tokenizer = tokenizer if tokenizer is not None else build_tokenizer(args)
        cls.splitter = build_sentence_splitter(args.lang, args.keep_newlines) if args.split_sentences else None
        cls.parts_dir = parts_dir
        cls.sinks = dict(sinks or {})
        cls.offsets = {key: 0 for key in cls.sinks}

    @classmethod
    def encode_job(cls, job):
        """Tokenize one work item: ("ok", {key: (file, offset, bytes, lengths, sequences per doc)}, docs,
        input bytes), or ("error", message)."""
        lines, n_bytes, line_number = job_lines(job)
        docs = []
        keys = cls.args.json_keys
        for index, line in lines:
            try:
                data = json.loads(line)
            except ValueError as err:
                return ("error", f"{job[0]}:{line_number(index)}: malformed JSON line ({err})")
            if not isinstance(data, dict):
                return ("error", f"{job[0]}:{line_number(index)}: a JSON object is expected, got {type(data).__name__}")
            missing = [k for k in keys if k not in data]
            if missing:
                return ("error", f"{job[0]}:{line_number(index)}: key(s) {missing} missing (--json-keys "
                                 f"{' '.join(keys)}; the line has {sorted(data)[:10]})")
            docs.append(data)
        out = {}
        for key in keys:
            flat, lens, seqs_per_doc = cls._encode_key([d[key] for d in docs])
            out[key] = cls._write(key, flat) + (lens, seqs_per_doc)
        return ("ok", out, len(docs), n_bytes)

    @classmethod
    def _write(cls, key: str, flat: np.ndarray) -> Tuple[str, int, int]:
        """Append `flat` to this process's file for `key`; (path, offset, byte count)."""
        if key not in cls.sinks:
            path = os.path.join(cls.parts_dir, f"{cls.args.json_keys.index(key)}.{os.getpid()}.bin")
            cls.sinks[key] = (path, os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
            cls.offsets[key] = 0
        path, fd = cls.sinks[key]
        offset = cls.offsets[key]
        _write_all(fd, memoryview(flat).cast("B"))
        cls.offsets[key] = offset + flat.nbytes
        return path, offset, flat.nbytes

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
        if cls.splitter is None and all(type(v) is str for v in values):
            flat_sentences = values  # one sentence per document
            n_sentences = np.ones(len(values), dtype=np.int64)
        else:
            sentences_per_doc = [cls._sentences(v) for v in values]
            flat_sentences = list(itertools.chain.from_iterable(sentences_per_doc))
            n_sentences = np.fromiter(map(len, sentences_per_doc), dtype=np.int64, count=len(values))
        arrays = _tokenize_all(cls.tokenizer, flat_sentences)
        lens = np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays))
        keep = lens > 0
        kept_lens = lens[keep]
        doc_of_sentence = np.repeat(np.arange(len(values)), n_sentences)[keep]
        seqs_per_doc = np.bincount(doc_of_sentence, minlength=len(values))
        seqs_per_doc = seqs_per_doc[seqs_per_doc > 0]
        dtype = cls.args.output_dtype
        if not (cls.args.append_eod and len(kept_lens)):
            return _concatenate(arrays, dtype), kept_lens.astype(np.int32), seqs_per_doc
        # Each document's tokens followed by its EOD: one EOD array after each document's last sentence.
        last_sentence = np.cumsum(seqs_per_doc) - 1
        out_lens = kept_lens.copy()
        out_lens[last_sentence] += 1
        eod = np.array([cls.tokenizer.eod], dtype=dtype)
        kept = [a for a in arrays if len(a)]
        is_last = np.zeros(len(kept), dtype=bool)
        is_last[last_sentence] = True
        pieces = []
        for array, last in zip(kept, is_last.tolist()):
            pieces.append(array)
            if last:
                pieces.append(eod)
        return _concatenate(pieces, dtype), out_lens.astype(np.int32), seqs_per_doc


def _tokenize_all(tokenizer, texts: List[str]) -> list:
    """Token ids of every text (numpy arrays on the fast path, else lists)."""
    if hasattr(tokenizer, "tokenize_batch_numpy"):
        return tokenizer.tokenize_batch_numpy(texts)
    if hasattr(tokenizer, "tokenize_batch"):
        return tokenizer.tokenize_batch(texts)
    return [tokenizer.tokenize(s) for s in texts]


def _concatenate(arrays: list, dtype) -> np.ndarray:
    """All token id sequences back to back, in the output dtype (ids always fit: it is chosen from
    the vocab size)."""
    arrays = [a for a in arrays if len(a)]
    if not arrays:
        return np.zeros(0, dtype=dtype)
    if isinstance(arrays[0], np.ndarray):
        return np.concatenate(arrays, dtype=dtype, casting="unsafe")
    total = sum(map(len, arrays))
    return np.fromiter(itertools.chain.from_iterable(arrays), dtype=np.int64, count=total).astype(dtype)


def _write_all(fd: int, data: memoryview) -> None:
    while len(data):
        data = data[os.write(fd, data):]


def _copy_range(src_fd: int, dst_fd: int, offset: int, count: int) -> None:
    """Append `count` bytes of `src_fd` from `offset` to `dst_fd` (in the kernel where it can)."""
    while count > 0:
        try:
            done = os.copy_file_range(src_fd, dst_fd, count, offset)
        except (AttributeError, OSError):
            done = os.write(dst_fd, os.pread(src_fd, min(count, 1 << 24), offset))
        if done <= 0:
            raise PreprocessError(f"internal error: a worker's token file ended {count} bytes early")
        offset += done
        count -= done


class _Output:
    """One `{prefix}_{key}_{level}` pair: `.bin.partial` filled in order, then the `.idx`, then renamed."""

    def __init__(self, prefix: str, dtype) -> None:
        self.bin_path, self.idx_path = prefix + ".bin", prefix + ".idx"
        self.partial = self.bin_path + ".partial"
        self.fd = os.open(self.partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        self.dtype = dtype
        self.size = 0
        self.lengths: List[np.ndarray] = []
        self.seqs_per_doc: List[np.ndarray] = []
        self._sources: Dict[str, int] = {}

    def append(self, path: str, offset: int, nbytes: int, lens: np.ndarray, seqs_per_doc: np.ndarray) -> None:
        """Take a worker's range of tokens (already in place when the worker wrote this file)."""
        if path != self.partial:
            if path not in self._sources:
                self._sources[path] = os.open(path, os.O_RDONLY)
            _copy_range(self._sources[path], self.fd, offset, nbytes)
        elif offset != self.size:
            raise PreprocessError(f"internal error: {self.partial} written out of order")
        self.size += nbytes
        self.lengths.append(lens)
        self.seqs_per_doc.append(seqs_per_doc)

    def _close_sources(self) -> None:
        for fd in self._sources.values():
            os.close(fd)
        self._sources = {}

    def finalize(self) -> None:
        """Write the `.idx` (Megatron's layout) and move both files into place, `.bin` first."""
        self._close_sources()
        os.close(self.fd)
        self.fd = None
        lengths = np.concatenate(self.lengths) if self.lengths else np.zeros(0, np.int32)
        ends = np.cumsum(np.concatenate(self.seqs_per_doc)) if self.seqs_per_doc else np.zeros(0, np.int64)
        if int(lengths.sum()) * np.dtype(self.dtype).itemsize != self.size or (len(ends) and ends[-1] != len(lengths)):
            raise PreprocessError(f"internal error: {self.partial} does not match its lengths")
        partial_idx = self.idx_path + ".partial"
        write_index(partial_idx, self.dtype, lengths, np.concatenate([[0], ends]))
        if os.path.exists(self.idx_path):
            os.remove(self.idx_path)
        os.replace(self.partial, self.bin_path)
        os.replace(partial_idx, self.idx_path)

    def abort(self) -> None:
        """Close and delete the partial file (used when preprocessing fails)."""
        self._close_sources()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        for path in (self.partial, self.idx_path + ".partial"):
            if os.path.exists(path):
                os.remove(path)


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


def _start_encoding(args, tokenizer, outputs, parts_dir):
    """(results iterator, pool or None): in-process for one worker, else a fork pool."""
    jobs = iter_jobs(input_files(args.input), args.partitions, args.keep_sequential_samples, args.workers)
    if args.workers == 1:
        # One process: tokens go straight into the output files, nothing is copied.
        sinks = {key: (out.partial, out.fd) for key, out in outputs.items()}
        Encoder.initializer(args, tokenizer, parts_dir, sinks)
        return map(Encoder.encode_job, jobs), None
    # Fork after building the tokenizer so workers inherit it instead of rebuilding it.
    pool = multiprocessing.get_context("fork").Pool(
        args.workers, initializer=Encoder.initializer, initargs=(args, tokenizer, parts_dir)
    )
    return pool.imap(Encoder.encode_job, jobs, chunksize=1), pool


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
    stats = {"documents": 0, "tokens": 0, "bytes": 0}
    start = time.time()
    total_bytes = sum(os.path.getsize(p) for p in paths) * (1 if args.partitions == 1 else args.partitions)
    outputs, pool, bar = {}, None, None
    parts_dir = tempfile.mkdtemp(prefix=os.path.basename(args.output_prefix) + ".", suffix=".partial", dir=out_dir)
    try:
        outputs = {key: _Output(_output_prefix(args, key), dtype) for key in args.json_keys}
        bar = _progress(args, total_bytes)
        results, pool = _start_encoding(args, tokenizer, outputs, parts_dir)
        for result in results:
            if result[0] == "error":
                raise PreprocessError(result[1])
            _, per_key, n_docs, n_bytes = result
            for key, (path, offset, nbytes, lens, seqs_per_doc) in per_key.items():
                outputs[key].append(path, offset, nbytes, lens, seqs_per_doc)
                stats["tokens"] += nbytes // np.dtype(dtype).itemsize
            stats["documents"] += n_docs
            stats["bytes"] += n_bytes
            _report(args, bar, stats, start, n_bytes)
        if pool is not None:
            pool.close()
            pool.join()
        if stats["documents"] == 0:
            raise PreprocessError(f"--input {args.input}: no JSON lines found (empty input)")
        for output in outputs.values():
            output.finalize()
    except BaseException:
        if pool is not None:
            pool.terminate()
        for output in outputs.values():
            output.abort()
        raise
    finally:
        if bar is not None:
            bar.close()
        shutil.rmtree(parts_dir, ignore_errors=True)
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
