"""torch_dist checkpoints reshard: save at TP=2, PP=2, DP=2 with the distributed optimizer (8 gloo ranks),
resume at TP=1/PP=4/DP=2 (distributed optimizer) and at TP=1/PP=1/DP=1 (non-distributed optimizer); the
next iteration's loss must match the uninterrupted run.

Tolerance: 1e-6 relative (fp32). The layouts reduce in different orders (TP all-reduces, DP grad
reduce-scatter vs. a single process), so the losses are not bit-identical, only equal to fp32 rounding.
The model is a tiny GPT with SwiGLU (the `[all gate; all up]` factory) and tied embeddings (the
last-stage output copy saved as a replica of the embedding), dropout off. `--vocab-size 4095` makes the
NullTokenizer vocab 4096, which TP=1 and TP=2 pad to the same size (padded logits enter the softmax, so a
different padding would change the loss although every weight loads exactly).
"""
import os

import pytest
import torch

from megatron.core import dist_checkpointing
from megatron.core import parallel_state as mpu
from megatron.training.global_vars import get_args
from tests.functional.cli import reset_training_state, run_pretrain_in_process
from tests.harness import run_on_ranks

FLAGS = (
    "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 1 --global-batch-size 8 --lr 1e-2 --min-lr 1e-3 --lr-decay-style cosine --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 4095 --log-interval 100 --eval-iters 0 --transformer-impl local "
    "--seed 11 --swiglu --attention-dropout 0 --hidden-dropout 0 --train-iters 3"
).split()
REL_TOL = 1e-6


def _last_iteration_loss(losses):
    """(loss sum, tokens) of this rank's microbatches of the last iteration, when it reports the loss."""
    if not (mpu.is_pipeline_last_stage() and mpu.get_tensor_model_parallel_rank() == 0):
        return None
    per_iteration = 8 // (mpu.get_data_parallel_world_size())
    last = losses[-per_iteration:]
    return sum(x[0] for x in last), sum(x[1] for x in last)


def _eight_ranks(save):
    results = {}
    code, losses = run_pretrain_in_process(
        FLAGS + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                 "--use-distributed-optimizer", "--save", save, "--save-interval", "2"])
    assert code is None
    results["reference"] = _last_iteration_loss(losses)
    results["saved_layout"] = (mpu.get_tensor_model_parallel_world_size(), mpu.get_pipeline_model_parallel_world_size())
    code, losses = run_pretrain_in_process(
        FLAGS + ["--pipeline-model-parallel-size", "4", "--use-distributed-optimizer", "--load", save,
                 "--ckpt-step", "2"])
    assert code is None and get_args().iteration == 2 and get_args().consumed_train_samples == 24
    assert len(losses) == (4 if mpu.is_pipeline_last_stage() else 0)
    results["pp4_dp2"] = _last_iteration_loss(losses)
    reset_training_state()
    return results


def _one_rank(save):
    code, losses = run_pretrain_in_process(FLAGS + ["--load", save, "--ckpt-step", "2"])
    assert code is None and len(losses) == 8 and get_args().consumed_train_samples == 24
    out = _last_iteration_loss(losses)
    reset_training_state()
    return out


def _total(per_rank):
    values = [v for v in per_rank if v is not None]
    return sum(v[0] for v in values) / sum(v[1] for v in values)


def test_save_tp2_pp2_dp2_distopt_resume_at_other_layouts(tmp_path):
    save = str(tmp_path / "ckpt")
    eight = run_on_ranks(_eight_ranks, 8, save, timeout=420)
    assert all(r["saved_layout"] == (2, 2) for r in eight)
    reference = _total([r["reference"] for r in eight])
    resumed_pp4 = _total([r["pp4_dp2"] for r in eight])
    assert os.path.isfile(os.path.join(save, "iter_0000002", "metadata.json"))
    assert sorted(os.listdir(save)) == ["iter_0000002", "iter_0000003", "latest_checkpointed_iteration.txt"]
    assert resumed_pp4 == pytest.approx(reference, rel=REL_TOL)
    single = run_on_ranks(_one_rank, 1, save, timeout=300)
    assert _total(single) == pytest.approx(reference, rel=REL_TOL)
    # The 8-rank checkpoint holds the optimizer state N-D flattened, as Megatron's distributed optimizer writes it:
    # [layers, 2 * ffn, hidden] in TP=2 chunks [1, ffn / 2, hidden] for gate and up -> [layers, 4, 1, ffn / 2 * hidden];
    # the vocab-parallel embedding [V, hidden] in chunks [V / 2, hidden] -> [2, 1, V / 2 * hidden].
    meta = dist_checkpointing.load_tensors_metadata(os.path.join(save, "iter_0000002"))
    assert meta["optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight"].global_shape == (4, 4, 1, 32 * 32)
    assert meta["optimizer.state.fp32_param.embedding.word_embeddings.weight"].global_shape == (2, 1, 2048 * 32)
    assert torch.float32 == meta["optimizer.state.exp_avg_sq.decoder.final_layernorm.weight"].dtype
