"""Optimizer CPU offload (`--optimizer-cpu-offload`): `HybridDeviceOptimizer` steps a fraction of the params
on the host. Megatron Core's package path."""
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

__all__ = ["HybridDeviceOptimizer"]
