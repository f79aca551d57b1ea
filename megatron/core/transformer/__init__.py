"""Transformer building blocks (Megatron Core names), re-exported lazily."""
import importlib

_LAZY_ATTRS = {
    "MegatronModule": ("megatron.core.transformer.module", "MegatronModule"),
    "ModuleSpec": ("megatron.core.transformer.spec_utils", "ModuleSpec"),
    "build_module": ("megatron.core.transformer.spec_utils", "build_module"),
    "TransformerConfig": ("megatron.core.transformer.transformer_config", "TransformerConfig"),
    "MLATransformerConfig": ("megatron.core.transformer.transformer_config", "MLATransformerConfig"),
    "TransformerLayer": ("megatron.core.transformer.transformer_layer", "TransformerLayer"),
    "TransformerLayerSubmodules": ("megatron.core.transformer.transformer_layer", "TransformerLayerSubmodules"),
}

__all__ = list(_LAZY_ATTRS)


def __getattr__(name):
    if name in _LAZY_ATTRS:
        module_name, attr = _LAZY_ATTRS[name]
        value = getattr(importlib.import_module(module_name), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'megatron.core.transformer' has no attribute {name!r}")
