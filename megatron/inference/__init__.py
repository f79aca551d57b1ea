"""Megatron-LM's serving layer: the REST text-generation server over Megatron Core's inference engine."""
