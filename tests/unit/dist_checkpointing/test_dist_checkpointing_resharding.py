"""N-D flattened tensors (Megatron's distributed-optimizer layout) through save and load in one process.

A known global tensor is saved the way a distributed optimizer at "TP=2, DP=2" writes it (each rank's flat
range of its TP chunk, `flattened_range` ShardedTensors), and read back by requests of other layouts: the
whole tensor, other TP splits, other flat ranges, the same chunking with other ranges, and a model-shaped
stored tensor read as flat ranges. Every read is compared with the known tensor, element for element.
"""
import math

import torch

from megatron.core import dist_checkpointing as dc
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.strategies.torch import read_dcp_metadata

KEY = "optimizer.state.exp_avg.decoder.layers.w"
LAYERS, ROWS, COLS = 3, 8, 6
GLOBAL = torch.arange(LAYERS * ROWS * COLS, dtype=torch.float32).view(LAYERS, ROWS, COLS)


def _flat_shards(key, tensor, axis, parts, cuts, prepend=1):
    """ShardedTensors of `tensor` ([layers, ...] when prepend) split into `parts` along model `axis`, each
    chunk's flattened elements cut at `cuts` (one shard per piece, as DP ranks own them)."""
    shards = []
    layers = tensor.shape[0] if prepend else 1
    for layer in range(layers):
        model = tensor[layer] if prepend else tensor
        for part, chunk in enumerate(model.chunk(parts, dim=axis)):
            flat = chunk.contiguous().view(-1)
            bounds = [0, *cuts, flat.numel()]
            offsets = ((0, layer, layers),) if prepend else ()
            for lo, hi in zip(bounds, bounds[1:]):
                shards.append(ShardedTensor.from_rank_offsets_flat(
                    key, flat[lo:hi].clone(), tuple(chunk.shape), *offsets, (axis + prepend, part, parts),
                    flattened_range=slice(lo, hi), prepend_axis_num=prepend))
    return shards


def _plain_shards(key, tensor, axis, parts, prepend=1, fill=0.0, shape=None):
    """Model-shaped requests: `parts` TP chunks along model `axis` per layer, filled with `fill`."""
    shards = []
    layers = tensor.shape[0] if prepend else 1
    shape = shape or tuple(tensor.shape[prepend:])
    for layer in range(layers):
        local = list(shape)
        local[axis] //= parts
        for part in range(parts):
            offsets = ((0, layer, layers),) if prepend else ()
            shards.append(ShardedTensor.from_rank_offsets(
                key, torch.full(local, fill), *offsets, (axis + prepend, part, parts), prepend_axis_num=prepend,
                allow_shape_mismatch=shape != tuple(tensor.shape[prepend:])))
    return shards


def _expected(shard, tensor):
    """What `shard` must hold: its region of `tensor` (flattened range of the chunk when flattened)."""
    region = tensor[tuple(slice(o, o + s) for o, s in zip(shard.global_offset, shard.chunk_shape()))]
    region = region.reshape(shard.local_shape)
    if shard.flattened_range is None:
        return region
    return region.reshape(-1)[shard.flattened_range]


def _load(shards, directory):
    loaded = dc.load({str(i): s for i, s in enumerate(shards)}, directory)
    return [loaded[str(i)] for i in range(len(shards))]


def test_nd_flattened_save_layout_and_every_reader(tmp_path):
    directory = str(tmp_path / "nd")
    dc.save({str(i): s for i, s in enumerate(_flat_shards(KEY, GLOBAL, 0, 2, [10]))}, directory)
    stored = read_dcp_metadata(directory)
    # [3, 8, 6] in chunks [1, 4, 6] -> [3, 2, 1, 24]; the model-space shape is recorded for Megatron's loader.
    assert tuple(stored.state_dict_metadata[KEY].size) == (LAYERS, 2, 1, 4 * COLS)
    assert stored.mcore_data[KEY] == {"nd_reformulated_orig_global_shape": (LAYERS, ROWS, COLS)}

    requests = {
        "whole tensor (TP=1, non-distributed)": _plain_shards(KEY, GLOBAL, 0, 1),
        "TP=3 along the columns": _plain_shards(KEY, GLOBAL, 1, 3),
        "TP=4 along the rows": _plain_shards(KEY, GLOBAL, 0, 4),
        "flat ranges of TP=3 column chunks": _flat_shards(KEY, torch.zeros_like(GLOBAL), 1, 3, [5, 11]),
        "flat ranges of TP=1": _flat_shards(KEY, torch.zeros_like(GLOBAL), 0, 1, [7, 40]),
        "same chunks, other ranges": _flat_shards(KEY, torch.zeros_like(GLOBAL), 0, 2, [3, 23]),
    }
    for name, shards in requests.items():
        for shard, value in zip(shards, _load(shards, directory)):
            assert torch.equal(value, _expected(shard, GLOBAL)), (name, shard.global_offset, shard.flattened_range)


def test_model_shaped_and_padded_keys_read_by_any_layout(tmp_path):
    model_dir, vocab_dir = str(tmp_path / "model"), str(tmp_path / "vocab")
    # A non-distributed optimizer's (or this framework's older) model-shaped state, read as flat ranges.
    model_shaped = dict(enumerate(_plain_shards(KEY, GLOBAL, 0, 1)))
    for shard in model_shaped.values():
        shard.data.copy_(_expected(shard, GLOBAL))
    dc.save({str(i): s for i, s in model_shaped.items()}, model_dir)
    shards = _flat_shards(KEY, torch.zeros_like(GLOBAL), 1, 2, [4])
    for shard, value in zip(shards, _load(shards, model_dir)):
        assert torch.equal(value, _expected(shard, GLOBAL))

    # A vocabulary padded to 10 rows, saved at "TP=2" N-D flattened, read into 12 padded rows: the stored rows
    # load, the extra ones keep the request's values (allow_shape_mismatch).
    vocab = torch.arange(40, dtype=torch.float32).view(10, 4)
    saved = _flat_shards("emb", vocab, 0, 2, [7], prepend=0)
    for shard in saved:
        shard.allow_shape_mismatch = True
    dc.save({str(i): s for i, s in enumerate(saved)}, vocab_dir)
    assert tuple(read_dcp_metadata(vocab_dir).state_dict_metadata["emb"].size) == (2, 1, 20)
    (whole,) = _load(_plain_shards("emb", vocab, 0, 1, prepend=0, fill=-1.0, shape=(12, 4)), vocab_dir)
    assert torch.equal(whole[:10], vocab) and bool((whole[10:] == -1).all())
    padded = torch.cat([vocab, torch.full((2, 4), -1.0)])
    requests = _flat_shards("emb", torch.full((12, 4), -1.0), 0, 3, [5], prepend=0)
    for shard in requests:
        shard.allow_shape_mismatch = True
    for shard, value in zip(requests, _load(requests, vocab_dir)):
        assert torch.equal(value, _expected(shard, padded)), (shard.global_offset, shard.flattened_range)


def test_one_dimensional_tensors_are_flattened_too(tmp_path):
    norm = torch.arange(6, dtype=torch.float32)
    dc.save({str(i): s for i, s in enumerate(_flat_shards("norm", norm, 0, 2, [1], prepend=0))}, str(tmp_path))
    # [6] in chunks [3] -> [2, 3] (Megatron's fixtures store a final-layernorm weight [h] as [1, h]).
    assert tuple(read_dcp_metadata(str(tmp_path)).state_dict_metadata["norm"].size) == (2, 3)
    (value,) = _load([ShardedTensor.from_rank_offsets("norm", torch.zeros(6))], str(tmp_path))
    assert torch.equal(value, norm) and math.prod(value.shape) == 6
