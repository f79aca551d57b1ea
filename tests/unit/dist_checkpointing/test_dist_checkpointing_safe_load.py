"""The restricted unpickler: Megatron-style pickled args load, arbitrary classes are refused, and
nothing in the checkpoint code unpickles with weights_only=False."""
import argparse
import enum
import sys
import types
from pathlib import Path

import pytest
import torch

from megatron.core.dist_checkpointing import CheckpointingException
from megatron.core.dist_checkpointing import safe_load
from megatron.core.dist_checkpointing.safe_load import safe_torch_load
from megatron.core.rerun_state_machine import RerunMode
from megatron.core.transformer.enums import AttnBackend

ROOT = Path(__file__).resolve().parents[3]


class Exploit:
    """Stands for any class a malicious checkpoint could smuggle in."""

    def __reduce__(self):
        return (print, ("this must never run",))


def test_megatron_namespace_with_dtypes_and_enums(tmp_path):
    args = argparse.Namespace(
        params_dtype=torch.bfloat16, main_grads_dtype=torch.float32, attention_backend=AttnBackend.auto,
        tensor_model_parallel_size=2, cp_comm_type=["p2p"], data_path=None, lr=3e-4,
    )
    state = {"args": args, "checkpoint_version": 3.0, "iteration": 5,
             "rerun_state_machine": {"mode": list(RerunMode)[0]}, "model": {"w": torch.ones(2)}}
    torch.save(state, tmp_path / "model_optim_rng.pt")
    loaded = safe_torch_load(str(tmp_path / "model_optim_rng.pt"))
    assert isinstance(loaded["args"], argparse.Namespace)
    assert loaded["args"].params_dtype is torch.bfloat16 and loaded["args"].attention_backend is AttnBackend.auto
    assert loaded["rerun_state_machine"]["mode"] is list(RerunMode)[0]
    assert torch.equal(loaded["model"]["w"], torch.ones(2)) and loaded["iteration"] == 5


def test_enum_of_an_unimportable_module_gets_a_stand_in(tmp_path, monkeypatch):
    """A checkpoint names a Megatron enum whose module does not exist here: the stand-in is used."""
    name = "megatron.core.gone_for_test"

    class Recipe(str, enum.Enum):
        delayed = "delayed"

    class StandIn(str, enum.Enum):
        delayed = "delayed"

    Recipe.__module__, Recipe.__qualname__ = name, "Recipe"
    fake = types.ModuleType(name)
    fake.Recipe = Recipe
    monkeypatch.setitem(sys.modules, name, fake)
    torch.save({"recipe": Recipe.delayed}, tmp_path / "c.pt")
    monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(safe_load.MEGATRON_CLASSES, f"{name}.Recipe", StandIn)
    loaded = safe_torch_load(str(tmp_path / "c.pt"))
    assert loaded["recipe"] is StandIn.delayed


def test_arbitrary_class_is_refused_with_type_and_file(tmp_path):
    torch.save({"args": Exploit()}, tmp_path / "bad.pt")
    with pytest.raises(CheckpointingException, match=r"bad\.pt.*type print"):
        safe_torch_load(str(tmp_path / "bad.pt"))
    torch.save({"x": argparse.ArgumentParser}, tmp_path / "bad2.pt")
    with pytest.raises(CheckpointingException, match=r"bad2\.pt.*argparse\.ArgumentParser"):
        safe_torch_load(str(tmp_path / "bad2.pt"))
    with pytest.raises(CheckpointingException, match=r"missing\.pt is missing"):
        safe_torch_load(str(tmp_path / "missing.pt"))


def test_no_unrestricted_unpickling_in_checkpoint_code():
    offenders = []
    for folder in ("megatron/core/dist_checkpointing", "tools/checkpoint"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text()
            if "weights_only=False" in text.replace(" ", "") or "pickle.load(" in text:
                offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, f"unrestricted unpickling in {offenders}"
