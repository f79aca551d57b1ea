"""The `args` Namespace as Megatron-LM 0.13.1 has it.

After parse + validate, the attributes are every flag's dest (`megatron_flags.json`) except the five deprecated
ones Megatron deletes, plus the values its validate_args derives, with their types. When the real Megatron
checkpoints are present, a checkpoint written here by `pretrain_gpt.py` (legacy `torch` format, the fixture's
command line) holds args with exactly the attribute names and types of Megatron's own, and optimizer param
groups with Megatron's kernel flags (fused/foreach None).
"""
import contextlib
import glob
import io
import json
import os

import pytest
import torch

from megatron.core.dist_checkpointing.safe_load import safe_torch_load
from megatron.core.enums import ModelType
from megatron.training.arguments import _parse, validate_args
from megatron.training.arguments.derive import DEPRECATED_DESTS
from tests.compat import megatron_fixtures as mf
from tests.functional.cli import reset_training_state, run_pretrain_in_process
from tests.harness import repo_root, run_on_ranks

FLAGS_JSON = os.path.join(repo_root(), "..", "shared", "spec", "megatron_flags.json")
# What validate_args adds (name -> type), and what a training run adds before saving a checkpoint.
DERIVED = {"data_parallel_size": int, "transformer_pipeline_model_parallel_size": int, "variable_seq_lengths": bool,
           "params_dtype": torch.dtype, "use_dist_ckpt": bool, "consumed_train_samples": int,
           "consumed_valid_samples": int, "skipped_train_samples": int, "iteration": int, "rank": int,
           "world_size": int, "virtual_pipeline_model_parallel_size": type(None)}
AT_RUN_TIME = {"padded_vocab_size": int, "do_train": int, "do_valid": int, "do_test": int, "curr_iteration": int,
               "model_type": ModelType, "num_floating_point_operations_so_far": int}
# This framework's own flags (manifest status "added": the optimisation plan's choices) and the resolved plan
# (`optimization_plan`, saved with the args at model build time): extra attributes Megatron ignores when it reads
# our checkpoints (it reads args with getattr), and nothing of Megatron's is missing or retyped.
with open(os.path.join(repo_root(), "megatron", "training", "arguments", "manifest.json")) as _f:
    ADDED = {flag.lstrip("-").replace("-", "_") for flag, entry in json.load(_f).items() if entry["status"] == "added"}
ADDED_AT_RUN_TIME = {"optimization_plan"}
COMMAND_LINE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings "
                "16 --micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --train-iters 4 --mock-data "
                "--tokenizer-type NullTokenizer --vocab-size 4095").split()


@pytest.mark.skipif(not os.path.isfile(FLAGS_JSON), reason="shared/spec/megatron_flags.json is not present")
def test_validated_args_have_megatrons_attributes():
    with open(FLAGS_JSON) as f:
        dests = {entry["dest"] for entry in json.load(f)}
    args = _parse(COMMAND_LINE)
    args.rank, args.world_size, args.local_rank = 0, 1, 0
    with contextlib.redirect_stdout(io.StringIO()):
        validate_args(args, {})
    names = set(vars(args))
    assert not names & set(DEPRECATED_DESTS), "validate_args must delete the deprecated flags, as Megatron does"
    assert names - dests == set(DERIVED) | ADDED, sorted(names - dests)
    assert dests - names == set(DEPRECATED_DESTS), sorted(dests - names)
    for name, kind in DERIVED.items():
        assert isinstance(getattr(args, name), kind), (name, type(getattr(args, name)))
    assert args.transformer_pipeline_model_parallel_size == 1 and args.variable_seq_lengths is False


def _save_legacy_checkpoint(root):
    flags = mf.flags("gpt_torch_legacy", "--save", root, "--save-interval", "6", "--eval-iters", "0")
    code, _ = run_pretrain_in_process(flags)
    reset_training_state()
    return code


@pytest.mark.skipif(not mf.available(), reason="shared/fixtures/megatron is not present")
def test_saved_args_and_param_groups_match_megatrons_checkpoint(tmp_path):
    assert run_on_ranks(_save_legacy_checkpoint, 1, str(tmp_path / "ours")) == [None]
    ours = safe_torch_load(glob.glob(str(tmp_path / "ours" / "iter_*" / "mp_rank_00" / "model_optim_rng.pt"))[0])
    theirs_dir = mf.extract("gpt_torch_legacy", str(tmp_path))
    theirs = safe_torch_load(glob.glob(os.path.join(theirs_dir, "iter_*", "mp_rank_00", "model_optim_rng.pt"))[0])
    ours_args, theirs_args = vars(ours["args"]), vars(theirs["args"])
    ours_own = ADDED | ADDED_AT_RUN_TIME
    assert set(ours_args) - ours_own == set(theirs_args), (sorted(set(ours_args) - ours_own - set(theirs_args)),
                                                           sorted(set(theirs_args) - set(ours_args)))
    assert ours_own <= set(ours_args)
    mismatched = {name: (type(theirs_args[name]).__name__, type(ours_args[name]).__name__)
                  for name in theirs_args if type(theirs_args[name]) is not type(ours_args[name])}
    assert not mismatched, mismatched
    for name, kind in AT_RUN_TIME.items():
        assert isinstance(ours_args[name], kind), name
    kernel_flags = [{k: group[k] for k in ("fused", "foreach", "capturable")}
                    for group in ours["optimizer"]["param_groups"]]
    assert kernel_flags == [{k: group[k] for k in ("fused", "foreach", "capturable")}
                            for group in theirs["optimizer"]["param_groups"]]
