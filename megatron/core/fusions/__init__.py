"""Fused operations in plain PyTorch (compiled on CUDA where it pays): bias + activation (GeLU, SwiGLU, GeGLU,
probability-weighted SwiGLU), bias + dropout + add, scale + mask + softmax, LayerNorm, cross-entropy, QKV + RoPE,
fp32 gradient accumulation."""
