"""Checkpoints written by Megatron-LM 0.13.1 itself load, evaluate and train on here; checkpoints written here
have Megatron's layout. Skipped when `shared/fixtures/megatron/` is absent.

For each dense case (fp32 torch_dist, bf16 + distributed optimizer, legacy `torch`, Llama-style bf16 +
distributed optimizer), through `pretrain` with Megatron's own flags (`expected.json`):

1. `--load DIR --skip-train` at the saved layout (TP=1) and at TP=2 (2 gloo ranks) prints Megatron's validation
   and test losses. With `--skip-train` both splits are evaluated from their start, which is what `expected.json`
   records. Tolerances: fp32 1e-5 relative (measured: <= 1.3e-7); bf16 5e-5 relative, since the bf16 weights are
   identical but Megatron ran its bf16 matmuls on an H200 and these run on the CPU with another accumulation
   order (measured: <= 6.3e-6).
2. The optimizer state the run loaded equals the checkpoint's tensors, rebuilt in model space by plain reshapes
   (`megatron_fixtures.optimizer_state_mismatch`), exactly: at TP=1 and at TP=2, into the distributed optimizer and
   into the non-distributed one (bf16 case without `--use-distributed-optimizer`), which reads Megatron's N-D
   flattened layout into other chunks.
3. Two more iterations after the load (`--train-iters 8`, the checkpoint's lr schedule): iteration 7's loss
   checks the weights, iteration 8's also the Adam state. References: the fp32 torch_dist and legacy fixtures hold
   the same state, and the legacy file is read by a separate path (torch's own `optimizer.load_state_dict`), so
   their iterations must agree (1e-6: the two paths may pick another Adam kernel); the bf16 state loaded into the
   non-distributed optimizer must train exactly like the distributed one; without the optimizer state
   (`--no-load-optim`) iteration 8 must differ (measured: 8e-4 relative). TP=2 must equal TP=1 within 1e-6 (fp32)
   and 1e-4 (bf16; measured: <= 1.1e-5).
4. The fp32 checkpoint (local spec) also evaluates to Megatron's losses in the Transformer-Engine spec.
5. The legacy checkpoint cannot be resharded (Megatron refuses too); at TP=2 it is first converted at its own layout
   with `--ckpt-convert-format torch_dist`, then loaded and trained on.
6. A checkpoint written here by `pretrain` with each case's flags has exactly Megatron's keys, global shapes and
   dtypes in `.metadata`, the same `common.pt` top-level keys, the same nested structure of the optimizer's common
   part and content metadata, and (legacy) the same file contents by key.

Two launches (1 rank, 2 ranks), about 25 s together.
"""
import argparse
import os

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron.core.dist_checkpointing import safe_load
from megatron.core.dist_checkpointing.safe_load import safe_torch_load
from tests.compat import megatron_fixtures as mf
from tests.functional.cli import reset_training_state, run_pretrain
from tests.harness import run_on_ranks

pytestmark = pytest.mark.skipif(not mf.available(), reason="shared/fixtures/megatron is not present")

RESUME = ("--train-iters", "8", "--use-checkpoint-opt_param-scheduler")
MICROBATCHES = 4  # global batch 8 / micro batch 2, DP=1
ITERATION = "iter_0000006"
TORCH_DIST = ("gpt_fp32_torch_dist", "gpt_bf16_distopt", "llama_bf16_distopt")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{case: extracted checkpoint folder}, unpacked once."""
    root = str(tmp_path_factory.mktemp("megatron_fixtures"))
    return {case: mf.extract(case, root) for case in mf.DENSE}


def _load_and_resume(case, load_dir, tp, *extra):
    """(valid/test losses, optimizer-state check, losses of iterations 7 and 8) of one case at TP=`tp`."""
    parallel = ("--tensor-model-parallel-size", str(tp))
    code, _, evaluations, built = mf.run(mf.flags(case, "--load", load_dir, "--skip-train", *parallel, *extra))
    assert code is None
    state = None
    if os.path.isfile(os.path.join(load_dir, ITERATION, "metadata.json")):
        state = mf.optimizer_state_mismatch(os.path.join(load_dir, ITERATION), built)
    code, losses, _, _ = mf.run(mf.flags(case, "--load", load_dir, *RESUME, *parallel, *extra))
    assert code is None and len(losses) == 2 * MICROBATCHES
    return {"eval": evaluations, "state": state, "resume": mf.iteration_losses(losses, MICROBATCHES)}


def _without_distributed_optimizer(case):
    return [f for f in mf.flags(case) if f != "--use-distributed-optimizer"]


def _one_rank(dirs, root):
    """Everything at the saved layout, the reference variants, the legacy conversion and our own saves."""
    results = {case: _load_and_resume(case, dirs[case], 1) for case in mf.DENSE}
    code, losses, _, _ = mf.run(mf.flags("gpt_fp32_torch_dist", "--load", dirs["gpt_fp32_torch_dist"], *RESUME,
                                         "--no-load-optim"))
    assert code is None
    results["no_optimizer_state"] = mf.iteration_losses(losses, MICROBATCHES)
    bf16 = _without_distributed_optimizer("gpt_bf16_distopt")
    code, _, _, built = mf.run([*bf16, "--load", dirs["gpt_bf16_distopt"], "--skip-train"])
    results["bf16_non_distributed_state"] = mf.optimizer_state_mismatch(
        os.path.join(dirs["gpt_bf16_distopt"], ITERATION), built)
    code, losses, _, _ = mf.run([*bf16, "--load", dirs["gpt_bf16_distopt"], *RESUME])
    results["bf16_non_distributed"] = mf.iteration_losses(losses, MICROBATCHES)
    te_spec = [f if f != "local" else "transformer_engine" for f in mf.flags("gpt_fp32_torch_dist")]
    code, _, results["te_spec"], _ = mf.run([*te_spec, "--load", dirs["gpt_fp32_torch_dist"], "--skip-train"])
    assert code is None
    code, _, _, _ = mf.run(mf.flags("gpt_torch_legacy", "--load", dirs["gpt_torch_legacy"], "--ckpt-convert-format",
                                    "torch_dist", "--ckpt-convert-save", os.path.join(root, "legacy_converted")))
    assert code == 0
    for case in mf.DENSE:
        code, _, _, _ = mf.run(mf.flags(case, "--save", os.path.join(root, "ours", case), "--save-interval", "6"))
        assert code is None
    results["allow_list_extended"] = list(safe_load._user_globals)
    reset_training_state()
    return results


def _two_ranks(dirs, root):
    """Every case at TP=2 (the legacy one through its torch_dist conversion)."""
    dirs = dict(dirs, gpt_torch_legacy=os.path.join(root, "legacy_converted", "torch_dist"))
    results = {case: _load_and_resume(case, dirs[case], 2) for case in mf.DENSE}
    bf16 = _without_distributed_optimizer("gpt_bf16_distopt")
    code, _, _, built = mf.run([*bf16, "--load", dirs["gpt_bf16_distopt"], "--skip-train",
                                "--tensor-model-parallel-size", "2"])
    assert code is None
    results["bf16_non_distributed_state"] = mf.optimizer_state_mismatch(
        os.path.join(dirs["gpt_bf16_distopt"], ITERATION), built)
    reset_training_state()
    return results


@pytest.fixture(scope="module")
def runs(checkpoints, tmp_path_factory):
    """(TP=1 results, TP=2 results as seen by the last rank, folder of our own checkpoints)."""
    root = str(tmp_path_factory.mktemp("compat_runs"))
    one = run_on_ranks(_one_rank, 1, checkpoints, root, timeout=600)[0]
    two = run_on_ranks(_two_ranks, 2, checkpoints, root, timeout=600)
    return one, two, os.path.join(root, "ours")


def _rel(a, b):
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("case", mf.DENSE)
def test_megatron_checkpoint_evaluates_to_megatron_losses(runs, case):
    one, two, _ = runs
    spec = mf.expected()["cases"][case]
    tolerance = 5e-5 if "--bf16" in spec["extra"] else 1e-5
    for layout, result in (("TP=1", one[case]), ("TP=2", two[-1][case])):
        for split in ("valid", "test"):
            got = result["eval"][split]
            assert _rel(got, spec[split]) <= tolerance, f"{case} at {layout}: {split} loss {got} vs Megatron's {spec[split]}"
    assert one["allow_list_extended"] == [], "the legacy file must load without extending the allow-list"


def test_local_spec_checkpoint_loads_into_the_te_spec(runs):
    """Keys are shared between the specs (Megatron maps the local norms to TE names); the TE spec's
    `core_attention._extra_state`, absent from a local-spec checkpoint, keeps the module's own."""
    spec = mf.expected()["cases"]["gpt_fp32_torch_dist"]
    te_spec = runs[0]["te_spec"]
    assert _rel(te_spec["valid"], spec["valid"]) <= 1e-5 and _rel(te_spec["test"], spec["test"]) <= 1e-5


@pytest.mark.parametrize("case", TORCH_DIST)
def test_loaded_optimizer_state_equals_the_checkpoint(runs, case):
    one, two, _ = runs
    for layout, (worst, compared) in (("TP=1", one[case]["state"]), ("TP=2 rank 0", two[0][case]["state"]),
                                      ("TP=2 rank 1", two[1][case]["state"])):
        assert compared > 0 and worst == 0.0, f"{case} at {layout}: {compared} tensors, max difference {worst}"


def test_distributed_optimizer_state_loads_into_the_non_distributed_optimizer(runs):
    one, two, _ = runs
    for layout, (worst, compared) in (("TP=1", one["bf16_non_distributed_state"]),
                                      ("TP=2 rank 0", two[0]["bf16_non_distributed_state"]),
                                      ("TP=2 rank 1", two[1]["bf16_non_distributed_state"])):
        assert compared > 0 and worst == 0.0, f"bf16 state into the non-distributed optimizer at {layout}: {worst}"


def test_training_continues_with_the_loaded_optimizer_state(runs):
    one, two, _ = runs
    fp32, legacy = one["gpt_fp32_torch_dist"]["resume"], one["gpt_torch_legacy"]["resume"]
    assert all(_rel(a, b) <= 1e-6 for a, b in zip(fp32, legacy)), (fp32, legacy)
    no_state = one["no_optimizer_state"]
    assert no_state[0] == fp32[0] and _rel(no_state[1], fp32[1]) > 1e-4, "iteration 8 must depend on the Adam state"
    assert one["bf16_non_distributed"] == one["gpt_bf16_distopt"]["resume"]
    for case in mf.DENSE:
        tolerance = 1e-4 if "--bf16" in mf.expected()["cases"][case]["extra"] else 1e-6
        for iteration, (a, b) in enumerate(zip(two[-1][case]["resume"], one[case]["resume"]), start=7):
            assert _rel(a, b) <= tolerance, f"{case}: iteration {iteration} at TP=2 {a} vs TP=1 {b}"


def test_pretrain_gpt_script_evaluates_the_legacy_file(checkpoints):
    """The command line of the issue, as a subprocess: the pickled legacy file loads with the default allow-list."""
    spec = mf.expected()["cases"]["gpt_torch_legacy"]
    result = run_pretrain(mf.flags("gpt_torch_legacy", "--load", checkpoints["gpt_torch_legacy"], "--skip-train"))
    assert result.returncode == 0, result.output[-3000:]
    losses = {v["prefix"].rsplit(" on ", 1)[-1]: float(v["value"]) for v in result.validations}
    assert _rel(losses["validation set"], spec["valid"]) <= 1e-5 and _rel(losses["test set"], spec["test"]) <= 1e-5


def _dcp_index(directory):
    metadata = FileSystemReader(directory).read_metadata().state_dict_metadata
    return {k: (tuple(v.size), v.properties.dtype) if isinstance(v, TensorStorageMetadata) else "bytes"
            for k, v in metadata.items()}


def _structure(value):
    """Nested keys of a common-state entry (integer-keyed entries collapsed to one)."""
    if isinstance(value, dict):
        numbered = [v for k, v in value.items() if isinstance(k, int)]
        named = {k: _structure(v) for k, v in value.items() if not isinstance(k, int)}
        return {**named, **({"<index>": _structure(numbered[0])} if numbered else {})}
    if isinstance(value, list):
        return [_structure(value[0])] if value else []
    return None


@pytest.mark.parametrize("case", TORCH_DIST)
def test_checkpoint_written_here_has_megatrons_layout(runs, checkpoints, case):
    ours = os.path.join(runs[2], case, ITERATION)
    theirs = os.path.join(checkpoints[case], ITERATION)
    assert _dcp_index(ours) == _dcp_index(theirs)
    ours_common, theirs_common = safe_torch_load(os.path.join(ours, "common.pt")), safe_torch_load(
        os.path.join(theirs, "common.pt"))
    assert sorted(ours_common) == sorted(theirs_common)
    assert _structure(ours_common["optimizer"]) == _structure(theirs_common["optimizer"])
    assert ours_common["content_metadata"] == theirs_common["content_metadata"]
    assert ours_common["rerun_state_machine"] == theirs_common["rerun_state_machine"]
    assert isinstance(ours_common["args"], argparse.Namespace)
    missing = sorted(set(vars(theirs_common["args"])) - set(vars(ours_common["args"])))
    assert len(missing) <= 2, f"args Megatron stores that ours lack: {missing}"


def test_legacy_file_written_here_has_megatrons_contents(runs, checkpoints):
    name = os.path.join(ITERATION, "mp_rank_00", "model_optim_rng.pt")
    ours = safe_torch_load(os.path.join(runs[2], "gpt_torch_legacy", name))
    theirs = safe_torch_load(os.path.join(checkpoints["gpt_torch_legacy"], name))
    assert sorted(ours) == sorted(theirs) and sorted(ours["model"]) == sorted(theirs["model"])
    assert {k: tuple(v.shape) for k, v in ours["model"].items() if torch.is_tensor(v)} == {
        k: tuple(v.shape) for k, v in theirs["model"].items() if torch.is_tensor(v)}
    assert _structure(ours["optimizer"]) == _structure(theirs["optimizer"])
    assert _structure(ours["rerun_state_machine"]) == _structure(theirs["rerun_state_machine"])
    assert _structure(ours["rng_state"]) == _structure(theirs["rng_state"])
    assert type(ours["rng_state"][0]["random_rng_state"]) is tuple
