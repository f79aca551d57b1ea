"""MoE torch_dist checkpoints reshard across expert-parallel layouts through `pretrain`; the legacy `torch` format
resumes at its own layout. Two launches (4 gloo ranks, then 1).

A tiny MoE GPT (4 SequentialMLP experts, top-2, aux + z loss, alltoall, fp32, Adam) trains 4 iterations at
DP=4 with EP=2 and expert TP (ETP) 2, saving weights and optimizer state at iteration 2. Loaded at
- EP=4 / ETP=1 and EP=2 / ETP=1 (same 4 ranks): iterations 3 and 4 equal the uninterrupted run (1e-6 relative:
  the expert grads are reduced over other groups); iteration 4 also checks the expert Adam state, which is
  stored in model space and so reshards with the weights;
- EP=1 (one rank): its single optimizer cannot read the state of the saved run's two chained optimizers (dense,
  expert): a clear error; with `--no-load-optim` iteration 3 (weights only) equals the uninterrupted run.
The same run in the legacy `--ckpt-format torch` (per-rank files named by TP and EP rank, so at ETP=1 = TP)
resumes exactly at its layout; saving it with ETP != TP is refused at argument validation.
Losses are the global batch's: the (loss sum, tokens) pairs of all data-parallel ranks.
"""
import os

from tests.compat import megatron_fixtures as mf
from tests.functional.cli import reset_training_state
from tests.harness import run_on_ranks

FLAGS = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--micro-batch-size 2 --global-batch-size 8 --mock-data --tokenizer-type NullTokenizer --vocab-size 4095 "
    "--log-interval 1 --eval-iters 0 --hidden-dropout 0 --attention-dropout 0 --seed 1234 --lr 1e-3 "
    "--lr-warmup-iters 1 --train-iters 4 --transformer-impl local --disable-bias-linear --swiglu "
    "--normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights --num-experts 4 "
    "--moe-router-topk 2 --moe-ffn-hidden-size 48 --ffn-hidden-size 48 --moe-aux-loss-coeff 1e-2 "
    "--moe-z-loss-coeff 1e-3 --moe-token-dispatcher-type alltoall --use-checkpoint-opt_param-scheduler"
).split()
SAVED = ("--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2")
MICROBATCHES = 4  # per global batch, over all data-parallel ranks


def _run(*extra):
    code, losses, _, _ = mf.run([*FLAGS, *extra])
    assert code is None
    return losses


def _four_ranks(root):
    dist, legacy = os.path.join(root, "dist"), os.path.join(root, "legacy")
    results = {"full": _run(*SAVED, "--ckpt-format", "torch_dist", "--save", dist, "--save-interval", "2")}
    for name, layout in (("ep4", ("--expert-model-parallel-size", "4")),
                         ("ep2_etp1", ("--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"))):
        results[name] = _run(*layout, "--ckpt-format", "torch_dist", "--load", dist, "--ckpt-step", "2")
    legacy_layout = ("--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1")
    results["legacy_full"] = _run(*legacy_layout, "--ckpt-format", "torch", "--save", legacy, "--save-interval", "2")
    results["legacy_resumed"] = _run(*legacy_layout, "--ckpt-format", "torch", "--load", legacy, "--ckpt-step", "2")
    reset_training_state()
    return results


def _one_rank(root):
    dist = os.path.join(root, "dist")
    results = {"ep1": _run("--load", dist, "--ckpt-step", "2", "--no-load-optim")}
    try:
        _run("--load", dist, "--ckpt-step", "2")
        results["optimizer_error"] = None
    except RuntimeError as error:
        results["optimizer_error"] = str(error)
    reset_training_state()
    return results


def _global(per_rank, name):
    """Per-iteration losses of the global batch from every rank's (loss sum, tokens) pairs of `name`."""
    lists = [rank[name] for rank in per_rank]
    per_rank_iteration = MICROBATCHES * len(lists[0]) // sum(len(x) for x in lists)
    pairs = [pair for i in range(0, len(lists[0]), per_rank_iteration) for losses in lists
             for pair in losses[i:i + per_rank_iteration]]
    return mf.iteration_losses(pairs, MICROBATCHES)


def _rel(a, b):
    return abs(a - b) / abs(b)


def test_moe_torch_dist_reshards_across_expert_layouts_and_legacy_resumes(tmp_path):
    four = run_on_ranks(_four_ranks, 4, str(tmp_path), timeout=600)
    one = run_on_ranks(_one_rank, 1, str(tmp_path), timeout=600)[0]
    full = _global(four, "full")
    assert len(full) == 4 and full[3] < full[0], full
    for name in ("ep4", "ep2_etp1"):
        resumed = _global(four, name)
        assert len(resumed) == 2, resumed
        for iteration, (a, b) in enumerate(zip(resumed, full[2:]), start=3):
            assert _rel(a, b) <= 1e-6, f"{name}: iteration {iteration} {a} vs the uninterrupted run's {b}"
    legacy_full, legacy_resumed = _global(four, "legacy_full"), _global(four, "legacy_resumed")
    assert len(legacy_full) == 4, legacy_full
    assert legacy_resumed == legacy_full[2:], (legacy_resumed, legacy_full)
    ep1 = mf.iteration_losses(one["ep1"], MICROBATCHES)
    assert _rel(ep1[0], full[2]) <= 1e-6, (ep1, full)
    assert _rel(ep1[1], full[3]) > 1e-6, "iteration 4 without the Adam state must differ"
    error = one["optimizer_error"]
    assert error is not None and "chained optimizer" in error and "--no-load-optim" in error, error
