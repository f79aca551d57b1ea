"""`pretrain_gpt.py` with Megatron's rerun engine flags, on 2 gloo ranks (TP=2, one microbatch, dropout on): `--rerun-mode validate_results` with `--error-injection-rate 2` on the spiky-loss check (one
validation per iteration; exactly one of the two ranks injects, since the ranks draw the same number and add
their rank, and both re-run), for each `--error-injection-type`, through the checkpoint-and-resume protocol,
and `--rerun-mode report_stats`. The re-run of an iteration must see the same losses (same data, same dropout
masks); exit codes, checkpoints and the tracker file follow Megatron.

TP rather than DP: Megatron 0.13.1 saves the rerun state once per (PP, TP) position (the DP ranks are replicas
of DP rank 0's), so a resumed job only knows which call failed on a rank whose state was saved.
"""
import os

import torch

from megatron.core import rerun_state_machine as rsm
from tests.functional.cli import reset_training_state, run_pretrain_in_process
from tests.harness import run_on_ranks

BASE = (
    "--num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--micro-batch-size 1 --global-batch-size 1 --tensor-model-parallel-size 2 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
    "--vocab-size 4095 --log-interval 10 --eval-iters 0 --transformer-impl local --seed 7 --num-workers 0 "
    "--train-iters 4 --save-interval 100"
).split()


def _run(flags):
    code, losses = run_pretrain_in_process(BASE + flags)
    machine = rsm.get_rerun_state_machine()
    reset_training_state()
    return code, [loss for loss, _ in losses], machine


def _validate(kind, root, extra=()):
    return ["--rerun-mode", "validate_results", "--error-injection-rate", "2", "--error-injection-type", kind,
            "--no-check-for-nan-in-loss-and-grad", "--check-for-spiky-loss", "--save", root, *extra]


def _transient(tmp):
    root, tracker = os.path.join(tmp, "transient"), os.path.join(tmp, "rejected.txt")
    code, losses, _ = _run(_validate("transient_error", root, ["--result-rejected-tracker-filename", tracker]))
    assert code == rsm.EXIT_CODE_FAILED_ON_RESULT_VALIDATION, code
    assert len(losses) == 3 and losses[1] == losses[2]  # iteration 1 ran twice, identically
    assert open(os.path.join(root, "latest_checkpointed_iteration.txt")).read().strip() == "1"
    return losses, open(tracker).read()


# A resumed job builds its data loader after restoring the RNG, and the loader draws its seed from torch's
# generator (in Megatron too), so its dropout masks differ: the resume cases run without dropout.
NO_DROPOUT = ["--attention-dropout", "0", "--hidden-dropout", "0"]


def _persistent(tmp, monkeypatch_node):
    root = os.path.join(tmp, "persistent")
    code, losses, _ = _run(_validate("persistent_error", root, NO_DROPOUT))
    assert code == rsm.EXIT_CODE_RESUME_TO_DISAMBIGUATE, code
    assert len(losses) == 3 and losses[1] == losses[2]
    code, again, machine = _run(_validate("persistent_error", root, NO_DROPOUT + ["--load", root]))
    assert code == rsm.EXIT_CODE_RESUME_TO_DISAMBIGUATE and machine.state == rsm.RerunState.RERUNNING_AGAIN_FROM_CHECKPOINT
    monkeypatch_node("another-node")
    code, resumed, machine = _run(_validate("persistent_error", root, NO_DROPOUT + ["--load", root]))
    assert code == rsm.EXIT_CODE_FAILED_ON_RESULT_VALIDATION, code
    assert again == resumed == losses[1:2]  # the resumed job re-runs iteration 1 on its own data and RNG
    return True


def _correct_non_fatal(tmp, monkeypatch_node):
    root = os.path.join(tmp, "correct")
    code, losses, _ = _run(_validate("correct_result", root, NO_DROPOUT))
    assert code == rsm.EXIT_CODE_RESUME_TO_DISAMBIGUATE, code
    monkeypatch_node("another-node")
    code, resumed, machine = _run(_validate("correct_result", root, NO_DROPOUT + ["--load", root]))
    # Found correct and the spiky-loss check is not fatal: iteration 1 completes and training goes on, until the
    # injector strikes again in iteration 2 (a new diagnostic, a new checkpoint).
    assert code == rsm.EXIT_CODE_RESUME_TO_DISAMBIGUATE, code
    assert resumed[0] == losses[1] and len(resumed) == 3 and resumed[1] == resumed[2]
    assert machine.current_iteration == 2 and machine.state == rsm.RerunState.WILL_RERUN_FROM_CHECKPOINT
    assert open(os.path.join(root, "latest_checkpointed_iteration.txt")).read().strip() == "2"
    return True


def _report_stats():
    code, losses, machine = _run(["--rerun-mode", "report_stats", "--train-iters", "3"])
    assert code is None and len(losses) == 3 * 2
    assert losses[0::2] == losses[1::2]  # every iteration ran twice, identically
    return sorted((caller.message, s.zero_cnt, len(s.samples)) for caller, s in machine.stats.items())


def _worker(tmp):
    node = {"name": None}
    original = rsm._node_name
    rsm._node_name = lambda: node["name"] or original()

    def monkeypatch_node(name):
        node["name"] = name

    try:
        torch.manual_seed(0)
        transient = _transient(tmp)
        node["name"] = None
        persistent = _persistent(tmp, monkeypatch_node)
        node["name"] = None
        correct = _correct_non_fatal(tmp, monkeypatch_node)
        node["name"] = None
        return transient, persistent, correct, _report_stats()
    finally:
        rsm._node_name = original


def test_rerun_engine_command_lines(tmp_path):
    results = run_on_ranks(_worker, 2, str(tmp_path))
    (losses0, tracker), persistent, correct, stats0 = results[0]
    (losses1, _), _, _, stats1 = results[1]
    assert persistent and correct and results[1][1] and results[1][2]
    assert losses0 == losses1  # the TP ranks compute the same loss
    lines = tracker.splitlines()
    injected = [line for line in lines if "INITIAL_RUN" in line]
    # One rank of two injected, in the second iteration: `train` sets the machine's counter to the start iteration
    # and every iteration increments it first, so it counts from 1 like the log lines (Megatron's numbering).
    assert len(injected) == 1 and "iteration=2 " in injected[0]
    assert any("FIRST_RERUN_NOT_REPRODUCIBLE" in line for line in lines)
    # Determinism statistics of the NaN and the Inf check (all re-runs identical on CPU), reported every second
    # iteration (counter 2 of 1..3): rank 0 merged both ranks' first two iterations and added its third, rank 1
    # handed its statistics over and holds only its third.
    nan, inf = "found NaN in local forward loss calculation", "found Inf in local forward loss calculation"
    assert stats0 == [(inf, 5, 0), (nan, 5, 0)] and stats1 == [(inf, 1, 0), (nan, 1, 0)]
