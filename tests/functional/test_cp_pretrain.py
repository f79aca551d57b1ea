"""`pretrain_gpt.py` with `--context-parallel-size 2` on CPU (gloo), as Megatron's functional tests run it.

Context parallelism changes neither the weights' initialisation (CP ranks share the model-parallel seed)
nor the data (CP ranks of a data-parallel rank read the same samples), so a CP run must follow the run
without CP to round-off: every logged loss within 2e-4 (the log prints 6 digits; the loss is ~9.0).

- CP=2 (ring attention) against one process;
- CP=2 with an MoE model (4 experts, top-2, aux and z losses) and EP=2 over the two CP ranks against the same
  model with EP=2 over two data-parallel ranks;
- CP=2 with a2a, documents (--reset-attention-mask --reset-position-ids --eod-mask-loss) and
  --calculate-per-token-loss against one process with the same flags;
- Megatron's `gpt3_mr_mcore_te_tp2_pp2_cp2` flag set (TP=2, PP=2, CP=2, sequence parallel, torch_dist
  checkpoints; sizes shrunk) at world 8 against the same flags without CP at world 4;
- checkpoints do not depend on CP: saved at CP=2, resumed at CP=1, the resumed iterations match the CP=2
  run's own.
"""
import re

import pytest

from tests.functional.cli import run_pretrain

FLAGS = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
    "--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
    "--vocab-size 8191 --log-interval 1 --eval-iters 0 --train-iters 4 --hidden-dropout 0 --attention-dropout 0"
).split()
# MoE under CP: the router's balancing losses combine over the tensor x context group, and the experts are split
# over the two CP ranks (EP=2 drawn from the data x context ranks, as Megatron's RankGenerator does).
MOE_COEFFS = "--moe-aux-loss-coeff 1e-1 --moe-z-loss-coeff 1e-2".split()
MOE = ("--num-experts 4 --moe-router-topk 2 "
       "--moe-token-dispatcher-type alltoall --moe-grouped-gemm --disable-bias-linear").split()
DOCUMENTS = "--reset-attention-mask --reset-position-ids --eod-mask-loss --calculate-per-token-loss".split()
# tests/functional_tests/test_cases/gpt/gpt3_mr_mcore_te_tp2_pp2_cp2_dgx_a100_1N8G/model_config.yaml, with
# the sizes, data, logging and precision flags of a CPU run (bf16 and TensorBoard flags dropped).
MEGATRON_CP2 = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 8 --log-params-norm --log-num-zeros-in-grad "
    "--micro-batch-size 2 --global-batch-size 8 --seq-length 64 --max-position-embeddings 64 --train-iters 3 "
    "--timing-log-level 2 --lr-decay-iters 320000 --split 949,50,1 --distributed-backend gloo --lr 0.00015 "
    "--lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 1e-2 --clip-grad 1.0 --lr-warmup-fraction .01 "
    "--log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 0 --transformer-impl transformer_engine "
    "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel "
    "--hidden-dropout 0.0 --attention-dropout 0.0 --no-gradient-accumulation-fusion --attention-softmax-in-fp32 "
    "--use-mcore-models --ckpt-format torch_dist --dist-ckpt-strictness log_all --attention-backend flash "
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 8191"
).split()
TOL = 2e-4


def _losses(result, iterations):
    assert result.returncode == 0, result.output[-4000:]
    assert not result.unmatched_log_lines, result.unmatched_log_lines
    assert [int(x["iteration"]) for x in result.iterations] == list(iterations)
    return [x["loss_values"]["lm loss"] for x in result.iterations]


def _uses_cp2(result):
    """The run's printed arguments: CP=2 took the ranks (so data parallelism did not)."""
    assert re.search(r"^  context_parallel_size \.+ 2$", result.output, re.M), result.output[-3000:]
    assert re.search(r"^  data_parallel_size \.+ 1$", result.output, re.M), result.output[-3000:]


def _close(got, want, label, tol=TOL):
    for step, (a, b) in enumerate(zip(got, want), start=1):
        assert abs(a - b) < tol, f"{label} iteration {step}: {a} vs {b} ({got} vs {want})"


@pytest.mark.parametrize("common, parallel", [
    ([], []),
    (DOCUMENTS, ["--cp-comm-type", "a2a"]),
], ids=["p2p", "a2a-documents"])
def test_cp2_follows_one_process(common, parallel):
    want = _losses(run_pretrain(FLAGS + common), range(1, 5))
    result = run_pretrain(FLAGS + common + parallel + ["--context-parallel-size", "2"], nproc=2)
    _uses_cp2(result)
    _close(_losses(result, range(1, 5)), want, "CP=2")


def test_moe_ep2_over_cp2_follows_ep2_over_dp2():
    """Experts are initialised per expert-parallel rank, so the reference is the same EP=2 model with the two
    ranks as data parallelism (the same samples meet in each router call: CP splits each micro-batch's
    sequence, DP=2 gives each rank one of the two micro-batches).

    Megatron scales the language-model loss by the CP size before gradients are averaged over data x context
    ranks, but not the auxiliary losses (each CP rank's balancing-loss part is attached with 1/num_microbatches,
    the z-loss coefficient is divided by |TP x CP|): under CP=2 both enter the gradient with half the weight
    they have under DP=2. So the reference runs with half the coefficients."""
    flags = FLAGS + MOE + ["--expert-model-parallel-size", "2"]
    result = run_pretrain(flags + MOE_COEFFS + ["--context-parallel-size", "2"], nproc=2)
    want = _losses(run_pretrain(flags + ["--moe-aux-loss-coeff", "5e-2", "--moe-z-loss-coeff", "5e-3"], nproc=2),
                   range(1, 5))
    _uses_cp2(result)
    # seen: equal to the printed 6 digits (1e-6); with the full coefficients the reference differs by up to 4e-4
    _close(_losses(result, range(1, 5)), want, "CP=2 x EP=2", tol=2e-5)


def test_megatron_tp2_pp2_cp2_command_line():
    want = _losses(run_pretrain(MEGATRON_CP2, nproc=4), range(1, 4))
    result = run_pretrain(MEGATRON_CP2 + ["--context-parallel-size", "2"], nproc=8)
    _uses_cp2(result)
    _close(_losses(result, range(1, 4)), want, "TP=2 PP=2 CP=2")


def test_checkpoint_saved_at_cp2_resumes_at_cp1(tmp_path):
    save = str(tmp_path / "ckpt")
    flags = FLAGS + ["--ckpt-format", "torch_dist", "--use-distributed-optimizer"]
    result = run_pretrain(flags + ["--context-parallel-size", "2", "--save", save, "--save-interval", "2"], nproc=2)
    _uses_cp2(result)
    full = _losses(result, range(1, 5))
    resumed = _losses(run_pretrain(flags + ["--load", save, "--ckpt-step", "2"]), range(3, 5))
    _close(resumed, full[2:], "resumed at CP=1")
