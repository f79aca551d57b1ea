"""Megatron-LM 0.13.1's own distributed-optimizer state layouts in torch_dist checkpoints, read by `pretrain`
(2 gloo ranks, DP=2, fp32, distributed optimizer):

- `dp_zero_gather_scatter` (Megatron writes it with `--no-ckpt-fully-parallel-save`), written here by hand from its
  documented layout, at the same TP/PP/DP;
- `fully_sharded_model_space` (its default): model-space keys `optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<model
  key>` stored N-D flattened, as this framework's distributed optimizer writes them too (the real Megatron files in
  `shared/fixtures/megatron` are tested in `tests/compat`), here re-written without `mcore_data` in `.metadata`
  (Megatron's default save path records none), at the same layout and at DP=1.

Iterations 3 and 4 after loading iteration 2 must equal the uninterrupted run's (bit for bit at the same layout;
within 1e-6 at DP=1, where the reduction order differs): iteration 3's loss checks the weights, iteration 4's the Adam
state (with the optimizer state left unloaded iteration 4 differs). A TP/PP change of the dp_zero layout must fail
naming the layout and the fix.

The dp_zero checkpoint is assembled with raw `torch.distributed.checkpoint` (no flattening), as Megatron's torch_dist
backend writes it: tensors as DCP tensors; each ShardedObject one bytes item under `"{key}/shard_{offset}_{shape}"`
holding `torch.save([data])`, serialized before DCP sees it (its save planner does not re-serialize bytes):
- `optimizer.distributed.dp_group_idx_0.optimizer/shard_0_1`: the distributed optimizer's `state_dict()`
  without tensors (`{"param_groups": [...]}`, Adam's `step` in each group);
- `optimizer.distributed.dp_group_idx_0.param_state/shard_0_1`: the DP-rank-0 gather of fp32 params and Adam
  moments, the dict Megatron also writes to `distrib_optim.pt` (`buckets_coalesced`, then per buffer and
  (param dtype, grad dtype): `param`, `exp_avg`, `exp_avg_sq` in buffer order, `numel_unpadded`);
- `common.pt` with `optimizer = {"param_state_sharding_type": "dp_zero_gather_scatter"}` and `content_metadata =
  {"distrib_optim_sharding_type": "dp_zero_gather_scatter"}`; `metadata.json` last.
Model tensors, RNG and `_extra_state` objects are copied from a torch_dist checkpoint of the same state; the dp_zero
pieces come from the legacy-format checkpoint of the same run (Megatron's `distrib_optim.pt`).
"""
import argparse
import io
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.safe_load import safe_torch_load
from megatron.training.checkpointing_dist import check_optimizer_layout
from tests.functional.cli import reset_training_state, run_pretrain_in_process
from tests.harness import run_on_ranks

FLAGS = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 "
    "--micro-batch-size 1 --global-batch-size 2 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
    "--vocab-size 4095 --log-interval 10 --eval-iters 0 --transformer-impl local --seed 7 --swiglu --num-workers 0 "
    "--use-distributed-optimizer --attention-dropout 0 --hidden-dropout 0 --train-iters 4"
).split()
PER_ITER = 1  # microbatches per iteration on each of the 2 DP ranks
LAYOUT = "dp_zero_gather_scatter"


class _PreSerializedBytesPlanner(DefaultSavePlanner):
    """Megatron's save planner behaviour for bytes items: they are BytesIO already, written as they are."""

    def transform_object(self, write_item, object):
        return object


def _as_megatron_object(data):
    buffer = io.BytesIO()
    torch.save([data], buffer)
    return buffer


class _MegatronPlanner(_PreSerializedBytesPlanner):
    """Also records Megatron's per-tensor `mcore_data` in `.metadata` (None: none, as its default save path)."""

    def __init__(self, mcore_data):
        super().__init__(flatten_state_dict=False)
        self._mcore_data = mcore_data

    def create_global_plan(self, all_plans):
        plans, metadata = super().create_global_plan(all_plans)
        if self._mcore_data is not None:
            metadata.mcore_data = self._mcore_data
        return plans, metadata


def _copy_model_part(model_space_dir):
    """Model tensors (plain) and every ShardedObject (as Megatron's bytes) of a torch_dist checkpoint."""
    stored = dist_checkpointing.load_sharded_metadata(model_space_dir)
    tensors = dist_checkpointing.load_plain_tensors(model_space_dir)
    objects = {k: v for k, v in stored.items() if isinstance(v, ShardedObject)}
    items = {k: v for k, v in tensors.items() if not k.startswith("optimizer.")}
    items.update({k: _as_megatron_object(v) for k, v in dist_checkpointing.load(objects, model_space_dir).items()})
    return items, {k: v for k, v in tensors.items() if k.startswith("optimizer.")}


def _write(out_dir, items, common, mcore_data):
    """Rank 0 writes the directory: DCP items (with mcore_data), common.pt, metadata.json last."""
    if dist.get_rank() != 0:
        return
    os.makedirs(out_dir)
    dcp.save(items, storage_writer=dcp.FileSystemWriter(out_dir), planner=_MegatronPlanner(mcore_data), no_dist=True)
    torch.save(common, os.path.join(out_dir, "common.pt"))
    with open(os.path.join(out_dir, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                   "common_backend_version": 1}, f)


def _write_megatron_checkpoints(model_space_dir, legacy_dir, root):
    """<root>/dp_zero/iter_0000002 and <root>/nd_flat/iter_0000002 (every rank reads; rank 0 writes)."""
    model_items, optimizer_tensors = _copy_model_part(model_space_dir)
    common = safe_torch_load(os.path.join(model_space_dir, "common.pt"))
    plain_mcore_data = {k: {} for k, v in model_items.items() if torch.is_tensor(v)}

    legacy = safe_torch_load(os.path.join(legacy_dir, "mp_rank_00", "model_optim_rng.pt"))
    param_state = torch.load(os.path.join(legacy_dir, "mp_rank_00", "distrib_optim.pt"), weights_only=True)
    assert param_state["buckets_coalesced"] is True and "param_groups" in legacy["optimizer"]["optimizer"]
    prefix = "optimizer.distributed.dp_group_idx_0"
    items = dict(model_items)
    for name, value in legacy["optimizer"].items():  # "optimizer" (+ "grad_scaler" with fp16)
        items[f"{prefix}.{name}/shard_0_1"] = _as_megatron_object(value)
    items[f"{prefix}.param_state/shard_0_1"] = _as_megatron_object(param_state)
    dp_zero_common = dict(common, optimizer={"param_state_sharding_type": LAYOUT},
                          content_metadata={"distrib_optim_sharding_type": LAYOUT})
    _write(os.path.join(root, "dp_zero", "iter_0000002"), items, dp_zero_common, plain_mcore_data)

    items = dict(model_items, **optimizer_tensors)
    assert common["content_metadata"] == {"distrib_optim_sharding_type": "fully_sharded_model_space"}
    _write(os.path.join(root, "nd_flat", "iter_0000002"), items, common, None)


def _resume_from_megatron_layouts(root):
    legacy, converted = os.path.join(root, "legacy"), os.path.join(root, "converted")
    code, full = run_pretrain_in_process(FLAGS + ["--ckpt-format", "torch", "--save", legacy, "--save-interval", "2"])
    assert code is None and len(full) == 4 * PER_ITER
    code, _ = run_pretrain_in_process(FLAGS + ["--ckpt-format", "torch", "--load", legacy, "--ckpt-step", "2",
                                               "--ckpt-convert-format", "torch_dist", "--ckpt-convert-save",
                                               converted])
    assert code == 0
    _write_megatron_checkpoints(os.path.join(converted, "torch_dist", "iter_0000002"),
                                os.path.join(legacy, "iter_0000002"), root)
    dist.barrier()
    results = {"reference": full[-2 * PER_ITER:]}
    for layout in ("dp_zero", "nd_flat"):
        code, results[layout] = run_pretrain_in_process(FLAGS + ["--load", os.path.join(root, layout),
                                                                 "--ckpt-step", "2"])
        assert code is None
    reset_training_state()
    return results


def _resume_nd_flat_at_dp1(root):
    code, resumed = run_pretrain_in_process(FLAGS + ["--load", os.path.join(root, "nd_flat"), "--ckpt-step", "2"])
    assert code is None and len(resumed) == 2 * 2  # two iterations of 2 microbatches on the one rank
    reset_training_state()
    return resumed


def test_megatron_optimizer_layouts_load(tmp_path):
    root = str(tmp_path)
    per_rank = run_on_ranks(_resume_from_megatron_layouts, 2, root, timeout=120)
    for rank, results in enumerate(per_rank):
        for layout in ("dp_zero", "nd_flat"):
            assert results[layout] == results["reference"], f"rank {rank}: iterations 3-4 after loading {layout} differ"
    single = run_on_ranks(_resume_nd_flat_at_dp1, 1, root, timeout=120)[0]
    for iteration in range(2):
        two_ranks = [per_rank[r]["reference"][iteration] for r in range(2)]
        expected = sum(x[0] for x in two_ranks) / sum(x[1] for x in two_ranks)
        one_rank = single[2 * iteration:2 * iteration + 2]
        got = sum(x[0] for x in one_rank) / sum(x[1] for x in one_rank)
        assert got == pytest.approx(expected, rel=1e-6), f"iteration {3 + iteration} of nd_flat at DP=1"
    dp_zero = os.path.join(root, "dp_zero", "iter_0000002")
    stored = dist_checkpointing.load_sharded_metadata(dp_zero)
    assert "optimizer.distributed.dp_group_idx_0.param_state/shard_0_1" in stored
    assert not any(key.startswith("optimizer.state.") for key in stored)
    assert dist_checkpointing.load_content_metadata(dp_zero) == {"distrib_optim_sharding_type": LAYOUT}
    nd_flat = dist_checkpointing.load_tensors_metadata(os.path.join(root, "nd_flat", "iter_0000002"))
    # [layers, 2 * ffn, hidden] with chunks [1, ffn, hidden] -> [layers, 2, 1, ffn * hidden]; [hidden] -> [1, hidden]
    assert nd_flat["optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight"].global_shape == (2, 2, 1, 64 * 32)
    assert nd_flat["optimizer.state.exp_avg.decoder.final_layernorm.weight"].global_shape == (1, 32)
    assert not hasattr(dist_checkpointing.serialization.torch_strategy.read_dcp_metadata(
        os.path.join(root, "nd_flat", "iter_0000002")), "mcore_data")


def test_layouts_refuse_a_parallel_change_by_name():
    args = argparse.Namespace(use_distributed_optimizer=True)
    common = {"args": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1},
              "optimizer": {"param_state_sharding_type": LAYOUT}}
    assert check_optimizer_layout(args, common, "ckpt/iter_0000002", (2, 1)) == {
        "metadata": {"distrib_optim_sharding_type": LAYOUT}}
    with pytest.raises(RuntimeError, match=r"'dp_zero_gather_scatter' layout .* cannot be resharded from TP/PP "
                                           r"\(2, 1\) to \(1, 2\).*--ckpt-fully-parallel-save.*--no-load-optim"):
        check_optimizer_layout(args, common, "ckpt/iter_0000002", (1, 2))
    with pytest.raises(RuntimeError, match="only the distributed optimizer reads"):
        check_optimizer_layout(argparse.Namespace(use_distributed_optimizer=False), common, "ckpt", (2, 1))
    # Megatron's default layout (model-shaped or N-D flattened tensors) loads at any TP/PP, into any optimizer.
    common["content_metadata"] = {"distrib_optim_sharding_type": "fully_sharded_model_space"}
    for run_args in (args, argparse.Namespace(use_distributed_optimizer=False)):
        assert check_optimizer_layout(run_args, common, "ckpt", (1, 2)) == {
            "metadata": {"distrib_optim_sharding_type": "fully_sharded_model_space"}}


def test_sharded_objects_are_stored_as_megatron_lists(tmp_path):
    """Our writer stores a ShardedObject as Megatron does (`torch.save([data])`), and reads it back as `data`."""
    data = {0: {(torch.float32, torch.float32): torch.arange(3.0)}, "buckets_coalesced": True}
    dist_checkpointing.save({"o": ShardedObject("opt.param_state", data, (1,), (0,))}, str(tmp_path))
    metadata = dcp.FileSystemReader(str(tmp_path)).read_metadata()
    (index, info), = [(i, v) for i, v in metadata.storage_data.items() if i.fqn == "opt.param_state/shard_0_1"]
    with open(os.path.join(str(tmp_path), info.relative_path), "rb") as f:
        f.seek(info.offset)
        stored = torch.load(io.BytesIO(f.read(info.length)), weights_only=True)
    assert isinstance(stored, list) and len(stored) == 1 and torch.equal(stored[0][0][(torch.float32,) * 2],
                                                                         torch.arange(3.0))
    loaded = dist_checkpointing.load({"o": ShardedObject("opt.param_state", None, (1,), (0,))}, str(tmp_path))
    assert loaded["o"]["buckets_coalesced"] is True and torch.equal(loaded["o"][0][(torch.float32,) * 2],
                                                                    torch.arange(3.0))

