"""`OptimizerConfig`: every setting of the optimizer stack, with Megatron Core 0.13.1's names and defaults."""
from dataclasses import dataclass
from typing import Callable, Optional

import torch

_PRECISION_AWARE_DTYPES = {
    "main_grads_dtype": (torch.float32, torch.float16),
    "main_params_dtype": (torch.float32, torch.float16),
    "exp_avg_dtype": (torch.float32, torch.float16, torch.bfloat16, torch.uint8),
    "exp_avg_sq_dtype": (torch.float32, torch.float16, torch.bfloat16, torch.uint8),
}


@dataclass
class OptimizerConfig:
    """Configuration for the Megatron optimizer (built from the command line by `megatron.training`)."""

    optimizer: str = "adam"
    """Optimizer to use: 'adam' (AdamW semantics, decoupled weight decay) or 'sgd'."""

    lr: Optional[float] = None
    """Initial (peak) learning rate; the scheduler anneals it."""

    min_lr: Optional[float] = None
    """Minimum learning rate the scheduler anneals to."""

    decoupled_lr: Optional[float] = None
    """Separate peak learning rate for the input embedding and output layer params."""

    decoupled_min_lr: Optional[float] = None
    """Minimum learning rate for the decoupled-LR params (defaults to `min_lr`)."""

    weight_decay: float = 0.01
    """L2-style decoupled weight decay coefficient."""

    fp8_recipe: Optional[str] = None
    """FP8 recipe name when training in FP8 (affects parameter all-gather buffers only)."""

    fp16: bool = False
    """Model params are fp16: keep fp32 main params and use (dynamic) loss scaling."""

    bf16: bool = False
    """Model params are bf16: keep fp32 main params; no loss scaling."""

    reuse_grad_buf_for_mxfp8_param_ag: bool = False
    """Reuse the grad buffer for the MXFP8 parameter all-gather (Transformer Engine only)."""

    params_dtype: torch.dtype = torch.float32
    """dtype of the model parameters."""

    use_precision_aware_optimizer: bool = False
    """Let the optimizer keep main grads/params and Adam moments in lower precision (TE FusedAdam)."""

    store_param_remainders: bool = True
    """With the precision-aware optimizer and bf16 params, store only the 16-bit remainder of fp32 main params."""

    main_grads_dtype: torch.dtype = torch.float32
    """dtype of main grads with the precision-aware optimizer."""

    main_params_dtype: torch.dtype = torch.float32
    """dtype of main params with the precision-aware optimizer."""

    exp_avg_dtype: torch.dtype = torch.float32
    """dtype of Adam's first moment with the precision-aware optimizer."""

    exp_avg_sq_dtype: torch.dtype = torch.float32
    """dtype of Adam's second moment with the precision-aware optimizer."""

    loss_scale: Optional[float] = None
    """Static loss scale (positive power of 2 recommended); None means dynamic scaling for fp16."""

    initial_loss_scale: float = 2**32
    """Initial scale of the dynamic loss scaler."""

    min_loss_scale: float = 1.0
    """Lower bound of the dynamic loss scale."""

    loss_scale_window: float = 1000
    """Number of overflow-free steps after which the dynamic loss scale grows."""

    hysteresis: int = 2
    """Number of overflowing steps tolerated before the dynamic loss scale backs off."""

    adam_beta1: float = 0.9
    """Adam coefficient for the running average of the gradient."""

    adam_beta2: float = 0.999
    """Adam coefficient for the running average of the squared gradient."""

    adam_eps: float = 1e-08
    """Adam term added to the denominator for numerical stability."""

    sgd_momentum: float = 0.9
    """SGD momentum factor."""

    use_distributed_optimizer: bool = False
    """Shard optimizer state and main params across data-parallel ranks (ZeRO-1)."""

    overlap_param_gather_with_optimizer_step: bool = False
    """Overlap the first model chunk's param all-gather with the optimizer step (interleaved PP)."""

    optimizer_cpu_offload: bool = False
    """Offload optimizer state and computation to the CPU (HybridDeviceOptimizer)."""

    optimizer_offload_fraction: float = 0.0
    """Fraction of the optimizer state offloaded to the CPU."""

    use_torch_optimizer_for_cpu_offload: bool = False
    """Use torch.optim for the CPU part of an offloaded optimizer."""

    overlap_cpu_optimizer_d2h_h2d: bool = False
    """Overlap device-to-host and host-to-device copies of the CPU-offloaded optimizer."""

    pin_cpu_grads: bool = True
    """Pin CPU memory for offloaded grads."""

    pin_cpu_params: bool = True
    """Pin CPU memory for offloaded params."""

    clip_grad: float = 1.0
    """Clip gradients to this global L2 norm; 0 disables clipping."""

    log_num_zeros_in_grad: bool = False
    """Count the zero entries of the gradients each step (for logging)."""

    barrier_with_L1_time: bool = False
    """Barrier before starting the level-1 optimizer timers (more accurate, slower)."""

    timers: Optional[Callable] = None
    """`megatron.core.timers.Timers` instance used for the optimizer's level-1 timers."""

    config_logger_dir: str = ""
    """Directory where layer configs are dumped (debugging)."""

    def __post_init__(self):
        errors = []
        if self.fp16 and self.bf16:
            errors.append("fp16 and bf16 are mutually exclusive (--fp16 / --bf16): pass only one")
        if self.optimizer not in ("adam", "sgd"):
            errors.append(f"optimizer ({self.optimizer!r}) must be 'adam' or 'sgd' (--optimizer)")
        if self.use_precision_aware_optimizer:
            if self.optimizer != "adam":
                errors.append("use_precision_aware_optimizer (--use-precision-aware-optimizer) needs --optimizer adam")
            if not self.use_distributed_optimizer:
                errors.append(
                    "use_precision_aware_optimizer (--use-precision-aware-optimizer) needs "
                    "--use-distributed-optimizer"
                )
            for name, allowed in _PRECISION_AWARE_DTYPES.items():
                if getattr(self, name) not in allowed:
                    errors.append(f"{name} ({getattr(self, name)}) must be one of {list(allowed)}")
        else:
            for name in _PRECISION_AWARE_DTYPES:
                if getattr(self, name) != torch.float32:
                    errors.append(
                        f"{name} ({getattr(self, name)}) can only differ from torch.float32 with "
                        "--use-precision-aware-optimizer"
                    )
        if errors:
            raise ValueError("invalid OptimizerConfig: " + "; ".join(errors))
