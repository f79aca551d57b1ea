"""Activation recompute really lowers the memory kept for backward (benchmarks/memory/activation_memory.py)."""
import argparse

from benchmarks.memory.activation_memory import MODES, measure
from tests.harness import run_on_ranks


def _saved_bytes_per_mode():
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    args = argparse.Namespace(layers=3, hidden=64, heads=4, seq=128, mbs=2, vocab=256)
    return {name: measure(args, kwargs, "cpu")[0] for name, kwargs in MODES.items()}


def test_recompute_lowers_saved_activation_bytes():
    saved = run_on_ranks(_saved_bytes_per_mode, 1)[0]
    none = saved["none"]
    full = saved["full block (all layers)"]
    # Full recompute keeps only each layer's input ([s, b, h]) plus the embedding/output-layer tensors.
    assert full < 0.35 * none, saved
    assert saved["full uniform (1 layer)"] < 0.35 * none, saved
    assert saved["selective (core_attn, mlp, layernorm)"] < 0.8 * none, saved
    assert saved["selective (core_attn)"] <= none, saved
