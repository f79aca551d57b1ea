"""tools/preprocess_data.py and tools/merge_datasets.py as command lines (run in-process)."""
import gzip
import json
import os
import shutil
import sys

import numpy as np
import pytest

from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.training.tokenizer.gpt2_tokenization import GPT2BPE
from tests.unit.tokenizer.tiny_assets import TEXT, write_gpt2_files, write_jsonl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import merge_datasets  # noqa: E402
import preprocess_data  # noqa: E402


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    d = tmp_path_factory.mktemp("pp")
    vocab, merges = write_gpt2_files(str(d))
    words = TEXT.split()
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(words, size=int(rng.integers(1, 60)))) for _ in range(300)]
    texts[7] = ""
    return d, vocab, merges, texts


def run(d, vocab, merges, name, inp, *extra):
    prefix = str(d / name)
    argv = ["--input", inp, "--output-prefix", prefix, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
            vocab, "--merge-file", merges, "--no-progress-bar", *extra]
    return preprocess_data.main(argv), prefix


def test_outputs_workers_partitions_gz_and_merge(assets, capsys):
    d, vocab, merges, texts = assets
    inp = write_jsonl(str(d / "in.jsonl"), texts)
    rc1, p1 = run(d, vocab, merges, "w1", inp, "--workers", "1", "--append-eod")
    rc2, p2 = run(d, vocab, merges, "w2", inp, "--workers", "2", "--append-eod")
    assert rc1 == rc2 == 0
    for ext in (".bin", ".idx"):
        assert open(p1 + "_text_document" + ext, "rb").read() == open(p2 + "_text_document" + ext, "rb").read()
    ds = IndexedDataset(p1 + "_text_document")
    bpe = GPT2BPE(vocab, merges)
    eod = bpe.encoder["<|endoftext|>"]
    nonempty = [t for t in texts if t]
    # Documents with no tokens are skipped entirely: no document entry, no EOD (spec §6.2).
    assert ds.index.dtype == np.uint16 and len(ds.document_indices) == len(nonempty) + 1
    assert ds.document_indices.tolist() == list(range(len(nonempty) + 1))
    expected = [bpe.encode(t) + [eod] for t in nonempty]
    assert [x.tolist() for x in ds[0 : len(ds)]] == expected
    with gzip.open(str(d / "in.jsonl.gz"), "wt") as f:
        f.write(open(inp).read())
    rc, pg = run(d, vocab, merges, "gz", str(d / "in.jsonl.gz"), "--workers", "2", "--partitions", "2")
    assert rc == 0
    gz = IndexedDataset(pg + "_text_document")
    round_robin = [t for i in (0, 1) for t in texts[i::2] if t]
    assert [x.tolist() for x in gz[0 : len(gz)]] == [bpe.encode(t) for t in round_robin]
    merge_dir = d / "merge"
    merge_dir.mkdir()
    for p in (p1, pg):
        for ext in (".bin", ".idx"):
            shutil.copy(p + "_text_document" + ext, merge_dir / (os.path.basename(p) + ext))
    assert merge_datasets.main(["--input", str(merge_dir), "--output-prefix", str(d / "merged")]) == 0
    merged = IndexedDataset(str(d / "merged"))
    assert len(merged) == len(gz) + len(ds) and merged[0].tolist() == gz[0].tolist()


def bpe_ids(text, vocab, merges):
    bpe = GPT2BPE(vocab, merges)
    return bpe.encode(text) + [bpe.encoder["<|endoftext|>"]]


def test_sentences_and_multiple_keys(assets):
    d, vocab, merges, _ = assets
    inp = str(d / "keys.jsonl")
    with open(inp, "w") as f:
        for i in range(5):
            f.write(json.dumps({"text": f"First one {i}. Second one here! Third?", "title": f"Title {i}"}) + "\n")
        f.write(json.dumps({"text": ["pre split", "sentences"], "title": "x"}) + "\n")
        f.write(json.dumps({"text": ["", ""], "title": "y"}) + "\n")
    rc, p = run(d, vocab, merges, "ss", inp, "--workers", "1", "--split-sentences", "--append-eod",
                "--json-keys", "text", "title")
    assert rc == 0
    text = IndexedDataset(p + "_text_sentence")
    title = IndexedDataset(p + "_title_sentence")
    # The last line's text has no tokens: no text document for it, but its title is one.
    assert len(text) == 5 * 3 + 2 and len(title) == 7
    assert text.document_indices.tolist() == [0, 3, 6, 9, 12, 15, 17]
    assert title.document_indices.tolist() == list(range(8))
    assert title[6].tolist() == bpe_ids("y", vocab, merges)
    bpe = GPT2BPE(vocab, merges)
    assert text[2].tolist() == bpe.encode("Third?") + [bpe.encoder["<|endoftext|>"]]
    assert text[0].tolist() == bpe.encode("First one 0.")


def test_bad_inputs_fail_once_and_leave_nothing(assets, capsys):
    d, vocab, merges, texts = assets
    good = write_jsonl(str(d / "good.jsonl"), texts[:5])
    bad = str(d / "bad.jsonl")
    with open(bad, "w") as f:
        f.write(json.dumps({"text": "ok"}) + "\n{not json\n")
    empty = str(d / "empty.jsonl")
    open(empty, "w").close()
    cases = [
        ([bad], "bad.jsonl:2: malformed JSON"),
        ([good, "--json-keys", "body"], "key(s) ['body'] missing"),
        ([empty], "empty"),
    ]
    for extra, message in cases:
        rc, prefix = run(d, vocab, merges, "err", extra[0], "--workers", "2", *extra[1:])
        err = capsys.readouterr().err
        assert rc == 1 and message in err, err
        leftovers = [n for n in os.listdir(d) if n.startswith("err_")]
        assert leftovers == [], leftovers
    rc, _ = run(d, str(d / "missing.json"), merges, "err", good, "--workers", "1")
    assert rc == 1 and "--vocab-file" in capsys.readouterr().err


def test_byte_ranges_many_chunks_two_keys_and_error_lines(assets, monkeypatch, capsys):
    """Workers read their own byte ranges and write their own token files; the output is the same for
    1, 2 and 3 workers, every temporary file is gone, and errors name the right line of a late range."""
    d, vocab, merges, texts = assets
    monkeypatch.setattr(preprocess_data, "CHUNK_BYTES", 700)
    monkeypatch.setattr(preprocess_data, "MIN_CHUNK_BYTES", 64)
    inp = str(d / "ranges.jsonl")
    with open(inp, "w") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"text": t, "title": f"T{i}"}) + ("\n\n" if i % 37 == 0 else "\n"))
        f.write(json.dumps({"text": "no newline at the end", "title": "last"}))
    ranges = preprocess_data.line_ranges(inp, 2)
    data = open(inp, "rb").read()
    assert len(ranges) > 20 and ranges[0][0] == 0 and ranges[-1][1] == len(data)
    assert all(a[1] == b[0] and data[a[1] - 1 : a[1]] == b"\n" for a, b in zip(ranges, ranges[1:]))
    outputs = []
    for workers in ("1", "2", "3"):
        rc, prefix = run(d, vocab, merges, f"rk{workers}", inp, "--workers", workers, "--append-eod",
                         "--json-keys", "text", "title")
        assert rc == 0
        names = [f"{prefix}_{k}_document{e}" for k in ("text", "title") for e in (".bin", ".idx")]
        outputs.append([open(name, "rb").read() for name in names])
    assert outputs[0] == outputs[1] == outputs[2]
    assert not [n for n in os.listdir(d) if n.endswith(".partial")]
    bpe = GPT2BPE(vocab, merges)
    ds = IndexedDataset(str(d / "rk2_text_document"))
    assert ds[len(ds) - 1].tolist() == bpe.encode("no newline at the end") + [bpe.encoder["<|endoftext|>"]]
    bad = str(d / "late_error.jsonl")
    lines = [json.dumps({"text": t or "x"}) for t in texts[:200]]
    lines[150] = '{"text": broken'
    with open(bad, "w") as f:
        f.write("\n".join(lines) + "\n")
    rc, _ = run(d, vocab, merges, "lt", bad, "--workers", "2")
    err = capsys.readouterr().err
    assert rc == 1 and "late_error.jsonl:151: malformed JSON" in err, err
    assert not [n for n in os.listdir(d) if n.startswith("lt")]
