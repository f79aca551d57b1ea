"""Megatron's hybrid functional-test command lines (`pretrain_mamba.py`, `--spec megatron.core.models.mamba.
mamba_layer_specs mamba_stack_spec`, TP=1, TP=2, PP=4), shrunk to a tiny model, on CPU (gloo).

TP=2 trains 3 iterations saving a torch_dist checkpoint at 2; a second run loads it and must log exactly the loss
and grad norm of iteration 3. A TP=1 run then loads the TP=2 checkpoint (resharding: the mixer's split keys are
TP-invariant) and its loss must equal the TP=2 run's iteration-3 loss to bf16 noise. PP=4 (one layer per stage)
trains two iterations.
"""
from tests.functional.cli import run_pretrain

SPEC = ["--spec", "megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec"]


def _flags(ckpt, tp=1, pp=1, iters=3):
    return ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--group-query-attention",
            "--num-query-groups", "2", "--hybrid-override-pattern", "M*M-", *SPEC, "--is-hybrid-model",
            "--mamba-state-dim", "8", "--mamba-head-dim", "8", "--mamba-num-groups", "2",
            "--position-embedding-type", "none", "--normalization", "RMSNorm", "--disable-bias-linear",
            "--untie-embeddings-and-output-weights", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
            "--init-method-std", "0.0198", "--micro-batch-size", "2", "--global-batch-size", "8",
            "--seq-length", "32", "--max-position-embeddings", "32", "--train-iters", str(iters),
            "--lr", "0.0003", "--min-lr", "0.00003", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1",
            "--clip-grad", "1.0", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "4096", "--split", "99,1,0",
            "--log-interval", "1", "--save-interval", "2", "--eval-interval", "1000", "--eval-iters", "1",
            "--bf16", "--deterministic-mode", "--no-gradient-accumulation-fusion", "--distributed-backend", "gloo",
            "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--sequence-parallel" if tp > 1 else "--no-create-attention-mask-in-dataloader",
            "--ckpt-format", "torch_dist", "--save", ckpt, "--load", ckpt]


def _ok(result):
    assert result.returncode == 0, result.output[-3000:]
    assert not result.unmatched_log_lines, result.unmatched_log_lines


def test_hybrid_tp2_exact_resume_and_tp1_reshard(tmp_path):
    ckpt = str(tmp_path / "tp2")
    first = run_pretrain(_flags(ckpt, tp=2), nproc=2, script="pretrain_mamba.py", timeout=300)
    _ok(first)
    assert len(first.iterations) == 3 and "lm loss" in first.iterations[0]["loss_values"]
    assert first.iterations[0]["tflops"] is None or float(first.iterations[0]["tflops"]) >= 0
    resumed = run_pretrain(_flags(ckpt, tp=2) + ["--ckpt-step", "2"], nproc=2, script="pretrain_mamba.py",
                           timeout=300)
    _ok(resumed)
    assert [int(it["iteration"]) for it in resumed.iterations] == [3], resumed.output[-3000:]
    want, got = first.iterations[2], resumed.iterations[0]
    assert got["loss_values"] == want["loss_values"] and got["grad_norm"] == want["grad_norm"]
    resharded = run_pretrain(_flags(ckpt, tp=1) + ["--ckpt-step", "2", "--no-load-optim", "--no-load-rng",
                                                    "--no-save-optim"], script="pretrain_mamba.py", timeout=300)
    _ok(resharded)
    got, want = resharded.iterations[0]["loss_values"]["lm loss"], first.iterations[2]["loss_values"]["lm loss"]
    assert abs(got - want) < 2e-2 * abs(want), (got, want)


def test_hybrid_pp4_trains(tmp_path):
    pp4 = run_pretrain(_flags(str(tmp_path / "pp4"), pp=4, iters=2), nproc=4, script="pretrain_mamba.py",
                       timeout=300)
    _ok(pp4)
    assert [int(it["iteration"]) for it in pp4.iterations] == [1, 2]
    assert all(7.0 < it["loss_values"]["lm loss"] < 9.5 for it in pp4.iterations)  # about ln(4096) = 8.3
