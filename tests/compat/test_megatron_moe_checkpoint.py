"""The MoE checkpoint Megatron-LM 0.13.1 wrote (`moe_shared_expert`: 2 layers, 4 SequentialMLP experts, top-2,
alltoall, a shared expert, local spec, FP32Optimizer) through `pretrain` with Megatron's own flags
(`own_flags` in `expected.json`). Skipped when `shared/fixtures/megatron/` is absent.

1. `--load DIR --skip-train` at EP=1 (one rank) and at EP=2 (two gloo ranks) prints Megatron's validation and
   test loss (fp32: 1e-5 relative).
2. The optimizer state loaded at EP=1 equals the checkpoint's tensors exactly.
3. Two more iterations after the load (`--train-iters 6`, the checkpoint's schedule); iteration 6 depends on the
   loaded Adam state (`--no-load-optim` differs). At EP=2 the dense and expert params have separate (chained)
   optimizers whose keys differ from the file's one optimizer: loading its state raises a clear error, and with
   `--no-load-optim` the two iterations equal EP=1's with `--no-load-optim` (1e-6 relative).
4. A checkpoint written here with the same flags has exactly Megatron's keys, global shapes and dtypes.

Two launches (1 rank, 2 ranks), about 25 s together.
"""
import os

import pytest
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron.core.dist_checkpointing.safe_load import safe_torch_load
from tests.compat import megatron_fixtures as mf
from tests.functional.cli import reset_training_state
from tests.harness import run_on_ranks

pytestmark = pytest.mark.skipif(not mf.available(), reason="shared/fixtures/megatron is not present")

CASE = "moe_shared_expert"
ITERATION = "iter_0000004"
RESUME = ("--train-iters", "6", "--use-checkpoint-opt_param-scheduler")
MICROBATCHES = 4  # global batch 8 / micro batch 2, over all data-parallel ranks


def _flags(*extra):
    return [*mf.expected()["cases"][CASE]["own_flags"], *extra]


def _evaluate_and_resume(load_dir, ep, *extra):
    parallel = ("--expert-model-parallel-size", str(ep))
    code, _, evaluations, built = mf.run(_flags("--load", load_dir, "--skip-train", *parallel, *extra))
    assert code is None
    state = mf.optimizer_state_mismatch(os.path.join(load_dir, ITERATION), built) if ep == 1 else None
    code, losses, _, _ = mf.run(_flags("--load", load_dir, *RESUME, *parallel, *extra))
    assert code is None
    return {"eval": evaluations, "state": state, "resume": losses}


def _one_rank(load_dir, root):
    results = {"ep1": _evaluate_and_resume(load_dir, 1)}
    code, losses, _, _ = mf.run(_flags("--load", load_dir, *RESUME, "--no-load-optim"))
    assert code is None
    results["no_optimizer_state"] = losses
    code, _, _, _ = mf.run(_flags("--save", os.path.join(root, "ours"), "--save-interval", "4"))
    assert code is None
    reset_training_state()
    return results


def _two_ranks(load_dir):
    results = {"ep2": _evaluate_and_resume(load_dir, 2, "--no-load-optim")}
    try:
        mf.run(_flags("--load", load_dir, *RESUME, "--expert-model-parallel-size", "2"))
        results["optimizer_error"] = None
    except RuntimeError as error:
        results["optimizer_error"] = str(error)
    reset_training_state()
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("moe_fixture"))
    load_dir = mf.extract(CASE, root)
    one = run_on_ranks(_one_rank, 1, load_dir, root, timeout=600)[0]
    two = run_on_ranks(_two_ranks, 2, load_dir, timeout=600)
    return load_dir, root, one, two


def _rel(a, b):
    return abs(a - b) / abs(b)


def test_megatron_moe_checkpoint_evaluates_to_megatron_losses(runs):
    _, _, one, two = runs
    spec = mf.expected()["cases"][CASE]
    for layout, result in (("EP=1", one["ep1"]), ("EP=2", two[-1]["ep2"])):
        for split in ("valid", "test"):
            got = result["eval"][split]
            assert _rel(got, spec[split]) <= 1e-5, f"{layout}: {split} loss {got} vs Megatron's {spec[split]}"


def test_loaded_moe_optimizer_state_equals_the_checkpoint(runs):
    worst, compared = runs[2]["ep1"]["state"]
    assert compared > 0 and worst == 0.0, (worst, compared)


def test_moe_training_continues_at_another_expert_parallel_size(runs):
    _, _, one, two = runs
    ep1 = mf.iteration_losses(one["ep1"]["resume"], MICROBATCHES)
    no_state = mf.iteration_losses(one["no_optimizer_state"], MICROBATCHES)
    # DP=2 at EP=2: each rank holds (loss sum, tokens) of its half of every global batch
    halves = [rank["ep2"]["resume"] for rank in two]
    ep2 = mf.iteration_losses([pair for i in range(0, len(halves[0]), 2) for half in halves
                               for pair in half[i:i + 2]], MICROBATCHES)
    assert len(ep1) == 2 and len(ep2) == 2
    assert no_state[0] == ep1[0] and _rel(no_state[1], ep1[1]) > 1e-5, "iteration 6 must depend on the Adam state"
    for iteration, (a, b) in enumerate(zip(ep2, no_state), start=5):
        assert _rel(a, b) <= 1e-6, f"iteration {iteration}: EP=2 {a} vs EP=1 {b} (weights only)"


def test_moe_optimizer_state_that_cannot_be_resharded_raises_a_clear_error(runs):
    """At EP=2 the dense and expert params have separate optimizers (Megatron's `chained_<i>.` keys); the
    fixture's single optimizer's state cannot be read into them (Megatron fails too, with missing keys)."""
    for rank in runs[3]:
        error = rank["optimizer_error"]
        assert error is not None and "chained optimizer" in error and "--no-load-optim" in error, error


def _dcp_index(directory):
    metadata = FileSystemReader(directory).read_metadata().state_dict_metadata
    return {k: (tuple(v.size), v.properties.dtype) if isinstance(v, TensorStorageMetadata) else "bytes"
            for k, v in metadata.items()}


def test_moe_checkpoint_written_here_has_megatrons_keys(runs):
    load_dir, root, _, _ = runs
    ours, theirs = os.path.join(root, "ours", ITERATION), os.path.join(load_dir, ITERATION)
    ours_index, theirs_index = _dcp_index(ours), _dcp_index(theirs)
    assert "decoder.layers.mlp.experts.experts.linear_fc1.weight" in theirs_index  # SequentialMLP, stacked
    assert any(".shared_experts." in k for k in theirs_index)
    assert sorted(set(theirs_index) ^ set(ours_index)) == []
    assert ours_index == theirs_index
    ours_common = safe_torch_load(os.path.join(ours, "common.pt"))
    theirs_common = safe_torch_load(os.path.join(theirs, "common.pt"))
    assert sorted(ours_common) == sorted(theirs_common)
