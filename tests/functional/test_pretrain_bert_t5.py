"""Megatron's BERT (TP=2 PP=2, `--spec local`, `--ckpt-format torch`) and T5 (TP=2, `--transformer-impl local`,
`--calculate-per-token-loss`, `--ckpt-format torch_dist`) functional-test command lines, shrunk to a tiny
model and vocabulary, on CPU (gloo). Each trains 4 iterations saving at 2 and 4; a second run loads the
iteration-2 checkpoint (`--ckpt-step 2`, `--use-checkpoint-args`, `--use-checkpoint-opt_param-scheduler`)
and must log exactly the losses and grad norms of iterations 3 and 4. Megatron's loss names are checked
(`lm loss` and `sop loss` for BERT)."""
import pytest

from tests.functional.cli import run_pretrain
from tests.unit.data.masked_corpus import write_masked_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_masked_corpus(str(tmp_path_factory.mktemp("bt5_corpus")), num_docs=120)


COMMON = ["--log-interval", "1", "--save-interval", "2", "--eval-interval", "1000", "--eval-iters", "1",
          "--lr", "0.0001", "--min-lr", "0.00001", "--lr-warmup-fraction", "0.01", "--bf16", "--deterministic-mode",
          "--no-gradient-accumulation-fusion", "--distributed-backend", "gloo", "--split", "90,5,5"]


def _bert_flags(vocab, data, ckpt, cache):
    return ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--micro-batch-size", "2",
            "--global-batch-size", "8", "--seq-length", "32", "--max-position-embeddings", "32", "--train-iters", "4",
            "--lr-decay-iters", "990000", "--data-path", data, "--vocab-file", vocab,
            "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--spec", "local",
            "--attention-backend", "local", "--ckpt-format", "torch", "--save", ckpt, "--load", ckpt,
            "--data-cache-path", cache, *COMMON]


def _t5_flags(vocab, data, ckpt, cache):
    return ["--encoder-num-layers", "2", "--decoder-num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
            "4", "--kv-channels", "8", "--ffn-hidden-size", "64", "--encoder-seq-length", "48",
            "--decoder-seq-length", "32", "--max-position-embeddings", "48", "--tensor-model-parallel-size", "2",
            "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "4", "--lr-decay-iters", "4",
            "--lr-decay-style", "linear", "--weight-decay", "0.01", "--init-method-std", "0.015", "--clip-grad",
            "1.0", "--vocab-extra-ids", "100", "--vocab-file", vocab, "--tokenizer-type", "BertWordPieceCase",
            "--data-path", data, "--data-cache-path", cache, "--transformer-impl", "local",
            "--calculate-per-token-loss", "--ckpt-format", "torch_dist", "--save", ckpt, "--load", ckpt, *COMMON]


def _resume_is_exact(script, flags, nproc, loss_names):
    first = run_pretrain(flags, nproc=nproc, script=script, timeout=300)
    assert first.returncode == 0, first.output[-3000:]
    assert len(first.iterations) == 4 and not first.unmatched_log_lines, first.output[-3000:]
    assert set(first.iterations[0]["loss_values"]) == set(loss_names)
    resumed = run_pretrain(flags + ["--ckpt-step", "2", "--use-checkpoint-args",
                                    "--use-checkpoint-opt_param-scheduler"], nproc=nproc, script=script, timeout=300)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert [int(it["iteration"]) for it in resumed.iterations] == [3, 4], resumed.output[-3000:]
    for want, got in zip(first.iterations[2:], resumed.iterations):
        assert got["loss_values"] == want["loss_values"] and got["grad_norm"] == want["grad_norm"]
        assert got["lr"] == want["lr"]


def test_bert_tp2_pp2_megatron_command_line_and_exact_resume(corpus, tmp_path):
    vocab, data = corpus
    flags = _bert_flags(vocab, data, str(tmp_path / "ckpt"), str(tmp_path / "cache"))
    _resume_is_exact("pretrain_bert.py", flags, 4, {"lm loss", "sop loss"})


def test_t5_tp2_megatron_command_line_and_exact_resume_from_torch_dist(corpus, tmp_path):
    vocab, data = corpus
    flags = _t5_flags(vocab, data, str(tmp_path / "ckpt"), str(tmp_path / "cache"))
    _resume_is_exact("pretrain_t5.py", flags, 2, {"lm loss"})


def test_t5_with_pipeline_parallelism_is_refused_as_megatron_does(corpus, tmp_path):
    vocab, data = corpus
    flags = _t5_flags(vocab, data, str(tmp_path / "ckpt"), str(tmp_path / "cache"))
    at = flags.index("--tensor-model-parallel-size")
    flags[at:at + 2] = ["--pipeline-model-parallel-size", "2"]
    result = run_pretrain(flags, nproc=2, script="pretrain_t5.py", timeout=120)
    assert result.returncode != 0
    assert "--pipeline-model-parallel-size 2: T5 cannot be pipelined" in result.output, result.output[-3000:]
    assert "--encoder-pipeline-model-parallel-size" in result.output


def test_t5_tp4_megatron_command_line_runs(corpus, tmp_path):
    """Megatron's T5 TP=4 functional case (tiny: 4 heads, one per rank), two iterations, saved as torch_dist."""
    vocab, data = corpus
    flags = _t5_flags(vocab, data, str(tmp_path / "ckpt"), str(tmp_path / "cache"))
    at = flags.index("--tensor-model-parallel-size")
    flags[at + 1] = "4"
    at = flags.index("--train-iters")
    flags[at + 1] = "2"
    result = run_pretrain(flags, nproc=4, script="pretrain_t5.py", timeout=300)
    assert result.returncode == 0, result.output[-3000:]
    assert len(result.iterations) == 2 and not result.unmatched_log_lines, result.output[-3000:]
    assert set(result.iterations[0]["loss_values"]) == {"lm loss"}
    assert (tmp_path / "ckpt" / "iter_0000002").is_dir()
