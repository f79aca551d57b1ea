"""Megatron Core's inference: sampling params, requests, KV-cache contexts, controllers and engines."""
