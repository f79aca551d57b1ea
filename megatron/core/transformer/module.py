"""`MegatronModule` (the base of every model part) and `Float16Module` (the fp16/bf16 wrapper)."""
from typing import Optional

import torch

from megatron.core import parallel_state
from megatron.core.transformer.sharded import generic_sharded_state_dict
from megatron.core.transformer.transformer_config import TransformerConfig

_FLOAT_TYPES = (torch.float32,)
_HALF_TYPES = (torch.float16, torch.bfloat16)


class MegatronModule(torch.nn.Module):
    """Base class of Megatron Core modules: holds the config and the checkpoint/microbatch hooks."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        """The state dict written to legacy (torch-format) checkpoints."""
        return self.state_dict(prefix=prefix, keep_vars=keep_vars)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """Distributed-checkpoint view: own tensors replicated, children through their own method."""
        return generic_sharded_state_dict(self, prefix, sharded_offsets, metadata)

    def set_is_first_microbatch(self):
        """Mark the next forward as the first microbatch (modules that cache weights refresh them)."""
        for module in self.modules():
            if hasattr(module, "is_first_microbatch"):
                module.is_first_microbatch = True

    def set_symmetric_ar(self, set_to: Optional[str] = None) -> None:
        """Record the symmetric all-reduce type on every submodule that reads it."""
        for module in self.modules():
            if hasattr(module, "symmetric_ar_type"):
                module.symmetric_ar_type = set_to


def param_is_not_shared(param) -> bool:
    """True unless `param` is marked `shared` (a copy of a parameter owned elsewhere, e.g. a tied embedding)."""
    return not getattr(param, "shared", False)


def conversion_helper(val, conversion):
    """Apply `conversion` to `val`, recursing into nested tuples and lists (kept as tuples and lists).

    Like Megatron, other containers (dicts, ...) are handed to `conversion` whole, which leaves them alone.
    """
    if not isinstance(val, (tuple, list)):
        return conversion(val)
    converted = [conversion_helper(v, conversion) for v in val]
    return tuple(converted) if isinstance(val, tuple) else converted


def _data_dtype(val):
    """The dtype of a tensor (parameters judged by their data), None for anything else."""
    return val.dtype if torch.is_tensor(val) else None


def fp32_to_float16(val, float16_convertor):
    """Cast every fp32 tensor inside `val` (nested tuples/lists) with `float16_convertor`."""
    return conversion_helper(val, lambda v: float16_convertor(v) if _data_dtype(v) in _FLOAT_TYPES else v)


def float16_to_fp32(val):
    """Cast every fp16/bf16 tensor inside `val` (nested tuples/lists) to fp32."""
    return conversion_helper(val, lambda v: v.float() if _data_dtype(v) in _HALF_TYPES else v)


class Float16Module(MegatronModule):
    """Runs `module` in fp16 or bf16.

    Casts the module's parameters once; on the first pipeline stage fp32 positional inputs are cast
    down (keyword inputs are left alone, as in Megatron), and on the last stage outputs are cast back
    to fp32.
    """

    def __init__(self, config: TransformerConfig, module: torch.nn.Module):
        super().__init__(config)
        self.fp16 = config.fp16
        self.bf16 = config.bf16
        self.vp_stage = getattr(module, "vp_stage", None)
        if self.fp16:
            self.add_module("module", module.half())
            self.float16_convertor = lambda t: t.half()
        elif self.bf16:
            self.add_module("module", module.bfloat16())
            self.float16_convertor = lambda t: t.bfloat16()
        else:
            raise ValueError("Float16Module needs config.fp16 or config.bf16 to be True: set --fp16 or --bf16.")

    def set_input_tensor(self, input_tensor):
        """Forward the pipeline input tensor to the wrapped model."""
        return self.module.set_input_tensor(input_tensor)

    def forward(self, *inputs, fp32_output: bool = True, **kwargs):
        if parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=self.vp_stage):
            inputs = fp32_to_float16(inputs, self.float16_convertor)
        outputs = self.module(*inputs, **kwargs)
        if fp32_output and parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=self.vp_stage):
            outputs = float16_to_fp32(outputs)
        return outputs

    def state_dict(self, destination=None, prefix="", keep_vars=False):
        return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        """Checkpoint state of the wrapped model (no `module.` prefix)."""
        return self.module.state_dict_for_save_checkpoint(prefix=prefix, keep_vars=keep_vars)

    def sharded_state_dict(self, prefix: str = "", *args, **kwargs):
        """Sharded state dict of the wrapped model."""
        return self.module.sharded_state_dict(prefix, *args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True):
        return self.module.load_state_dict(state_dict, strict=strict)


__all__ = ["MegatronModule", "Float16Module", "param_is_not_shared", "conversion_helper", "fp32_to_float16",
           "float16_to_fp32"]
