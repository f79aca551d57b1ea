"""`HeterogeneousTransformerConfig`: a transformer whose layers differ (Llama-Nemotron / DeciLM style).

The per-layer architecture comes from the `block_configs` list of a Hugging Face style `config.json`
(`heterogeneous_layers_config_path`) or from the same JSON as a string (`heterogeneous_layers_config_encoded_json`,
which is what checkpoints keep). Each block has an `attention` and an `ffn` (or `mlp`) entry, read exactly as
Megatron Core 0.13.1 reads them:

- attention: `no_op` (the layer has no attention: identity, no norm), `replace_with_linear` (one h -> h linear
  instead), and `num_query_groups`, or HF's `n_heads_in_group` = heads per KV group, giving
  `num_query_groups = num_attention_heads // n_heads_in_group` (null: the global value);
- ffn: `no_op`, `replace_with_linear`, and `ffn_hidden_size`, or HF's `ffn_mult`, giving
  `ffn_hidden_size = round_up(int(2 * ffn_mult * hidden_size / 3), 256)` (null: the global value).

`get_config_for_layer(layer_number)` is the plain `TransformerConfig` a layer is built with: this config with
that block's `num_query_groups` / `ffn_hidden_size` where the block sets them. Problems of the JSON are
collected and raised as one ValueError naming the block (Megatron asserts on the first one, some only when the
layer is built).
"""
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from megatron.core.transformer.transformer_config import TransformerConfig


def _block_entry(block: dict, names, index: int, problems: List[str]) -> dict:
    for name in names:
        if isinstance(block.get(name), dict):
            return dict(block[name])
    problems.append(f"block_configs[{index}] has no {' or '.join(repr(n) for n in names)} object")
    return {}


def _known_fields(cls, values: dict) -> dict:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in values.items() if k in names}


@dataclass
class AttentionConfig:
    """The self-attention part of one block of a heterogeneous transformer."""

    no_op: bool = False
    """The layer has no attention (identity, no norm, no residual add)."""

    replace_with_linear: bool = False
    """The attention is replaced by one h -> h linear."""

    num_query_groups: Optional[int] = None
    """Query groups of this layer's attention (None: the model's value)."""

    @classmethod
    def build_config_from_dict(cls, block_config_dict: dict, num_attention_heads: int,
                               index: int = 0, problems: Optional[List[str]] = None) -> "AttentionConfig":
        """Megatron's reading of `block_config_dict["attention"]` (HF's `n_heads_in_group` included)."""
        problems = [] if problems is None else problems
        values = _block_entry(block_config_dict, ("attention",), index, problems)
        if "num_query_groups" not in values:
            if "n_heads_in_group" not in values:
                problems.append(f"block_configs[{index}].attention needs 'n_heads_in_group' (null for the "
                                "model's value) or 'num_query_groups'")
            heads_in_group = values.pop("n_heads_in_group", None)
            groups = None
            if heads_in_group is not None:
                if heads_in_group <= 0 or num_attention_heads % heads_in_group != 0:
                    problems.append(f"block_configs[{index}].attention: num_attention_heads ({num_attention_heads}) "
                                    f"must be a multiple of n_heads_in_group ({heads_in_group})")
                else:
                    groups = num_attention_heads // heads_in_group
            values["num_query_groups"] = groups
        return cls(**_known_fields(cls, values))


@dataclass
class MLPConfig:
    """The MLP part of one block of a heterogeneous transformer."""

    no_op: bool = False
    """The layer has no MLP (identity, no norm, no residual add)."""

    replace_with_linear: bool = False
    """The MLP is replaced by one h -> h linear."""

    ffn_hidden_size: Optional[int] = None
    """Intermediate size of this layer's MLP (None: the model's value)."""

    @classmethod
    def build_config_from_dict(cls, block_config_dict: dict, hidden_size: int,
                               index: int = 0, problems: Optional[List[str]] = None) -> "MLPConfig":
        """Megatron's reading of `block_config_dict["ffn"]` (or `["mlp"]`, HF's `ffn_mult` included)."""
        problems = [] if problems is None else problems
        values = _block_entry(block_config_dict, ("ffn", "mlp"), index, problems)
        if "ffn_hidden_size" not in values:
            if "ffn_mult" not in values:
                problems.append(f"block_configs[{index}].ffn needs 'ffn_mult' (null for the model's value) or "
                                "'ffn_hidden_size'")
            ffn_mult = values.pop("ffn_mult", None)
            values["ffn_hidden_size"] = (
                None if ffn_mult is None else cls.ffn_mult_to_intermediate_size(ffn_mult, hidden_size)
            )
        return cls(**_known_fields(cls, values))

    @staticmethod
    def ffn_mult_to_intermediate_size(ffn_mult: float, hidden_size: int) -> int:
        """Llama-Nemotron's intermediate size: int(2 * ffn_mult * hidden_size / 3), rounded up to a multiple of 256."""
        return MLPConfig.find_multiple(int(2 * ffn_mult * hidden_size / 3), 256)

    @staticmethod
    def find_multiple(n: int, k: int) -> int:
        """The smallest multiple of `k` that is >= `n`."""
        return n if n % k == 0 else n + k - (n % k)


@dataclass
class TransformerBlockConfig:
    """The attention and MLP configuration of one block (layer)."""

    attention: AttentionConfig
    """Self-attention part."""

    mlp: MLPConfig
    """MLP part."""


def _block_problems(index: int, block: TransformerBlockConfig, config: TransformerConfig) -> List[str]:
    problems = []
    for part, override, name in ((block.attention, block.attention.num_query_groups, "num_query_groups"),
                                 (block.mlp, block.mlp.ffn_hidden_size, "ffn_hidden_size")):
        kind = "attention" if part is block.attention else "ffn"
        if part.no_op and part.replace_with_linear:
            problems.append(f"block_configs[{index}].{kind}: no_op and replace_with_linear are both true")
        if override is not None and (part.no_op or part.replace_with_linear):
            problems.append(f"block_configs[{index}].{kind}: {name} ({override}) is set, but the block is "
                            f"{'no_op' if part.no_op else 'replace_with_linear'}: set it to null")
    groups, ffn = block.attention.num_query_groups, block.mlp.ffn_hidden_size
    tp, heads = config.tensor_model_parallel_size, config.num_attention_heads
    if groups is not None and (groups <= 0 or groups % tp != 0 or heads % groups != 0):
        problems.append(f"block_configs[{index}].attention: num_query_groups ({groups}) must divide "
                        f"num_attention_heads ({heads}) and be a multiple of tensor_model_parallel_size ({tp})")
    if ffn is not None and (ffn <= 0 or ffn % tp != 0):
        problems.append(f"block_configs[{index}].ffn: ffn_hidden_size ({ffn}) must be a positive multiple of "
                        f"tensor_model_parallel_size ({tp})")
    return problems


@dataclass
class HeterogeneousTransformerConfig(TransformerConfig):
    """A `TransformerConfig` whose layers follow the `block_configs` of a Hugging Face style JSON."""

    heterogeneous_layers_config_path: str = ""
    """Path of the JSON file with the `block_configs` list."""

    heterogeneous_layers_config_encoded_json: str = ""
    """The JSON itself (read from `heterogeneous_layers_config_path` when empty); checkpoints keep it."""

    per_block_parameters: List[TransformerBlockConfig] = field(init=False, default_factory=list)
    """The parsed configuration of every block (layer), in layer order."""

    def __post_init__(self):
        super().__post_init__()
        self.heterogeneous_block_specs = True
        if self.heterogeneous_layers_config_encoded_json in ("", None):
            if not self.heterogeneous_layers_config_path:
                raise ValueError("HeterogeneousTransformerConfig needs heterogeneous_layers_config_path "
                                 "(--heterogeneous-layers-config-path) or heterogeneous_layers_config_encoded_json")
            self.heterogeneous_layers_config_encoded_json = Path(self.heterogeneous_layers_config_path).read_text()
        self.per_block_parameters = self._parse_blocks()

    def _parse_blocks(self) -> List[TransformerBlockConfig]:
        document = json.loads(self.heterogeneous_layers_config_encoded_json)
        blocks = document.get("block_configs") if isinstance(document, dict) else None
        if not isinstance(blocks, list):
            raise ValueError("the heterogeneous layers config has no 'block_configs' list (a Hugging Face style "
                             "config.json of a Llama-Nemotron / DeciLM model)")
        problems, parsed = [], []
        for index, block in enumerate(blocks):
            block = block if isinstance(block, dict) else {}
            parsed.append(TransformerBlockConfig(
                attention=AttentionConfig.build_config_from_dict(block, self.num_attention_heads, index, problems),
                mlp=MLPConfig.build_config_from_dict(block, self.hidden_size, index, problems),
            ))
            problems += _block_problems(index, parsed[-1], self)
        if len(parsed) < self.num_layers:
            problems.append(f"block_configs has {len(parsed)} blocks but num_layers is {self.num_layers}: every "
                            "layer needs a block")
        if problems:
            raise ValueError("invalid heterogeneous layers config:\n  " + "\n  ".join(problems))
        return parsed

    def get_config_for_layer(self, layer_number: int) -> TransformerConfig:
        """The `TransformerConfig` of layer `layer_number` (1-based, global): this config with the block's
        num_query_groups / ffn_hidden_size where it sets them."""
        if not 1 <= layer_number <= len(self.per_block_parameters):
            raise ValueError(f"Invalid layer number: {layer_number}. Should be in range "
                             f"[1, {len(self.per_block_parameters)}].")
        block = self.per_block_parameters[layer_number - 1]
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(TransformerConfig) if f.init}
        if block.attention.num_query_groups is not None:
            values["num_query_groups"] = block.attention.num_query_groups
        if block.mlp.ffn_hidden_size is not None:
            values["ffn_hidden_size"] = block.mlp.ffn_hidden_size
        return TransformerConfig(**values)


__all__ = ["AttentionConfig", "MLPConfig", "TransformerBlockConfig", "HeterogeneousTransformerConfig"]
