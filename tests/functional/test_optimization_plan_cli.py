"""The optimisation plan through `pretrain_gpt.py`: the same command line run twice with different plan flags
prints two different plans (one table, decision | value | why) and stores each with the checkpoint args
(`args.optimization_plan`, plain data in common.pt's args); a third run resumes the second one's checkpoint with
`--use-checkpoint-args` and resolves its own plan. A plan that cannot be carried out ends the run as a bad
command line does (exit 2, the problems listed). In-process, one gloo rank, CPU.
"""
import os

import torch

from megatron.core.optimization_plan.resolve import OptimizationPlan
from tests.functional.cli import reset_training_state, run_pretrain_in_process

FLAGS = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--micro-batch-size 2 --global-batch-size 2 --train-iters 2 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
    "--vocab-size 4095 --log-interval 1 --eval-iters 0 --transformer-impl local --hidden-dropout 0 "
    "--attention-dropout 0 --num-workers 0 --save-interval 2"
).split()
PLAN_FLAGS = ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--compile-layers", "off", "--fusion-kernels",
              "eager", "--enable-cuda-graph", "--no-bias-gelu-fusion"]


def _run(flags, capsys):
    reset_training_state()
    code, losses = run_pretrain_in_process(flags)
    output = capsys.readouterr().out
    assert code is None and len(losses) == 2, output[-3000:]
    return output


def _table(output):
    """{decision: [value, why]} of the one plan table printed."""
    lines = output.splitlines()
    assert sum(line == "optimisation plan (megatron.core.optimization_plan):" for line in lines) == 1, output
    start = lines.index("optimisation plan (megatron.core.optimization_plan):") + 3
    rows = lines[start:start + len(OptimizationPlan.__dataclass_fields__)]
    return {row.split("|")[0].strip(): [cell.strip() for cell in row.split("|")[1:]] for row in rows}


def _saved_plan(save_dir):
    """`args.optimization_plan` of the checkpoint, read as a resume reads it (the restricted unpickler)."""
    from megatron.core.dist_checkpointing.safe_load import safe_torch_load
    from megatron.training.checkpointing_dist import checkpoint_args_namespace

    common = safe_torch_load(os.path.join(save_dir, "iter_0000002", "common.pt"))
    return checkpoint_args_namespace(common["args"]).optimization_plan


def test_two_plans_for_one_command_line_printed_and_saved(tmp_path, capsys):
    plain_dir, planned_dir = str(tmp_path / "plain"), str(tmp_path / "planned")
    plain = _table(_run(FLAGS + ["--save", plain_dir], capsys))
    planned = _table(_run(FLAGS + ["--save", planned_dir] + PLAN_FLAGS, capsys))
    assert plain["fp8"] == ["off", "no --fp8-format"]
    assert planned["fp8"][0] == "hybrid, tensorwise, margin 0" and planned["fp8"][1].startswith("--fp8-format hybrid")
    # (written for CPU, where CI runs; on a GPU machine auto picks CUDA reasons and the graphs are captured)
    assert plain["compile_layers"][0] == "off" and plain["compile_layers"][1].startswith("auto: ")
    assert planned["compile_layers"] == ["off", "--compile-layers off"]
    assert plain["fusion_kernels"][1].startswith("auto: ")
    assert planned["fusion_kernels"] == ["eager", "--fusion-kernels eager: the plain PyTorch reference"]
    assert plain["cuda_graphs"] == ["off", "no --enable-cuda-graph"]
    assert planned["cuda_graphs"][1].startswith("--enable-cuda-graph")
    if not torch.cuda.is_available():
        assert plain["compile_layers"][1] == "auto: parameters on cpu, not a CUDA device"
        assert plain["fusion_kernels"] == ["eager", "auto: no CUDA device: the fused functions compile only for "
                                                    "CUDA tensors"]
        assert planned["cuda_graphs"] == ["off", "--enable-cuda-graph, but the layers are on cpu: no graphs"]
    assert plain["bias_activation_fusion"][0] == "on" and planned["bias_activation_fusion"][0] == "off"
    assert plain["gradient_accumulation_fusion"] == planned["gradient_accumulation_fusion"]
    for table, save_dir in ((plain, plain_dir), (planned, planned_dir)):
        saved = _saved_plan(save_dir)
        assert list(saved) == list(table)
        assert {name: row["why"] for name, row in saved.items()} == {name: row[1] for name, row in table.items()}
    assert _saved_plan(plain_dir)["fp8"]["value"] is None
    assert _saved_plan(planned_dir)["fp8"]["value"]["recipe"] == "tensorwise"

    resumed = _table(_run(FLAGS + ["--load", planned_dir, "--use-checkpoint-args", "--train-iters", "4",
                                   "--override-opt_param-scheduler"], capsys))
    assert resumed == plain  # the checkpoint's plan is a record, not an input: this run resolved its own
    reset_training_state()


def test_a_plan_that_cannot_be_carried_out_ends_the_run_like_a_bad_command_line(capsys):
    reset_training_state()
    code, losses = run_pretrain_in_process(FLAGS + ["--compile-layers", "on", "--recompute-activations"])
    err = capsys.readouterr().err
    assert code == 2 and not losses, err[-3000:]
    assert "invalid command line (1 problem):" in err and "--compile-layers on with selective activation" in err
    reset_training_state()
