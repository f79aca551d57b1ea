"""Rank 0 builds the GPT index caches, a barrier follows, the other ranks load them (2 gloo ranks)."""
import hashlib

import numpy as np

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from megatron.training.tokenizer.tokenizer import _NullTokenizer
from tests.harness import run_on_ranks


def _build(prefixes, cache):
    config = GPTDatasetConfig(random_seed=7, sequence_length=8, blend=(prefixes, [0.4, 0.6]), split="80,20,0",
                              tokenizer=_NullTokenizer(100), reset_position_ids=False,
                              reset_attention_mask=False, eod_mask_loss=False, path_to_cache=cache)
    train, valid, _ = BlendedMegatronDatasetBuilder(GPTDataset, [30, 6, None], lambda: True, config).build()
    digest = hashlib.md5()
    for ds in (train, valid):
        digest.update(np.asarray(ds.dataset_index).tobytes())
        for sub in ds.datasets:
            digest.update(np.asarray(sub.sample_index).tobytes() + np.asarray(sub.shuffle_index).tobytes())
    built = [sub.built_anew_on_cache_miss for sub in train.datasets]
    return digest.hexdigest(), built, train[4]["tokens"].tolist()


def test_rank0_builds_cache_then_others_load(tmp_path):
    rng = np.random.default_rng(3)
    prefixes = []
    for k in range(2):
        prefix = str(tmp_path / f"d{k}")
        b = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
        for _ in range(25):
            b.add_document(np.array(list(rng.integers(1, 99, size=12)) + [100]), [13])
        b.finalize(prefix + ".idx")
        prefixes.append(prefix)
    results = run_on_ranks(_build, 2, prefixes, str(tmp_path / "cache"), timeout=120)
    assert results[0][0] == results[1][0] and results[0][2] == results[1][2]
    assert results[0][1] == [True, True] and results[1][1] == [False, False]
