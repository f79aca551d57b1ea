"""`ModelParallelConfig`: the parallelism, precision and runtime settings every core module reads.

Same field names and defaults as Megatron Core 0.13.1. `TransformerConfig` extends it. `__post_init__`
derives the defaulted fields and collects every violated rule into one `ValueError`.
"""
from dataclasses import dataclass
from typing import Callable, ContextManager, List, Optional

import torch


@dataclass
class ModelParallelConfig:
    """Base configuration for Megatron Core: parallel sizes, init, dtypes, hooks and comm options."""

    # Model parallelism
    tensor_model_parallel_size: int = 1
    """Intra-layer (tensor) model parallel size: weight matrices are split across this many ranks."""

    pipeline_model_parallel_comm_backend: Optional[str] = None
    """Backend for pipeline p2p communication ('nccl' or 'ucc'); None uses the default backend."""

    pipeline_model_parallel_size: int = 1
    """Inter-layer (pipeline) model parallel size: transformer layers are split across this many ranks."""

    virtual_pipeline_model_parallel_size: Optional[int] = None
    """Number of model chunks per pipeline rank (interleaved schedule); None means no interleaving."""

    sequence_parallel: bool = False
    """Split norms/dropout activations along the sequence dimension across TP ranks (needs TP > 1)."""

    context_parallel_size: int = 1
    """Splits the input along the sequence dimension across this many ranks (attention exchanges K/V)."""

    hierarchical_context_parallel_sizes: Optional[List[int]] = None
    """Sizes of the levels of hierarchical context parallelism (e.g. [a2a size, p2p size])."""

    expert_model_parallel_size: int = 1
    """Number of ranks MoE experts are distributed over."""

    expert_tensor_parallel_size: Optional[int] = None
    """Tensor parallel size inside MoE experts; None means the same as tensor_model_parallel_size."""

    # Initialization
    perform_initialization: bool = True
    """Initialise weights at construction; turn off when weights are loaded from a checkpoint anyway."""

    use_cpu_initialization: bool = False
    """Build each full weight on CPU and slice this rank's shard: init is identical for every TP size."""

    # Training
    fp16: bool = False
    """Train with fp16 mixed precision."""

    bf16: bool = False
    """Train with bf16 mixed precision."""

    params_dtype: torch.dtype = torch.float32
    """dtype the weights are created in."""

    timers: Optional[Callable] = None
    """Timers object (megatron.core.timers.Timers) used for optional timing."""

    finalize_model_grads_func: Optional[Callable] = None
    """Called after the backward passes to finish grad reductions (DP, PP embedding, SP norms)."""

    grad_scale_func: Optional[Callable] = None
    """Takes the loss and returns the scaled loss (loss scaling); None leaves the loss unchanged."""

    no_sync_func: Optional[Callable] = None
    """Returns a context manager that suppresses asynchronous data-parallel grad reduction."""

    grad_sync_func: Optional[Callable] = None
    """Launches asynchronous grad reductions for an iterable of parameters."""

    param_sync_func: Optional[Callable] = None
    """Launches asynchronous parameter all-gathers for an iterable of parameters."""

    deterministic_mode: bool = False
    """Prefer deterministic kernels (slower; for debugging and testing)."""

    enable_autocast: bool = False
    """Run the forward step inside torch.autocast."""

    autocast_dtype: Optional[torch.dtype] = None
    """dtype for torch.autocast; None means params_dtype."""

    num_microbatches_with_partial_activation_checkpoints: Optional[int] = None
    """Number of microbatches in which not all layers are recomputed; None leaves it to forward_step."""

    # Optimizations
    gradient_accumulation_fusion: bool = False
    """Accumulate weight grads straight into `param.main_grad` inside the linear backward."""

    use_te_rng_tracker: bool = False
    """Use Transformer Engine's RNG tracker (needed for CUDA graphs)."""

    tp_comm_overlap: bool = False
    """Overlap the sequence-parallel all-gathers / reduce-scatters of the linear layers (forward and backward)
    with their GEMMs (`--tp-comm-overlap`; native chunked pipelines in `tensor_parallel/overlap.py`, no
    userbuffers). How the chunks move is `tp_comm_overlap_transport`. Needs sequence_parallel. A decision of
    the optimisation plan (`megatron.core.optimization_plan`), which applies it to the built layers."""

    tp_comm_overlap_transport: str = "auto"
    """`--tp-comm-overlap-transport` (this framework's flag): how the `--tp-comm-overlap` pipelines move their
    chunks: 'copy-engine' (peer copies out of torch's symmetric memory, `tensor_parallel.peer_copy`; the TP
    ranks must share a host), 'p2p' (point-to-point sends over the TP group's backend) or 'auto'
    (copy-engine on CUDA with NCCL, p2p elsewhere)."""

    tp_comm_bulk_wgrad: bool = True
    """TP overlap option: bulk overlap of the weight-grad GEMM. Ignored unless tp_comm_overlap."""

    tp_comm_bulk_dgrad: bool = True
    """TP overlap option: bulk overlap of the data-grad GEMM. Ignored unless tp_comm_overlap."""

    tp_comm_overlap_ag: bool = True
    """TP overlap option: pipeline all-gather with the GEMM. Ignored unless tp_comm_overlap."""

    tp_comm_overlap_rs: bool = True
    """TP overlap option: pipeline reduce-scatter with the GEMM. Ignored unless tp_comm_overlap."""

    tp_comm_overlap_rs_dgrad: bool = False
    """TP overlap option: reduce-scatter overlap with the DGRAD GEMM. Ignored unless tp_comm_overlap."""

    tp_comm_split_ag: bool = True
    """Deprecated TP overlap option: split all-gather overlap with the forward GEMM."""

    tp_comm_atomic_ag: bool = False
    """Deprecated TP overlap option: atomic all-gather overlap with the forward GEMM."""

    tp_comm_split_rs: bool = True
    """Deprecated TP overlap option: split reduce-scatter overlap with the forward GEMM."""

    tp_comm_atomic_rs: bool = False
    """Deprecated TP overlap option: atomic reduce-scatter overlap with the forward GEMM."""

    cross_entropy_loss_fusion: bool = False
    """Use the fused cross-entropy implementation."""

    cross_entropy_fusion_impl: str = "native"
    """Fused cross-entropy implementation: 'native' (Megatron Core) or 'te' (Transformer Engine)."""

    tp_comm_overlap_disable_qkv: bool = False
    """Disable the all-gather/GEMM overlap for the QKV projection."""

    tp_comm_overlap_disable_fc1: bool = False
    """Disable the all-gather/GEMM overlap for the MLP fc1 projection."""

    tp_comm_bootstrap_backend: str = "nccl"
    """Backend used to bootstrap TP comm overlap buffers ('nccl', 'mpi' or 'gloo')."""

    delay_wgrad_compute: bool = False
    """Delay weight-grad computation to overlap it with communication (MoE a2a overlap)."""

    # Pipeline parallel
    pipeline_dtype: Optional[torch.dtype] = None
    """dtype of tensors sent between pipeline stages (usually params_dtype); required when PP > 1."""

    variable_seq_lengths: bool = False
    """Exchange tensor shapes before each pipeline transfer because sequence lengths vary per microbatch."""

    overlap_p2p_comm: bool = False
    """Overlap pipeline p2p communication with compute (interleaved schedule); needs batch_p2p_comm off."""

    batch_p2p_comm: bool = True
    """Group pipeline sends/receives with batch_isend_irecv."""

    batch_p2p_sync: bool = True
    """Synchronise the device after batch_isend_irecv (works around old PyTorch bugs)."""

    use_ring_exchange_p2p: bool = False
    """Use a custom ring_exchange kernel for pipeline communication (needs a custom PyTorch build)."""

    deallocate_pipeline_outputs: bool = False
    """Free a stage's output data once it has been sent to the next stage (keeps only the grad_fn)."""

    defer_embedding_wgrad_compute: bool = False
    """Defer the output-layer weight-grad GEMMs to the pipeline flush; needs PP > 1 and grad accumulation fusion."""

    wgrad_deferral_limit: int = 0
    """Number of microbatches whose embedding weight grads are deferred; 0 means all."""

    pipeline_model_parallel_split_rank: Optional[int] = None
    """Deprecated encoder/decoder pipeline split rank; ignored when None."""

    overlap_p2p_comm_warmup_flush: bool = False
    """Overlap p2p communication also in warm-up and flush; needs overlap_p2p_comm and no batch_p2p_comm."""

    microbatch_group_size_per_vp_stage: Optional[int] = None
    """Microbatches run together per virtual stage in the interleaved schedule; None means PP size."""

    # CPU offloading
    cpu_offloading: bool = False
    """Offload activations and/or weights to CPU between forward and backward."""

    cpu_offloading_num_layers: int = 0
    """Number of transformer layers whose activations/weights are offloaded."""

    _cpu_offloading_context: Optional[ContextManager] = None
    """Internal: the offloading context shared by the layers (set at runtime)."""

    cpu_offloading_activations: bool = True
    """Offload activations when cpu_offloading is on."""

    cpu_offloading_weights: bool = True
    """Offload weights when cpu_offloading is on."""

    # Timing
    barrier_with_L1_time: bool = True
    """Put a barrier before level-1 timers (all ranks must call the same timers)."""

    def __post_init__(self):
        """Derive defaulted fields, then raise one ValueError listing every violated rule."""
        errors = self._parallel_config_errors()
        if errors:
            raise ValueError("Invalid ModelParallelConfig:\n  - " + "\n  - ".join(errors))
        if self.autocast_dtype is None:
            self.autocast_dtype = self.params_dtype
        if self.expert_tensor_parallel_size is None:
            self.expert_tensor_parallel_size = self.tensor_model_parallel_size
        if self.microbatch_group_size_per_vp_stage is None:
            self.microbatch_group_size_per_vp_stage = self.pipeline_model_parallel_size

    def _parallel_config_errors(self) -> List[str]:
        errors = []
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        if self.sequence_parallel and tp <= 1:
            errors.append(
                f"sequence_parallel=True needs tensor_model_parallel_size > 1 (got {tp}): "
                "set sequence_parallel=False or raise the TP size."
            )
        if pp > 1 and self.pipeline_dtype is None:
            errors.append(
                f"pipeline_model_parallel_size={pp} needs pipeline_dtype (got None): "
                "set pipeline_dtype, usually to params_dtype."
            )
        if self.expert_model_parallel_size > 1 and tp > 1 and not self.sequence_parallel:
            errors.append(
                f"expert_model_parallel_size={self.expert_model_parallel_size} with "
                f"tensor_model_parallel_size={tp} needs sequence_parallel=True: turn on sequence parallelism."
            )
        if self.defer_embedding_wgrad_compute:
            if pp == 1:
                errors.append(
                    "defer_embedding_wgrad_compute=True needs pipeline_model_parallel_size > 1 "
                    f"(got {pp}): turn it off or use pipeline parallelism."
                )
            if not self.gradient_accumulation_fusion:
                errors.append(
                    "defer_embedding_wgrad_compute=True needs gradient_accumulation_fusion=True: "
                    "turn on gradient accumulation fusion or turn deferral off."
                )
            if self.wgrad_deferral_limit < 0:
                errors.append(
                    f"wgrad_deferral_limit ({self.wgrad_deferral_limit}) must be >= 0: use 0 to defer all microbatches."
                )
        if self.overlap_p2p_comm_warmup_flush and (not self.overlap_p2p_comm or self.batch_p2p_comm):
            errors.append(
                "overlap_p2p_comm_warmup_flush=True needs overlap_p2p_comm=True and batch_p2p_comm=False "
                f"(got overlap_p2p_comm={self.overlap_p2p_comm}, batch_p2p_comm={self.batch_p2p_comm})."
            )
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                     "expert_model_parallel_size"):
            if getattr(self, name) < 1:
                errors.append(f"{name} ({getattr(self, name)}) must be >= 1.")
        return errors
