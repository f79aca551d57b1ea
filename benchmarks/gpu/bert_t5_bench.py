"""GPU benchmark: BERT-large and T5-220M through `pretrain_bert.py` / `pretrain_t5.py`, and a GPT model of
BERT-large's shape through `pretrain_gpt.py`, in one job on one GPU.

- BERT-large: 24 layers, hidden 1024, 16 heads, seq 512, binary head, bf16 (Megatron's
  examples/bert/train_bert_340m_distributed.sh shape; micro-batch --bert-mbs).
- GPT of the same shape: 24 layers, hidden 1024, 16 heads, seq 512, the same vocabulary size, mock data.
- T5-220M: 12 + 12 layers, hidden 768, kv-channels 64, ffn 3072, encoder seq 512, decoder seq 128,
  --vocab-extra-ids 100, micro-batch 64 (Megatron's examples/t5/train_t5_220m_distributed.sh).
The BERT/T5 corpus is written here (no network, no tokenizer): a synthetic BERT-style vocab.txt (30522 tokens
with `##` pieces) and a sentence-level `.bin/.idx` of random documents, so Megatron's masked datasets run as
in training. TFLOP/s/GPU is read from the framework's `throughput per GPU` log lines, i.e. Megatron's
`num_floating_point_operations` (the dense-transformer formula with causal-halved attention for every model;
for T5 Megatron counts `num_layers` = 12 layers at `seq_length` = the encoder length, not the
encoder-decoder), median over the log intervals after the first (which includes compilation). The GPT/BERT
numbers are also recomputed here from that formula and the step time (`tflops_formula`) as a check.
The pass line: BERT-large >= 90% of the GPT model's TFLOP/s.

  python benchmarks/gpu/bert_t5_bench.py --out benchmarks/gpu/results/bert_t5.json
  python benchmarks/gpu/bert_t5_bench.py --smoke        # tiny shapes on CPU (gloo), a few iterations
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import numpy

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

TFLOPS_RE = re.compile(r"throughput per GPU \(TFLOP/s/GPU\): ([0-9.]+)")
ELAPSED_RE = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")
LOSS_RE = re.compile(r"\| lm loss: ([0-9.E+-]+)")
MEM_RE = re.compile(r"max allocated: ([0-9.]+)")
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def shapes(smoke: bool, bert_mbs: int, t5_mbs: int):
    """(BERT/GPT model flags, T5 model flags, vocab size, BERT/GPT micro-batch, T5 micro-batch)."""
    if smoke:
        dense = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64"
        t5 = ("--encoder-num-layers 2 --decoder-num-layers 2 --hidden-size 64 --num-attention-heads 4 "
              "--kv-channels 16 --ffn-hidden-size 256 --encoder-seq-length 64 --decoder-seq-length 32 "
              "--max-position-embeddings 64")
        return dense, t5, 4200, 4, 4
    dense = ("--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 512 "
             "--max-position-embeddings 512")
    t5 = ("--encoder-num-layers 12 --decoder-num-layers 12 --hidden-size 768 --num-attention-heads 12 "
          "--kv-channels 64 --ffn-hidden-size 3072 --encoder-seq-length 512 --decoder-seq-length 128 "
          "--max-position-embeddings 512 --init-method-std 0.015")
    return dense, t5, 30522, bert_mbs, t5_mbs


def write_vocab(path: str, size: int) -> None:
    """BERT-layout vocab.txt: the specials, then whole words and `##` continuation pieces (1 in 4)."""
    words = [f"##p{i}" if i % 4 == 3 else f"w{i}" for i in range(size - len(SPECIALS))]
    with open(path, "w") as f:
        f.write("\n".join(SPECIALS + words) + "\n")


def write_corpus(prefix: str, vocab_size: int, num_docs: int, seed: int = 0) -> None:
    """Sentence-level `.bin/.idx` (what `preprocess_data.py --split-sentences` writes): documents of 10-60
    sentences of 8-48 random non-special token ids (~1000 tokens, so most BERT samples fill the sequence and
    the rest are the short-sequence and document-end samples, as on a Wikipedia-like corpus)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path

    rng = numpy.random.default_rng(seed)
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=numpy.int32)
    for _ in range(num_docs):
        lengths = rng.integers(8, 49, size=int(rng.integers(10, 61))).tolist()
        tokens = rng.integers(len(SPECIALS), vocab_size, size=sum(lengths)).astype(numpy.int32)
        builder.add_document(tokens, lengths)
    builder.finalize(get_idx_path(prefix))


def megatron_dense_flops(gbs: int, s: int, layers: int, h: int, padded_vocab: int) -> float:
    """Megatron's transformer_flops for a dense model with F = 4h, no GQA, kv-channels h/a, no MTP."""
    return 72.0 * gbs * s * layers * h * h * (1 + s / (12.0 * h) + padded_vocab / (12.0 * layers * h))


def padded(vocab: int, divisible: int = 128) -> int:
    """Megatron's padded vocabulary size at TP = 1."""
    return -(-vocab // divisible) * divisible


def jobs(args, work: str):
    """[(name, command)] for the three runs."""
    dense, t5, vocab_size, bert_mbs, t5_mbs = shapes(args.smoke, args.bert_mbs, args.t5_mbs)
    common = (f"--train-iters {args.iters} --log-interval {args.log_interval} --eval-iters 0 "
              "--eval-interval 1000000 --log-throughput --lr 1e-4 --min-lr 1e-5 --lr-decay-style linear "
              f"--lr-warmup-fraction 0.01 --weight-decay 1e-2 --clip-grad 1.0 --num-workers {args.num_workers}")
    if not args.smoke:
        common += " --bf16"
    else:
        common += " --distributed-backend gloo"
    bert_data = f"--data-path {work}/corpus_text_sentence --split 100,0,0 --data-cache-path {work}/cache"
    out = [
        ("gpt", f"pretrain_gpt.py {dense} --micro-batch-size {bert_mbs} --global-batch-size {bert_mbs} "
                f"--mock-data --tokenizer-type NullTokenizer --vocab-size {vocab_size - 1} {common}"),
        ("bert", f"pretrain_bert.py {dense} --micro-batch-size {bert_mbs} --global-batch-size {bert_mbs} "
                 f"{bert_data} --vocab-file {work}/vocab.txt --tokenizer-type BertWordPieceLowerCase {common}"),
        ("t5", f"pretrain_t5.py {t5} --micro-batch-size {t5_mbs} --global-batch-size {t5_mbs} --vocab-extra-ids 100 "
               f"{bert_data} --vocab-file {work}/vocab.txt --tokenizer-type BertWordPieceCase "
               f"--transformer-impl transformer_engine {common}"),
    ]
    return [(name, cmd) for name, cmd in out if name in args.only]


def run(name: str, cmd: str, log_dir: str, timeout: float):
    """Run one entry script; its parsed numbers and the log tail."""
    env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    start = time.time()
    log_path = os.path.join(log_dir, f"{name}.log")
    with open(log_path, "w") as log:
        try:
            rc = subprocess.run([sys.executable, *cmd.split()], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    text = open(log_path).read()
    tflops = [float(v) for v in TFLOPS_RE.findall(text)]
    elapsed = [float(v) for v in ELAPSED_RE.findall(text)]
    mem = [float(v) for v in MEM_RE.findall(text)]
    steady = elapsed[1:] if len(elapsed) > 1 else elapsed
    return {
        "rc": rc, "wall_s": round(time.time() - start, 1), "command": cmd,
        "tflops": round(statistics.median(tflops[1:] if len(tflops) > 1 else tflops), 3) if tflops else None,
        "tflops_all": tflops, "step_ms": round(statistics.median(steady), 1) if steady else None,
        "lm_losses": [float(v) for v in LOSS_RE.findall(text)],
        "peak_mem_gb": round(max(mem) / 1024, 1) if mem else None,
        "log_tail": "" if rc == 0 else text[-4000:],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, fp32, a few iterations")
    parser.add_argument("--iters", type=int, default=None, help="training iterations per run (default 50; smoke 4)")
    parser.add_argument("--log-interval", type=int, default=None, help="default 10; smoke 2")
    parser.add_argument("--bert-mbs", type=int, default=16, help="BERT/GPT micro-batch (= global batch)")
    parser.add_argument("--t5-mbs", type=int, default=64, help="T5 micro-batch (= global batch), Megatron's 64")
    parser.add_argument("--num-workers", type=int, default=None, help="DataLoader workers (default 8; smoke 1)")
    parser.add_argument("--only", default="gpt,bert,t5", help="comma-separated subset of gpt,bert,t5")
    parser.add_argument("--num-docs", type=int, default=None, help="synthetic corpus documents (default 4000)")
    parser.add_argument("--timeout", type=float, default=400, help="seconds per run")
    parser.add_argument("--work-dir", default=None, help="where the corpus and logs go (default: a temp dir)")
    parser.add_argument("--out", default=None, help="JSON file to write (also printed)")
    args = parser.parse_args(argv)
    args.iters = args.iters or (4 if args.smoke else 50)
    args.log_interval = args.log_interval or (2 if args.smoke else 10)
    args.num_workers = args.num_workers if args.num_workers is not None else (1 if args.smoke else 8)
    args.only = [name.strip() for name in args.only.split(",")]
    work = args.work_dir or tempfile.mkdtemp(prefix="bert_t5_bench_")
    os.makedirs(work, exist_ok=True)
    dense, _, vocab_size, bert_mbs, t5_mbs = shapes(args.smoke, args.bert_mbs, args.t5_mbs)
    write_vocab(os.path.join(work, "vocab.txt"), vocab_size)
    write_corpus(os.path.join(work, "corpus_text_sentence"), vocab_size,
                 args.num_docs or (100 if args.smoke else 4000))
    results = {}
    for name, cmd in jobs(args, work):
        results[name] = run(name, cmd, work, args.timeout)
        print(f"[bert_t5_bench] {name}: rc={results[name]['rc']} tflops={results[name]['tflops']} "
              f"step_ms={results[name]['step_ms']}", flush=True)
    layers, hidden, seq = (2, 64, 64) if args.smoke else (24, 1024, 512)
    for name in ("gpt", "bert"):
        if name in results and results[name]["step_ms"]:
            flops = megatron_dense_flops(bert_mbs, seq, layers, hidden, padded(vocab_size))
            results[name]["tflops_formula"] = round(flops / (results[name]["step_ms"] / 1000) / 1e12, 3)
    report = {"smoke": args.smoke, "device": _device(), "work_dir": work, "runs": results}
    # the log prints one decimal: at smoke sizes (0.0) the ratio falls back to the recomputed formula
    key = "tflops" if all(results.get(n, {}).get("tflops") for n in ("gpt", "bert")) else "tflops_formula"
    gpt, bert = results.get("gpt", {}).get(key), results.get("bert", {}).get(key)
    if gpt and bert:
        report["ratio_from"] = key
        report["bert_vs_gpt"] = round(bert / gpt, 3)
        report["bert_ge_90pct_of_gpt"] = bert >= 0.9 * gpt
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0 if all(r["rc"] == 0 for r in results.values()) else 1


def _device() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


if __name__ == "__main__":
    sys.exit(main())
