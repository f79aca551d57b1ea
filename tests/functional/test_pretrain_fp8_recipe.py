"""Megatron's FP8 recipe flags on `pretrain_gpt.py` command lines, as its FP8 functional tests write them, run on
CPU at small sizes (the emulated FP8 GEMMs): FP8 parameters gathered by the distributed optimizer (DP=2) with
both overlaps and the first/last layers kept in bf16; FP8 with TP=2 + SP + `--tp-comm-overlap`. One torchrun
launch each (2 ranks); every run must train (finite losses that fall)."""
import math

from tests.functional.cli import run_pretrain

BASE = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
    "--micro-batch-size 2 --global-batch-size 8 --train-iters 8 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
    "--vocab-size 4096 --log-interval 4 --eval-iters 0 --bf16"
).split()
# the FP8 flags of Megatron's functional tests and FP8 recipes (FP8 parameters with both overlaps and the bf16
# edge layers, as its MXFP8 recipe combines them; FP8 with the TP communication overlap)
FP8_PARAMS_BF16_EDGES = ("--fp8-format e4m3 --fp8-recipe tensorwise --fp8-param-gather --use-distributed-optimizer "
                         "--overlap-grad-reduce --overlap-param-gather --first-last-layers-bf16 "
                         "--num-layers-at-start-in-bf16 1 --num-layers-at-end-in-bf16 1").split()
FP8_TP_OVERLAP = ("--fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max "
                  "--tensor-model-parallel-size 2 --sequence-parallel --tp-comm-overlap").split()


def _losses(result):
    assert result.returncode == 0, result.output[-4000:]
    losses = [x["loss_values"]["lm loss"] for x in result.iterations]
    assert [int(x["iteration"]) for x in result.iterations] == [4, 8], result.output[-3000:]
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0], losses
    return losses


def test_megatron_fp8_recipe_command_lines_train_on_cpu():
    runs = {}
    for name, flags in (("fp8-params-bf16-edges", FP8_PARAMS_BF16_EDGES), ("tp-overlap", FP8_TP_OVERLAP)):
        result = run_pretrain(BASE + flags, nproc=2)
        runs[name] = (_losses(result), result.output)
    assert "first 1 / last 1 layers in bf16" in runs["fp8-params-bf16-edges"][1]
    print({name: losses for name, (losses, _) in runs.items()})
