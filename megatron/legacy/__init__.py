"""Compatibility paths from Megatron-LM's legacy package (`megatron.legacy.data.data_samplers`)."""
