"""`torchrun --nproc-per-node 4 pretrain_gpt.py` with TP=2 + sequence parallelism and with PP=2 + virtual
pipeline stages, on CPU (gloo), against the single-process loss curve.

The parallel runs initialize their weights from different RNG streams than the single process (Megatron
seeds each pipeline stage with seed + 100*pp_rank and splits TP weights per rank), so the curves agree
closely but not bit for bit: every logged loss must lie within 0.01 of the reference (the loss moves by
~0.05 over these iterations) and fall like it. Dropout is off so that no RNG stream enters the step.
"""
import pytest

from tests.functional.cli import run_pretrain

FLAGS = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
    "--micro-batch-size 2 --global-batch-size 16 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
    "--vocab-size 8191 --log-interval 1 --eval-iters 0 --train-iters 3 --hidden-dropout 0 --attention-dropout 0"
).split()


def _losses(result):
    assert result.returncode == 0, result.output[-4000:]
    assert not result.unmatched_log_lines, result.unmatched_log_lines
    assert [int(x["iteration"]) for x in result.iterations] == [1, 2, 3]
    assert all(int(x["gbs"]) == 16 and int(x["consumed"]) == 16 * int(x["iteration"]) for x in result.iterations)
    return [x["loss_values"]["lm loss"] for x in result.iterations]


@pytest.fixture(scope="module")
def reference_losses():
    return _losses(run_pretrain(FLAGS))


@pytest.mark.parametrize(
    "parallel_flags",
    [
        ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
        ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--tp-comm-overlap"],
        ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
    ],
    ids=["tp2-sp-dp2", "tp2-sp-overlap-dp2", "pp2-vpp2-dp2"],
)
def test_parallel_loss_curve_matches_single_process(reference_losses, parallel_flags):
    losses = _losses(run_pretrain(FLAGS + parallel_flags, nproc=4))
    for step, (got, want) in enumerate(zip(losses, reference_losses), start=1):
        assert abs(got - want) < 0.01, f"iteration {step}: {got} vs reference {want} ({losses} vs {reference_losses})"
    assert losses[-1] < losses[0] - 0.02
