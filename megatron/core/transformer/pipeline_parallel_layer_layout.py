"""`PipelineParallelLayerLayout`: which layers sit on which (virtual) pipeline stage.

A layout string lists the stages separated by '|'. Inside a stage, 'E' is the embedding, 't' a
decoder layer, 'm' an MTP layer and 'L' the loss. 'X*N' repeats one symbol, '(...)*N' repeats a
group (which may contain '|'), and ',' is cosmetic. Stage i of the flattened list is virtual stage
i // PP on pipeline rank i % PP, so layer numbering follows Megatron's vp-major order.

This module is pure: callers pass the pipeline rank, so it can sit below `parallel_state`.
"""
import re
from typing import List, Optional, Sequence, Union

from megatron.core.transformer.enums import LayerType

_SYMBOLS = {"E": LayerType.embedding, "t": LayerType.decoder, "m": LayerType.mtp, "L": LayerType.loss}
_NAMES = {
    "embedding": LayerType.embedding,
    "decoder": LayerType.decoder,
    "mtp": LayerType.mtp,
    "loss": LayerType.loss,
}
_GROUP_REPEAT = re.compile(r"\(([^()]*)\)\*(\d+)")
_SYMBOL_REPEAT = re.compile(r"([EtmL])\*(\d+)")


def _expand(layout: str) -> str:
    """Expand '(..)*N' and 'X*N' until no repetition is left."""
    text = layout.replace(",", "").replace(" ", "")
    while True:
        expanded = _GROUP_REPEAT.sub(lambda m: m.group(1) * int(m.group(2)), text)
        if expanded == text:
            break
        text = expanded
    return _SYMBOL_REPEAT.sub(lambda m: m.group(1) * int(m.group(2)), text)


def _parse_stage(stage: Union[str, Sequence[str]], source: str) -> List[LayerType]:
    if isinstance(stage, str):
        unknown = [c for c in stage if c not in _SYMBOLS]
        if unknown:
            raise ValueError(
                f"pipeline_model_parallel_layout ({source!r}) has unknown symbols {unknown}: "
                "use E (embedding), t (decoder), m (mtp), L (loss), '|', '*N', '(...)' and ','."
            )
        return [_SYMBOLS[c] for c in stage]
    layers = []
    for name in stage:
        key = name if name in _NAMES else None
        if key is None and name in _SYMBOLS:
            layers.append(_SYMBOLS[name])
            continue
        if key is None:
            raise ValueError(
                f"pipeline_model_parallel_layout has unknown layer name {name!r}: "
                "use 'embedding', 'decoder', 'mtp' or 'loss'."
            )
        layers.append(_NAMES[key])
    return layers


class PipelineParallelLayerLayout:
    """Stages (flattened vp-major) each holding an ordered list of `LayerType`s."""

    def __init__(self, layout: List[List[LayerType]], pipeline_model_parallel_size: int):
        self.layout = layout
        self.pipeline_model_parallel_size = pipeline_model_parallel_size
        if pipeline_model_parallel_size <= 0 or len(layout) % pipeline_model_parallel_size != 0:
            raise ValueError(
                f"pipeline_model_parallel_layout has {len(layout)} stages, which is not a multiple of "
                f"pipeline_model_parallel_size ({pipeline_model_parallel_size}): give PP x VPP stages."
            )

    @classmethod
    def from_str(cls, layout: Union[str, list], pipeline_model_parallel_size: int) -> "PipelineParallelLayerLayout":
        """Parse a layout string ('E|(t|)*3,m|m||L') or a list of per-stage name lists."""
        if isinstance(layout, PipelineParallelLayerLayout):
            return layout
        if isinstance(layout, str):
            stages = [_parse_stage(s, layout) for s in _expand(layout).split("|")]
        else:
            stages = [_parse_stage(s, str(layout)) for s in layout]
        return cls(stages, pipeline_model_parallel_size)

    @property
    def virtual_pipeline_model_parallel_size(self) -> int:
        """Number of virtual stages per pipeline rank."""
        return len(self.layout) // self.pipeline_model_parallel_size

    def _stage_index(self, pp_rank: int, vp_stage: Optional[int]) -> int:
        return (vp_stage or 0) * self.pipeline_model_parallel_size + pp_rank

    def get_num_layers_to_build(
        self, layer_type: LayerType = LayerType.decoder, vp_stage: Optional[int] = None, pp_rank: int = 0
    ) -> int:
        """How many layers of `layer_type` this (pp_rank, vp_stage) builds."""
        return self.layout[self._stage_index(pp_rank, vp_stage)].count(layer_type)

    def get_layer_offset(
        self, layer_type: LayerType = LayerType.decoder, vp_stage: Optional[int] = None, pp_rank: int = 0
    ) -> int:
        """Global index of this stage's first layer of `layer_type` (0-based)."""
        index = self._stage_index(pp_rank, vp_stage)
        return sum(stage.count(layer_type) for stage in self.layout[:index])

    def get_layer_id_list(
        self, layer_type: LayerType = LayerType.decoder, vp_stage: Optional[int] = None, pp_rank: int = 0
    ) -> List[int]:
        """Global 0-based ids of this stage's layers of `layer_type`."""
        offset = self.get_layer_offset(layer_type, vp_stage, pp_rank)
        return list(range(offset, offset + self.get_num_layers_to_build(layer_type, vp_stage, pp_rank)))

    def problems(self, num_layers: int, mtp_num_layers: Optional[int], vpp: Optional[int]) -> List[str]:
        """Every way this layout disagrees with the model; empty when it is consistent."""
        problems = []
        flat = [layer for stage in self.layout for layer in stage]
        decoders = flat.count(LayerType.decoder)
        if decoders != num_layers:
            problems.append(
                f"pipeline_model_parallel_layout places {decoders} decoder layers but num_layers is {num_layers}."
            )
        mtps = flat.count(LayerType.mtp)
        if mtps != (mtp_num_layers or 0):
            problems.append(
                f"pipeline_model_parallel_layout places {mtps} mtp layers but mtp_num_layers is {mtp_num_layers}."
            )
        if flat.count(LayerType.embedding) != 1 or self.layout[0][:1] != [LayerType.embedding]:
            problems.append("pipeline_model_parallel_layout must start with exactly one embedding 'E' on stage 0.")
        if flat.count(LayerType.loss) != 1 or self.layout[-1][-1:] != [LayerType.loss]:
            problems.append("pipeline_model_parallel_layout must end with exactly one loss 'L' on the last stage.")
        if vpp is not None and vpp != self.virtual_pipeline_model_parallel_size:
            problems.append(
                f"virtual_pipeline_model_parallel_size ({vpp}) disagrees with the layout, which has "
                f"{self.virtual_pipeline_model_parallel_size} virtual stages per pipeline rank."
            )
        return problems

    def __repr__(self) -> str:
        names = {v: k for k, v in _SYMBOLS.items()}
        return "|".join("".join(names[layer] for layer in stage) for stage in self.layout)


__all__ = ["PipelineParallelLayerLayout"]
