"""`--ckpt-format torch_dcp`: plain torch.distributed.checkpoint directories (`.metadata` + `__r_k.distcp`, no
common.pt, no metadata.json), saved and resumed through `pretrain` on 2 gloo ranks with plain DDP and with
torch FSDP2 (DTensor parameters and optimizer state). Iterations 3 and 4 after loading iteration 2 must equal the
uninterrupted run's bit for bit (same layout, fp32, same reduction order): iteration 3's loss checks the weights,
iteration 4's also the Adam state. The DDP checkpoint is loaded with the
default `--ckpt-format torch_dist` and `--auto-detect-ckpt-format`; the FSDP2 one (DTensors sharded over 2 ranks)
also into plain DDP on one rank. Dropout is off so that the one-rank run sees the same math.
"""
import argparse
import os

import pytest

import torch
import torch.distributed.checkpoint as dcp

from megatron.core.dist_checkpointing.mapping import CheckpointingException
from megatron.core.dist_checkpointing.strategies import torch_dcp
from megatron.training.checkpointing import announce_checkpoint_format
from megatron.training.checkpointing_dist import read_torch_dcp_args, torch_dcp_layout_problems
from tests.functional.cli import reset_training_state, run_pretrain_in_process
from tests.harness import run_on_ranks

BASE = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 "
    "--micro-batch-size 1 --global-batch-size 2 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
    "--vocab-size 4095 --log-interval 10 --eval-iters 0 --transformer-impl local --seed 7 --swiglu --num-workers 0 "
    "--untie-embeddings-and-output-weights --attention-dropout 0 --hidden-dropout 0 --train-iters 4"
).split()
PER_ITER = 1  # microbatches per iteration on each of the 2 DP ranks


def _save_and_resume(root):
    results = {}
    for name, extra, load_flags in (
        ("ddp", [], ["--ckpt-format", "torch_dist", "--auto-detect-ckpt-format"]),
        ("fsdp2", ["--use-torch-fsdp2"], ["--ckpt-format", "torch_dcp"]),
    ):
        save = os.path.join(root, name)
        code, full = run_pretrain_in_process(BASE + extra + ["--ckpt-format", "torch_dcp", "--save", save,
                                                             "--save-interval", "2"])
        assert code is None and len(full) == 4 * PER_ITER
        code, resumed = run_pretrain_in_process(BASE + extra + load_flags + ["--load", save, "--ckpt-step", "2"])
        assert code is None
        results[name] = (full[-2 * PER_ITER:], resumed)
    reset_training_state()
    return results


def _resume_fsdp2_checkpoint_at_dp1(root):
    code, resumed = run_pretrain_in_process(BASE + ["--ckpt-format", "torch_dcp", "--load", os.path.join(root, "fsdp2"),
                                                    "--ckpt-step", "2"])
    assert code is None and len(resumed) == 2 * 2  # two iterations of 2 microbatches on the one rank
    reset_training_state()
    return resumed


def test_torch_dcp_save_resume_ddp_and_fsdp2(tmp_path):
    root = str(tmp_path)
    per_rank = run_on_ranks(_save_and_resume, 2, root, timeout=300)
    for rank, results in enumerate(per_rank):
        for name, (reference, resumed) in results.items():
            assert resumed == reference, f"rank {rank} {name}: resumed iterations 3-4 differ from the uninterrupted run"
    # The FSDP2 checkpoint (DTensors sharded over 2 ranks) loads into plain DDP on one rank: per iteration, the
    # loss over both microbatches equals the 2-rank run's to fp32 rounding (another reduction order).
    single = run_on_ranks(_resume_fsdp2_checkpoint_at_dp1, 1, root, timeout=300)[0]
    for iteration in range(2):
        two_ranks = [per_rank[r]["fsdp2"][0][iteration] for r in range(2)]
        expected = sum(x[0] for x in two_ranks) / sum(x[1] for x in two_ranks)
        got = sum(x[0] for x in single[2 * iteration:2 * iteration + 2]) / sum(
            x[1] for x in single[2 * iteration:2 * iteration + 2])
        assert got == pytest.approx(expected, rel=1e-6), f"iteration {3 + iteration} after resharding DP 2 -> 1"
    for name in ("ddp", "fsdp2"):
        save = os.path.join(root, name)
        assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read() == "4"
        assert sorted(n for n in os.listdir(save) if "iter" in n) == ["iter_0000002", "iter_0000004",
                                                                     "latest_checkpointed_iteration.txt"]
        iter2 = os.path.join(save, "iter_0000002")
        assert sorted(os.listdir(iter2)) == [".metadata", "__0_0.distcp", "__0_1.distcp", "__1_0.distcp",
                                             "__1_1.distcp"]
        keys = torch_dcp.stored_keys(iter2)
        assert {"iteration", "checkpoint_version", "args.num_layers", "model.embedding.word_embeddings.weight",
                "optimizer.state.0.exp_avg", "opt_param_scheduler.num_steps"} <= keys
        assert any(k.startswith("rng_state.0.") for k in keys)
        ckpt_args, iteration = read_torch_dcp_args(iter2)
        assert iteration == 2 and ckpt_args.num_layers == 2 and ckpt_args.use_torch_fsdp2 == (name == "fsdp2")


def test_torch_dcp_layout_problems_name_the_flags():
    args = argparse.Namespace(tensor_model_parallel_size=2, pipeline_model_parallel_size=1,
                              expert_model_parallel_size=1, use_distributed_optimizer=True)
    problems = torch_dcp_layout_problems(args, with_optimizer=True)
    assert len(problems) == 2
    assert problems[0].startswith("--tensor-model-parallel-size is 2") and "--use-distributed-optimizer" in problems[1]
    assert torch_dcp_layout_problems(args, with_optimizer=False) == problems[:1]
    args.ckpt_format, args.save, args.no_save_optim = "torch_dcp", "/ckpt", False
    with pytest.raises(ValueError, match="--ckpt-format torch_dcp cannot save this run: --tensor-model-parallel-size"):
        announce_checkpoint_format(args)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_torch_dcp_args_as_megatron_namespace(tmp_path):
    """Megatron-LM stores `args` as one pickled Namespace item (dtypes inside); it is read by the allow-list loader."""
    stored = argparse.Namespace(num_layers=3, params_dtype=torch.bfloat16, tensor_model_parallel_size=1)
    dcp.save({"args": stored, "iteration": 7, "model": {"w": torch.ones(2)}},
             storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    ckpt_args, iteration = read_torch_dcp_args(str(tmp_path))
    assert iteration == 7 and ckpt_args.num_layers == 3 and ckpt_args.params_dtype is torch.bfloat16


def test_damaged_torch_dcp_names_the_file(tmp_path):
    ckpt = str(tmp_path)
    torch_dcp.save_state_dict({"model": {"w": torch.arange(4.0)}, "iteration": 3}, ckpt)
    request = {"model": {"w": torch.zeros(4)}, "iteration": None}
    assert torch_dcp.load_state_dict(request, ckpt)["iteration"] == 3 and torch.equal(request["model"]["w"],
                                                                                     torch.arange(4.0))
    with pytest.raises(CheckpointingException, match=r"keys missing from the checkpoint: \['optimizer.step'\]"):
        torch_dcp.load_state_dict({"optimizer": {"step": None}}, ckpt)
    data_file = sorted(name for name in os.listdir(ckpt) if name.endswith(".distcp"))[0]
    with open(os.path.join(ckpt, data_file), "r+b") as f:
        f.truncate(3)
    with pytest.raises(CheckpointingException, match=f"{data_file} is truncated"):
        torch_dcp.load_state_dict({"iteration": None}, ckpt)
    os.remove(os.path.join(ckpt, ".metadata"))
    with pytest.raises(CheckpointingException, match=r"\.metadata is missing"):
        torch_dcp.load_state_dict({"iteration": None}, ckpt)
