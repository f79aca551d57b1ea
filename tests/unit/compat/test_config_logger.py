"""`megatron.core.config_logger`: what a dump contains and where it goes."""
import json
from collections import OrderedDict
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megatron.core import config_logger
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit.transformer.model_setup import init_single_rank


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(2, 2)


def test_dumps_constructor_arguments_as_json(tmp_path):
    init_single_rank()
    off = SimpleNamespace(config_logger_dir="")
    assert not config_logger.has_config_logger_enabled(off)
    with pytest.raises(ValueError, match="config_logger_dir is empty"):
        config_logger.log_config_to_disk(off, {})

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, config_logger_dir=str(tmp_path))
    assert config_logger.has_config_logger_enabled(config)
    block = _Block()
    data = {"self": block, "config": config, "dtype": torch.bfloat16, "activation": F.gelu,
            "mask": AttnMaskType.causal, "layer": block, "sizes": (1, 2), "name": "x"}
    config_logger.log_config_to_disk(config, data)
    config_logger.log_config_to_disk(config, data)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["_Block.rank_0_0_0_0_0.iter0.json", "_Block.rank_0_0_0_0_0.iter1.json"]
    dumped = json.loads((tmp_path / files[0]).read_text())
    assert "self" not in dumped and dumped["name"] == "x" and dumped["sizes"] == [1, 2]
    assert dumped["dtype"] == "torch.bfloat16" and dumped["mask"] == str(AttnMaskType.causal)
    assert dumped["config"]["hidden_size"] == 8 and dumped["config"]["num_layers"] == 1
    assert dumped["layer"] == {"proj": str(block.proj)} and "gelu" in dumped["activation"]

    config_logger.log_config_to_disk(config, OrderedDict(weight=torch.ones(2)), prefix="state", rank_str="r0")
    loaded = torch.load(tmp_path / "state.rank_r0.iter0.pth")
    assert torch.equal(loaded["weight"], torch.ones(2))
