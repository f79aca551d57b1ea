"""`--enable-cuda-graph` (per-layer CUDA graphs) through `pretrain_gpt.py` on GPUs: the graphed run must
reproduce the eager run's losses, grad norms and parameter norms (same kernels, replayed; 2e-3 relative
allows for the run-to-run noise of atomics in bf16), on one GPU with
two micro-batches per step and an evaluation in between, with TP=2 + sequence parallelism (also with
--tp-comm-overlap, whose copy-engine transfers and barriers are captured), and with DP=2 and overlapped
gradient reduction, and with FP8 GEMMs (delayed scaling's amax history updated inside the graphs; TP=2 with
the amax all-reduces captured), and with dropless MoE layers (their auxiliary losses in the log line too).
Skipped without CUDA (CI); the 2-GPU cases need two GPUs.
"""
import pytest
import torch

from tests.functional.cli import run_pretrain

FLAGS = (
    "--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 256 --max-position-embeddings 256 "
    "--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
    "--vocab-size 8192 --log-interval 1 --train-iters 8 --eval-interval 4 --eval-iters 1 --bf16 "
    "--hidden-dropout 0 --attention-dropout 0 --log-params-norm --cuda-graph-warmup-steps 2"
).split()


# dropless alltoall MoE without EP (graphable): grouped GEMM, fp32 router, aux and z losses
MOE = ("--num-experts 4 --moe-router-topk 2 --moe-grouped-gemm --moe-token-dispatcher-type alltoall "
       "--moe-router-dtype fp32 --moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3 --disable-bias-linear "
       "--swiglu").split()


def _curve(result):
    assert result.returncode == 0, result.output[-6000:]
    assert [int(x["iteration"]) for x in result.iterations] == list(range(1, 9))
    return [(x["loss_values"]["lm loss"], float(x["grad_norm"]), float(x["params_norm"]))
            + tuple(value for name, value in sorted(x["loss_values"].items()) if name != "lm loss")
            for x in result.iterations]


@pytest.mark.gpu
@pytest.mark.parametrize("nproc,extra", [
    (1, []),
    (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--global-batch-size", "2"]),
    (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--tp-comm-overlap", "--global-batch-size", "2"]),
    (2, ["--overlap-grad-reduce", "--global-batch-size", "8"]),
    (1, ["--fp8-format", "hybrid"]),
    (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--global-batch-size", "2", "--fp8-format",
         "hybrid", "--fp8-recipe", "tensorwise"]),
    (1, MOE),
    (2, MOE + ["--overlap-grad-reduce", "--global-batch-size", "8"]),
], ids=["1gpu-2microbatches", "tp2-sp", "tp2-sp-overlap", "dp2-overlap", "1gpu-fp8-delayed", "tp2-sp-fp8", "1gpu-moe",
        "dp2-moe"])
def test_graphed_run_reproduces_eager_run(nproc, extra):
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} GPUs")
    launcher = None if nproc == 1 else nproc
    eager = _curve(run_pretrain(FLAGS + extra, nproc=launcher))
    graphed_result = run_pretrain(FLAGS + extra + ["--enable-cuda-graph"], nproc=launcher)
    graphed = _curve(graphed_result)
    assert "capturing per-layer CUDA graphs" in graphed_result.output
    print(f"{nproc} {extra}: eager {eager[-1]} graphed {graphed[-1]}")
    for step, (want, got) in enumerate(zip(eager, graphed), start=1):
        assert len(want) == len(got)
        for index, (a, b) in enumerate(zip(want, got)):
            name = ("loss", "grad norm", "params norm")[index] if index < 3 else f"logged loss {index - 2}"
            assert abs(a - b) <= 2e-3 * max(1.0, abs(a)), f"iteration {step} {name}: eager {a} graphed {b}"
