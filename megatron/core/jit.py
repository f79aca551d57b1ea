"""`jit_fuser`: the decorator Megatron puts on its elementwise fusions (`megatron.core.jit`).

With torch >= 2.2 it is `torch.compile` (TorchScript's nvFuser is deprecated there), otherwise
`torch.jit.script`, as in Megatron. This project's own fusions do not use it: they go through
`megatron.core.fusions._compile`, which compiles on CUDA and runs eagerly on the CPU; `jit_fuser` is
for user code written against Megatron.
"""
import torch

from megatron.core.utils import is_torch_min_version

jit_fuser = torch.compile if is_torch_min_version("2.2.0a0") else torch.jit.script
"""Decorator that fuses an elementwise function (torch.compile, or torch.jit.script on old torch)."""

__all__ = ["jit_fuser"]
