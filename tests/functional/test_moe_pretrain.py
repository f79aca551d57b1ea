"""Megatron-LM's MoE functional-test command lines through `torchrun pretrain_gpt.py` on CPU (gloo), small sizes.

1. `moe/gpt3_345m_..._mcore_tp2_pp2_ep2_resume_torch_dist_te_4experts2parallel` (local spec, sinkhorn top-1, bf16,
   TP=2 + SP, PP=2, EP=2, torch_dist): 4 iterations saving at 2, then a resume from iteration 2 must log
   iterations 3-4 exactly as the uninterrupted run (losses, grad norm, params norm). 8 ranks would be needed for
   expert TP = TP = 2 with PP=2 and EP=2; the 4 ranks here use `--expert-tensor-parallel-size 1`.
2. Mixtral-style: 8 experts, top-2, aux + z loss, TP=2 + SP, EP=2, grouped GEMM, distributed optimizer, alltoall
   dispatcher, SwiGLU/RMSNorm/RoPE, a shared expert, the default `--transformer-impl` (native modules in TE's
   layout): runs and learns.
"""
import pytest

from tests.functional.cli import run_pretrain

COMMON = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
    "--micro-batch-size 2 --global-batch-size 8 --mock-data --tokenizer-type NullTokenizer --vocab-size 4095 "
    "--log-interval 1 --eval-iters 0 --hidden-dropout 0 --attention-dropout 0 --seed 1234"
).split()

RESUME_CASE = COMMON + (
    "--lr 0.00015 --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 1e-2 --clip-grad 1.0 "
    "--lr-warmup-fraction .01 --lr-decay-iters 320000 --log-params-norm --log-num-zeros-in-grad --timing-log-level 2 "
    "--transformer-impl local --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
    "--expert-model-parallel-size 2 --expert-tensor-parallel-size 1 --sequence-parallel --num-experts 4 "
    "--moe-router-load-balancing-type sinkhorn --moe-router-topk 1 --deterministic-mode "
    "--no-gradient-accumulation-fusion --use-checkpoint-opt_param-scheduler --use-mcore-models --ckpt-format torch_dist "
    "--dist-ckpt-strictness log_all --bf16 --disable-bias-linear --no-bias-gelu-fusion --train-iters 4"
).split()

MIXTRAL_CASE = COMMON + (
    "--lr 1e-3 --train-iters 4 --num-experts 8 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3 "
    "--moe-grouped-gemm --moe-token-dispatcher-type alltoall --tensor-model-parallel-size 2 --sequence-parallel "
    "--expert-model-parallel-size 2 --use-distributed-optimizer --overlap-grad-reduce --disable-bias-linear --swiglu "
    "--normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights "
    "--moe-shared-expert-intermediate-size 64 --moe-ffn-hidden-size 64 --moe-router-dtype fp32"
).split()


def _iterations(result, expected):
    assert result.returncode == 0, result.output[-4000:]
    assert not result.unmatched_log_lines, result.unmatched_log_lines
    assert [int(x["iteration"]) for x in result.iterations] == expected, result.output[-3000:]
    return {int(x["iteration"]): x for x in result.iterations}


def test_moe_resume_from_torch_dist_is_exact(tmp_path):
    save = ["--save", str(tmp_path), "--save-interval", "2"]
    full = _iterations(run_pretrain(RESUME_CASE + save, nproc=4), [1, 2, 3, 4])
    resumed = _iterations(run_pretrain(RESUME_CASE + ["--load", str(tmp_path), "--ckpt-step", "2"], nproc=4), [3, 4])
    for iteration in (3, 4):
        for field in ("loss_values", "grad_norm", "params_norm", "lr"):
            assert resumed[iteration][field] == full[iteration][field], (iteration, field)
    losses = [full[i]["loss_values"]["lm loss"] for i in (1, 2, 3, 4)]
    assert all(loss == loss and 7.0 < loss < 9.0 for loss in losses), losses


def test_mixtral_style_tp2_ep2_grouped_gemm_distributed_optimizer_learns():
    runs = _iterations(run_pretrain(MIXTRAL_CASE, nproc=4), [1, 2, 3, 4])
    losses = [runs[i]["loss_values"]["lm loss"] for i in (1, 2, 3, 4)]
    assert losses[-1] < losses[0] - 0.01, losses
    assert all(float(runs[i]["grad_norm"]) > 0 for i in runs)
