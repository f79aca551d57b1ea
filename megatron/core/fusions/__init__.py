"""Fused elementwise functions (bias+activation, bias+dropout+add) in plain PyTorch."""
