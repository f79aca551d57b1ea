"""Megatron's pretraining samplers: DP slicing, dropping the last partial chunk, exact resume."""
from types import SimpleNamespace

import torch

from megatron.core import parallel_state
from megatron.legacy.data.data_samplers import MegatronPretrainingSampler as LegacySampler
from megatron.training import global_vars
from megatron.training.datasets import data_samplers
from megatron.training.datasets.data_samplers import (
    MegatronPretrainingRandomSampler,
    MegatronPretrainingSampler,
    build_pretraining_data_loader,
)


def test_single_sampler_dp_slices_and_resume():
    assert LegacySampler is MegatronPretrainingSampler
    batches = {r: list(MegatronPretrainingSampler(23, 0, 2, r, 3)) for r in range(3)}
    assert batches[0][:2] == [[0, 1], [6, 7]] and batches[2][:2] == [[4, 5], [10, 11]]
    assert all(len(b) == 3 for b in batches.values())  # 23 // 6 chunks; the partial one is dropped
    resumed = list(MegatronPretrainingSampler(23, 12, 2, 1, 3))
    assert resumed == batches[1][2:]
    try:
        MegatronPretrainingSampler(10, 10, 2, 0, 1)
    except ValueError as err:
        assert "consumed_samples" in str(err)
    else:
        raise AssertionError("expected ValueError")


def test_random_sampler_epochs_and_resume():
    for sharding in (True, False):
        full = [list(MegatronPretrainingRandomSampler(None, 20, 0, 2, r, 2, sharding)) for r in range(2)]
        seen = sorted(i for rank in full for b in rank for i in b)
        assert seen == sorted(set(seen)) and len(seen) == 20
        # Resuming after 2 global steps (2 * mbs * dp = 8 samples) continues the same stream.
        for r in range(2):
            sampler = MegatronPretrainingRandomSampler(None, 20, 8, 2, r, 2, sharding)
            assert list(sampler)[:3] == full[r][2:5]
        nxt = list(MegatronPretrainingRandomSampler(None, 20, 20, 2, 0, 2, sharding))
        assert nxt != full[0]  # epoch 1 is reshuffled with seed 1


class _Dataset(torch.utils.data.Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, i):
        return {"tokens": torch.full((4,), i, dtype=torch.long)}


def test_build_pretraining_data_loader(monkeypatch):
    monkeypatch.setattr(parallel_state, "get_data_parallel_rank", lambda *a, **k: 1)
    monkeypatch.setattr(parallel_state, "get_data_parallel_world_size", lambda *a, **k: 2)
    global_vars.set_args(SimpleNamespace(dataloader_type="single", micro_batch_size=2, num_workers=0, data_sharding=True))
    try:
        loader = build_pretraining_data_loader(_Dataset(), consumed_samples=4)
        assert [b["tokens"][:, 0].tolist() for b in loader] == [[6, 7]]
        assert build_pretraining_data_loader(None, 0) is None
        global_vars.set_args(SimpleNamespace(dataloader_type="external", micro_batch_size=2, num_workers=0))
        ds = _Dataset()
        assert build_pretraining_data_loader(ds, 0) is ds
        assert data_samplers.get_args is global_vars.get_args
    finally:
        global_vars.set_args(None)


def test_get_blend_and_blend_per_split(tmp_path):
    import json as _json

    import numpy as _np
    import pytest as _pytest

    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    from megatron.training.datasets import get_blend_and_blend_per_split

    prefix = str(tmp_path / "a")
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=_np.uint16)
    b.add_item(_np.array([1, 2]))
    b.end_document()
    b.finalize(prefix + ".idx")
    ns = SimpleNamespace
    assert get_blend_and_blend_per_split(ns(data_path=["0.5", prefix, "0.5", prefix])) == (([prefix, prefix], [0.5, 0.5]), None)
    per_split = tmp_path / "ps.json"
    per_split.write_text(_json.dumps({"train": [prefix], "valid": [prefix], "test": None}))
    got = get_blend_and_blend_per_split(ns(data_path=None, per_split_data_args_path=str(per_split)))
    assert got == (None, [([prefix], None), ([prefix], None), None])
    got = get_blend_and_blend_per_split(ns(data_path=None, train_data_path=[prefix], valid_data_path=None, test_data_path=None))
    assert got == (None, [([prefix], None), None, None])
    with _pytest.raises(ValueError, match="--data-path: .*missing.bin/.idx not found"):
        get_blend_and_blend_per_split(ns(data_path=[str(tmp_path / "missing")]))
