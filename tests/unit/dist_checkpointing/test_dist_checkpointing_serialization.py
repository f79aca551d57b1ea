"""Single-process save/load of distributed checkpoints: round trips, resharded requests, factories,
the readers of a saved directory, strict handling, damaged directories and async saves."""
import json
import os

import pytest
import torch

from megatron.core import dist_checkpointing as dc
from megatron.core.dist_checkpointing import (
    CheckpointingException,
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    StrictHandling,
)
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(8, 6, generator=g)
    layers = torch.randn(3, 4, 5, generator=g)
    state = {
        "model": {
            "w": ShardedTensor.from_rank_offsets("w", full.clone()),
            "bf": ShardedTensor.from_rank_offsets("bf", full[:2].to(torch.bfloat16).clone()),
        },
        "iteration": 11,
        "rng": ShardedObject("rng_state", {"seed": seed, "arr": [1, 2]}, (1, 1), (0, 0)),
        "local": LocalNonpersistentObject("do-not-save"),
    }
    for i in range(3):
        state["model"][f"layer{i}"] = ShardedTensor.from_rank_offsets(
            "decoder.layers.w", layers[i].clone(), (0, i, 3), prepend_axis_num=1
        )
    return state, full, layers


def test_round_trip_layout_and_common(tmp_path):
    state, full, layers = _state()
    dc.save(state, str(tmp_path), content_metadata={"distrib_optim_sharding_type": "fully_sharded_model_space"})
    names = sorted(os.listdir(tmp_path))
    assert names == [".metadata", "__0_0.distcp", "__0_1.distcp", "common.pt", "metadata.json"]
    with open(tmp_path / "metadata.json") as f:
        assert json.load(f) == {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                "common_backend": "torch", "common_backend_version": 1}
    assert dc.check_is_distributed_checkpoint(str(tmp_path))
    common = dc.load_common_state_dict(str(tmp_path))
    assert common == {"iteration": 11, "content_metadata": {"distrib_optim_sharding_type": "fully_sharded_model_space"}}
    assert dc.load_content_metadata(str(tmp_path)) == {"distrib_optim_sharding_type": "fully_sharded_model_space"}
    meta = dc.load_tensors_metadata(str(tmp_path))
    assert set(meta) == {"w", "bf", "decoder.layers.w"}
    assert meta["decoder.layers.w"].global_shape == (3, 4, 5) and meta["bf"].dtype == torch.bfloat16
    plain = dc.load_plain_tensors(str(tmp_path))
    assert torch.equal(plain["w"], full) and torch.equal(plain["decoder.layers.w"], layers)
    assert torch.equal(plain["bf"], full[:2].to(torch.bfloat16))

    request, _, _ = _state(seed=1)
    request["local"] = LocalNonpersistentObject("kept-from-request")
    loaded = dc.load(request, str(tmp_path))
    assert torch.equal(loaded["model"]["w"], full)
    for i in range(3):
        assert torch.equal(loaded["model"][f"layer{i}"], layers[i])
    assert loaded["rng"] == {"seed": 0, "arr": [1, 2]}
    assert loaded["iteration"] == 11 and loaded["local"] == "kept-from-request"

    metadata = dc.load_sharded_metadata(str(tmp_path))
    assert set(metadata) == {"w", "bf", "decoder.layers.w", "rng_state/shard_0.0_1.1"}
    dc.remove_sharded_tensors(str(tmp_path), key_prefix="bf")
    assert set(dc.load_tensors_metadata(str(tmp_path))) == {"w", "decoder.layers.w"}
    assert torch.equal(dc.load_plain_tensors(str(tmp_path))["w"], full)


def test_load_at_other_layouts(tmp_path):
    state, full, layers = _state()
    dc.save(state, str(tmp_path))
    for axis, parts in ((0, 4), (1, 2), (1, 3)):
        pieces = []
        for r in range(parts):
            shape = list(full.shape)
            shape[axis] //= parts
            req = {"x": ShardedTensor.from_rank_offsets("w", torch.zeros(shape), (axis, r, parts))}
            pieces.append(dc.load(req, str(tmp_path))["x"])
        assert torch.equal(torch.cat(pieces, dim=axis), full)
    # one stacked layer, sliced along its own axis 1 (axis 2 of the global tensor)
    req = {"x": ShardedTensor.from_rank_offsets("decoder.layers.w", torch.zeros(4, 1), (0, 2, 3), (2, 3, 5),
                                                prepend_axis_num=1)}
    assert torch.equal(dc.load(req, str(tmp_path))["x"], layers[2][:, 3:4])


def test_factory_shape_mismatch_and_strict(tmp_path):
    gate, up = torch.randn(4, 3), torch.randn(4, 3)

    def build(key, data, replica_id, flattened_range):
        half = data.shape[0] // 2
        return {"gate": ShardedTensor.from_rank_offsets(f"{key}.gate", data[:half]),
                "up": ShardedTensor.from_rank_offsets(f"{key}.up", data[half:])}

    def merge(sub):
        return torch.cat([sub["gate"], sub["up"]])

    vocab = torch.randn(10, 4)
    state = {"fc1": ShardedTensorFactory("fc1", torch.cat([gate, up]), build, merge),
             "emb": ShardedTensor.from_rank_offsets("emb", vocab, allow_shape_mismatch=True)}
    dc.save(state, str(tmp_path))
    assert set(dc.load_tensors_metadata(str(tmp_path))) == {"fc1.gate", "fc1.up", "emb"}
    request = {"fc1": ShardedTensorFactory("fc1", torch.zeros(8, 3), build, merge),
               "emb": ShardedTensor.from_rank_offsets("emb", torch.full((12, 4), -1.0), allow_shape_mismatch=True)}
    loaded = dc.load(request, str(tmp_path))
    assert torch.equal(loaded["fc1"], torch.cat([gate, up]))
    assert torch.equal(loaded["emb"][:10], vocab) and bool((loaded["emb"][10:] == -1).all())

    with pytest.raises(CheckpointingException, match=r"'emb'.*\(10, 4\).*\(12, 4\)"):
        dc.load({"e": ShardedTensor.from_rank_offsets("emb", torch.zeros(12, 4))}, str(tmp_path))
    with pytest.raises(CheckpointingException, match="missing from the checkpoint.*nope"):
        dc.load({"n": ShardedTensor.from_rank_offsets("nope", torch.zeros(2))}, str(tmp_path))
    req = {"n": ShardedTensor.from_rank_offsets("nope", torch.zeros(2)),
           "e": ShardedTensor.from_rank_offsets("emb", torch.zeros(10, 4))}
    loaded, missing, unexpected = dc.load(req, str(tmp_path), strict=StrictHandling.RETURN_ALL)
    assert missing == {"nope"} and unexpected == {"fc1.gate", "fc1.up"} and torch.equal(loaded["e"], vocab)
    with pytest.raises(CheckpointingException, match="unexpected keys"):
        dc.load({"e": ShardedTensor.from_rank_offsets("emb", torch.zeros(10, 4))}, str(tmp_path),
                strict="raise_unexpected")
    with pytest.raises(ValueError, match="strict='bogus'"):
        dc.load({}, str(tmp_path), strict="bogus")


def test_sharding_validation_and_mapping_errors(tmp_path):
    x = torch.zeros(4, 2)
    with pytest.raises(CheckpointingException, match="cover 8 of the 16"):
        dc.save({"a": ShardedTensor.from_rank_offsets("a", x, (0, 0, 2))}, str(tmp_path))
    assert not dc.check_is_distributed_checkpoint(str(tmp_path))
    with pytest.raises(CheckpointingException, match="invalid rank offset"):
        ShardedTensor.from_rank_offsets("a", x, (0, 2, 2))
    sh = ShardedTensor.from_rank_offsets("a", x, (1, 1, 3))
    assert sh.global_shape == (4, 6) and sh.global_offset == (0, 2) and sh.axis_fragmentations == (1, 3)
    assert sh.local_shape == (4, 2) and sh.replica_id == 0 and not sh.allow_shape_mismatch
    obj = ShardedObject("rng_state", 1, (2, 4), (1, 3))
    assert obj.unique_key == "rng_state/shard_1.3_2.4"
    assert ShardedObject.empty_from_unique_key(obj.unique_key).global_shape == (2, 4)


_DAMAGES = [
    ("metadata.json", lambda p: os.remove(p / "metadata.json")),
    ("__0_1.distcp", lambda p: os.remove(p / "__0_1.distcp")),
    ("__0_0.distcp is truncated", lambda p: os.truncate(p / "__0_0.distcp", 10)),
    ("common.pt", lambda p: os.truncate(p / "common.pt", 20)),
    (".metadata", lambda p: os.truncate(p / ".metadata", 30)),
]


def test_damaged_checkpoints_name_the_file(tmp_path):
    for i, (name, damage) in enumerate(_DAMAGES):
        ckpt = tmp_path / f"c{i}"
        state, _, _ = _state()
        dc.save(state, str(ckpt))
        damage(ckpt)
        request, _, _ = _state(seed=3)
        with pytest.raises(CheckpointingException, match=name.replace(".", r"\.")):
            dc.load(request, str(ckpt))


def test_async_save_same_files_and_commit_marker_last(tmp_path):
    state, full, _ = _state()
    dc.save(state, str(tmp_path / "sync"))
    state, _, _ = _state()
    request = dc.save(state, str(tmp_path / "async"), async_sharded_save=True)
    state["model"]["w"].data.zero_()  # staged copy must not see training's updates
    queue = AsyncCallsQueue()
    queue.schedule_async_request(request)
    assert not os.path.exists(tmp_path / "async" / "metadata.json")
    assert queue.maybe_finalize_async_calls(blocking=True, no_dist=True) == [0]
    assert queue.get_num_unfinalized_calls() == 0
    sync_files = sorted(os.listdir(tmp_path / "sync"))
    assert sorted(os.listdir(tmp_path / "async")) == sync_files
    for name in sync_files:
        if name.endswith(".distcp") or name in ("common.pt", "metadata.json"):
            assert (tmp_path / "sync" / name).read_bytes() == (tmp_path / "async" / name).read_bytes(), name
    assert torch.equal(dc.load_plain_tensors(str(tmp_path / "async"))["w"], full)

    # A writer killed before its finalize step leaves no commit marker and the directory fails to load.
    state, _, _ = _state()
    request = dc.save(state, str(tmp_path / "killed"), async_sharded_save=True)
    request.async_fn(*request.async_fn_args)
    assert not dc.check_is_distributed_checkpoint(str(tmp_path / "killed"))
    with pytest.raises(CheckpointingException, match="metadata.json is missing"):
        dc.load_plain_tensors(str(tmp_path / "killed"))
    # Re-saving over a complete checkpoint removes its marker until the new save is committed.
    state, _, _ = _state()
    request = dc.save(state, str(tmp_path / "sync"), async_sharded_save=True)
    assert not dc.check_is_distributed_checkpoint(str(tmp_path / "sync"))
    request.execute_sync()
    assert dc.check_is_distributed_checkpoint(str(tmp_path / "sync"))
