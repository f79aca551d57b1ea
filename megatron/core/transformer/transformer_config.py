"""`TransformerConfig`: every knob of the transformer stack (Megatron Core 0.13.1 fields and defaults).

`__post_init__` derives the defaults Megatron derives and collects every violated rule into one
ValueError. Unlike Megatron, fusion toggles (`apply_rope_fusion`, `persist_layer_norm`,
`masked_softmax_fusion`, `bias_*_fusion`, `gradient_accumulation_fusion`, `memory_efficient_layer_norm`)
never fail for a missing Transformer Engine or Apex: the native implementations honour or ignore them.
"""
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.transformer.moe.config_rules import derive_moe_defaults, moe_config_problems
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
from megatron.core.utils import init_method_normal, scaled_init_method_normal

ALLOWED_RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")


@dataclass
class TransformerConfig(ModelParallelConfig):
    """Configuration of a Megatron Core transformer (model shape, numerics, fusions, recompute, MoE)."""

    num_layers: int = 0
    """Number of transformer layers in the block."""

    mtp_num_layers: Optional[int] = None
    """Number of multi-token-prediction layers (None: no MTP)."""

    mtp_loss_scaling_factor: Optional[float] = 0.1
    """Weight of the averaged MTP loss in the training objective."""

    num_layers_in_first_pipeline_stage: Optional[int] = None
    """Layers on the first pipeline stage (None: even split)."""

    num_layers_in_last_pipeline_stage: Optional[int] = None
    """Layers on the last pipeline stage (None: even split)."""

    pipeline_model_parallel_layout: Optional[Union[str, list, PipelineParallelLayerLayout]] = None
    """Explicit placement of layers on (virtual) pipeline stages, e.g. 'E|(t|)*3,m|m||L'."""

    account_for_embedding_in_pipeline_split: bool = False
    """Count the embedding as one layer when splitting layers over pipeline stages."""

    account_for_loss_in_pipeline_split: bool = False
    """Count the loss/output layer as one layer when splitting layers over pipeline stages."""

    hidden_size: int = 0
    """Transformer hidden size."""

    num_attention_heads: int = 0
    """Number of attention heads."""

    attention_backend: AttnBackend = AttnBackend.auto
    """Attention kernel choice; the native path always uses torch scaled_dot_product_attention."""

    softmax_scale: Optional[float] = None
    """Scale applied to QK^T (None: 1/sqrt(kv_channels))."""

    num_query_groups: Optional[int] = None
    """Number of key/value groups for grouped-query attention (None: num_attention_heads)."""

    ffn_hidden_size: Optional[int] = None
    """MLP hidden size (None: 4 * hidden_size)."""

    kv_channels: Optional[int] = None
    """Per-head dimension (None: hidden_size // num_attention_heads)."""

    hidden_dropout: float = 0.1
    """Dropout probability on the residual branches."""

    attention_dropout: float = 0.1
    """Dropout probability on the attention probabilities."""

    fp32_residual_connection: bool = False
    """Keep the residual stream in fp32."""

    apply_residual_connection_post_layernorm: bool = False
    """Take the residual after the layernorm (original BERT ordering)."""

    layernorm_epsilon: float = 1e-5
    """Epsilon of every LayerNorm/RMSNorm."""

    layernorm_zero_centered_gamma: bool = False
    """Store norm weights zero-centred and apply them as (1 + weight) (`--apply-layernorm-1p`)."""

    add_bias_linear: bool = True
    """Give every linear layer a bias."""

    add_qkv_bias: bool = False
    """Give only the QKV projection a bias."""

    gated_linear_unit: bool = False
    """Use a gated linear unit in the MLP (SwiGLU when the activation is silu)."""

    activation_func: Callable = F.gelu
    """MLP activation function."""

    activation_func_fp8_input_store: bool = False
    """Store the activation input in fp8 for the backward pass (Transformer Engine only)."""

    num_moe_experts: Optional[int] = None
    """Number of MoE experts (None: dense MLP)."""

    rotary_interleaved: bool = False
    """Rotate interleaved (even, odd) pairs instead of the first and second halves of each head."""

    window_size: Optional[Tuple[int, int]] = None
    """Sliding-window attention size (left, right); -1 means unbounded."""

    normalization: str = "LayerNorm"
    """Norm type: 'LayerNorm' or 'RMSNorm'."""

    qk_layernorm: bool = False
    """Apply the normalization to queries and keys per head."""

    qk_l2_norm: bool = False
    """Apply Llama-4 style L2 normalization to queries and keys."""

    test_mode: bool = False
    """Run real-time self-tests (Megatron internal)."""

    calculate_per_token_loss: bool = False
    """Normalise the loss by the number of non-padded tokens of the global batch."""

    multi_latent_attention: bool = False
    """Use multi-latent attention (MLA)."""

    no_rope_freq: Optional[Union[int, List[int]]] = None
    """Layers that skip RoPE: every N-th layer (int) or an explicit 0/1 pattern (list)."""

    init_method: Optional[Callable] = None
    """Init of every weight except output projections (None: N(0, init_method_std))."""

    output_layer_init_method: Optional[Callable] = None
    """Init of output projections (None: N(0, init_method_std / sqrt(2 * num_layers)))."""

    init_method_std: float = 0.02
    """Standard deviation of the default normal init."""

    init_model_with_meta_device: bool = False
    """Create parameters on the meta device (for FSDP initialization)."""

    apply_query_key_layer_scaling: bool = False
    """Scale QK^T by 1/layer_number and the softmax input back (forces softmax in fp32)."""

    attention_softmax_in_fp32: bool = True
    """Compute the attention softmax in fp32."""

    disable_bf16_reduced_precision_matmul: bool = False
    """Disable cuBLAS reduced-precision reductions in bf16 matmuls."""

    bias_activation_fusion: bool = False
    """Fuse bias add and activation (native fused function here)."""

    masked_softmax_fusion: bool = False
    """Fuse scale, mask and softmax (SDPA does this natively)."""

    persist_layer_norm: bool = False
    """Use Apex's persistent layernorm kernel (ignored by the native norms)."""

    memory_efficient_layer_norm: bool = False
    """Use Apex's memory-efficient layernorm (ignored by the native norms)."""

    bias_dropout_fusion: bool = False
    """Fuse bias add, dropout and residual add."""

    apply_rope_fusion: bool = False
    """Use a fused RoPE kernel (the native RoPE is used either way)."""

    recompute_granularity: Optional[str] = None
    """Activation recompute: 'full' (whole layers) or 'selective' (parts of layers)."""

    recompute_method: Optional[str] = None
    """Full recompute placement: 'uniform' (chunks) or 'block' (first N layers of a stage)."""

    recompute_num_layers: Optional[int] = None
    """Chunk size ('uniform') or number of recomputed layers per stage ('block')."""

    distribute_saved_activations: Optional[bool] = None
    """Split the saved recompute inputs across tensor-parallel ranks."""

    recompute_modules: Optional[List[str]] = None
    """Modules recomputed with 'selective' granularity (None: ['core_attn'])."""

    fp8: Optional[str] = None
    """FP8 format: 'e4m3' or 'hybrid' (None: no FP8)."""

    fp8_recipe: Optional[str] = "delayed"
    """FP8 scaling recipe: 'delayed', 'tensorwise', 'mxfp8' or 'blockwise'."""

    fp8_param: bool = False
    """Keep parameters in fp8."""

    fp8_margin: int = 0
    """Margin of the FP8 scaling factor."""

    fp8_interval: int = 1
    """Deprecated FP8 scaling-update interval."""

    fp8_amax_history_len: int = 1
    """Length of the amax history window."""

    fp8_amax_compute_algo: str = "most_recent"
    """How amax is chosen from its history: 'max' or 'most_recent'."""

    fp8_wgrad: bool = True
    """Compute weight gradients in fp8."""

    fp8_dot_product_attention: bool = False
    """Run dot-product attention in fp8."""

    fp8_multi_head_attention: bool = False
    """Run multi-head-attention projections in fp8."""

    tp_only_amax_red: bool = False
    """Reduce FP8 amax over the tensor-parallel group only (Transformer Engine's modules; False: over tensor x
    data parallel). The native FP8 linears (`megatron.core.fp8`) always reduce over the tensor-parallel
    group only, for the operands split over it: each data-parallel rank scales by its own amaxes."""

    first_last_layers_bf16: bool = False
    """Keep the first and last layers in bf16 under FP8."""

    num_layers_at_start_in_bf16: int = 1
    """Layers at the start kept in bf16 with first_last_layers_bf16."""

    num_layers_at_end_in_bf16: int = 1
    """Layers at the end kept in bf16 with first_last_layers_bf16."""

    use_kitchen: bool = False
    """Use the nvidia_kitchen quantization extension."""

    moe_shared_expert_intermediate_size: Optional[int] = None
    """Hidden size of the shared experts (None: no shared expert)."""

    moe_shared_expert_overlap: bool = False
    """Overlap the shared experts' compute with the alltoall dispatcher's communication."""

    moe_layer_freq: Union[int, List[int]] = 1
    """Which layers are MoE: an int N makes layers 0, N, 2N, ... MoE; a list gives 1 (MoE) or 0 per layer."""

    moe_ffn_hidden_size: Optional[int] = None
    """Hidden size of each routed expert (None: ffn_hidden_size)."""

    moe_router_load_balancing_type: str = "aux_loss"
    """Router load balancing: 'aux_loss', 'seq_aux_loss', 'sinkhorn' or 'none'."""

    moe_router_topk: int = 2
    """Experts each token is routed to."""

    moe_router_topk_limited_devices: Optional[int] = None
    """Deprecated: becomes moe_router_group_topk, with moe_router_num_groups = expert_model_parallel_size."""

    moe_router_padding_for_fp8: Optional[bool] = False
    """Pad routing maps so expert inputs align for FP8."""

    moe_router_num_groups: Optional[int] = None
    """Number of expert groups for group-limited routing."""

    moe_router_group_topk: Optional[int] = None
    """Groups selected per token in group-limited routing."""

    moe_router_pre_softmax: bool = False
    """Apply softmax before top-k selection."""

    moe_router_topk_scaling_factor: Optional[float] = None
    """Scale applied to the top-k routing probabilities."""

    moe_router_score_function: str = "softmax"
    """Router score function: 'softmax' or 'sigmoid'."""

    moe_router_dtype: Optional[str] = None
    """Router compute dtype: 'fp32' or 'fp64' (None: input dtype)."""

    moe_router_enable_expert_bias: bool = False
    """Use a dynamic per-expert bias (aux-loss-free balancing)."""

    moe_router_bias_update_rate: float = 1e-3
    """Update rate of the per-expert bias."""

    moe_router_force_load_balancing: bool = False
    """Force uniform routing (benchmarking only)."""

    moe_grouped_gemm: bool = False
    """Run the local experts as one grouped GEMM."""

    moe_use_legacy_grouped_gemm: bool = False
    """With the Transformer Engine spec, use GroupedMLP instead of TEGroupedMLP (GroupedMLP is built either way
    here)."""

    moe_aux_loss_coeff: float = 0.0
    """Coefficient of the load-balancing auxiliary loss."""

    moe_z_loss_coeff: Optional[float] = None
    """Coefficient of the router z-loss (None: no z-loss)."""

    moe_input_jitter_eps: Optional[float] = None
    """Multiplicative U(1 - eps, 1 + eps) jitter on the router input (None: off)."""

    moe_token_dropping: bool = False
    """Deprecated token dropping switch."""

    moe_token_dispatcher_type: str = "allgather"
    """Token dispatcher: 'allgather', 'alltoall' or 'flex'."""

    moe_enable_deepep: bool = False
    """Use DeepEP in the flex dispatcher."""

    moe_per_layer_logging: bool = False
    """Log MoE auxiliary losses per layer."""

    moe_expert_capacity_factor: Optional[float] = None
    """Expert capacity factor: each expert takes at most ceil(T * k / E * factor) tokens (None or negative:
    dropless)."""

    moe_pad_expert_input_to_capacity: bool = False
    """Pad each expert's input to its capacity."""

    moe_token_drop_policy: str = "probs"
    """Which tokens to drop at capacity: 'probs' or 'position'."""

    moe_layer_recompute: bool = False
    """Recompute MoE layers (deprecated: use recompute_modules=['moe'])."""

    moe_permute_fusion: bool = False
    """Use Transformer Engine's fused permutation (the native permutation, same result, is used here)."""

    moe_apply_probs_on_input: bool = False
    """Multiply routing probabilities into expert inputs instead of outputs."""

    moe_deepep_num_sms: int = 20
    """SMs used by DeepEP."""

    cp_comm_type: Optional[Union[str, List[str]]] = None
    """Context-parallel communication: 'p2p', 'all_gather', 'a2a' or 'a2a+p2p' (per layer if a list)."""

    enable_cuda_graph: bool = False
    """Capture layers into CUDA graphs."""

    cuda_graph_use_single_mempool: bool = False
    """Share one memory pool among CUDA graphs."""

    cuda_graph_retain_backward_graph: bool = False
    """Retain the backward graph of CUDA graphs."""

    cuda_graph_warmup_steps: int = 3
    """Warm-up steps before CUDA graph capture."""

    external_cuda_graph: bool = False
    """CUDA graphs are captured outside the model (by the training loop)."""

    cuda_graph_scope: str = "full"
    """What a CUDA graph covers: 'full' or 'attn'."""

    # The next three are this framework's flags (no Megatron-LM counterpart). Like FP8 and CUDA graphs they are
    # decisions of the optimisation plan (`megatron.core.optimization_plan`): resolved once, printed at
    # start-up, applied to the built model; modules never read them.
    compile_layers: str = "auto"
    """`--compile-layers`: `torch.compile` each transformer layer: 'on', 'off' or 'auto' (on for layers on a
    CUDA device with hidden size >= 2048, without tensor + sequence parallelism or selective recompute)."""

    compile_linears: str = "auto"
    """`--compile-linears`: inside compiled layers, trace the tensor-parallel linears into the layer's graph
    ('on') or call them eagerly ('off'); 'auto' is off (the measurements are in the plan's notes)."""

    fusion_kernels: str = "auto"
    """`--fusion-kernels`: the fused elementwise functions on CUDA tensors run `torch.compile`d and as Triton
    kernels ('compiled') or as their plain PyTorch reference ('eager'); 'auto' is compiled on CUDA."""

    clone_scatter_output_in_embedding: bool = True
    """Clone the embedding output after the sequence-parallel scatter (frees the full tensor)."""

    disable_parameter_transpose_cache: bool = False
    """Do not cache transposed fp8 weights (Transformer Engine)."""

    config_logger_dir: str = ""
    """Directory where module configs are logged (empty: off)."""

    flash_decode: bool = False
    """Use flash decoding at inference."""

    use_te_activation_func: bool = False
    """Use Transformer Engine's activation functions."""

    inference_rng_tracker: bool = False
    """Use a separate RNG tracker for inference."""

    mrope_section: Optional[List[int]] = None
    """Multimodal RoPE sections (temporal, height, width)."""

    is_hybrid_model: bool = False
    """The model mixes Mamba and attention layers."""

    mamba_state_dim: int = 128
    """Mamba state dimension."""

    mamba_head_dim: int = 64
    """Mamba head dimension."""

    mamba_num_groups: int = 8
    """Mamba number of groups."""

    mamba_num_heads: Optional[int] = None
    """Mamba number of heads (None: derived)."""

    use_mamba_mem_eff_path: bool = True
    """Use Mamba's memory-efficient fused path."""

    mlp_chunks_for_prefill: int = 1
    """Chunks the MLP is split into during inference prefill."""

    heterogeneous_block_specs: bool = False
    """Layers have heterogeneous specs."""

    hetereogenous_dist_checkpoint: bool = False
    """Distributed checkpoint of a heterogeneous model (Megatron's spelling)."""

    quant_recipe: Optional[object] = None
    """Quantization recipe (nvidia_kitchen)."""

    symmetric_ar_type: Optional[str] = None
    """Symmetric-memory all-reduce type: 'two_shot', 'one_shot', 'multimem_all_reduce'."""

    def __post_init__(self):
        super().__post_init__()
        self._derive_defaults()
        problems = (
            self._shape_problems()
            + self._recompute_problems()
            + self._fusion_problems()
            + self._pipeline_split_problems()
            + self._moe_problems()
        )
        if problems:
            raise ValueError("invalid TransformerConfig:\n  " + "\n  ".join(problems))
        self._derive_init_methods()

    def _derive_defaults(self):
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.kv_channels is None and self.num_attention_heads:
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.recompute_modules is None:
            self.recompute_modules = ["core_attn"]
        if self.apply_query_key_layer_scaling:
            self.attention_softmax_in_fp32 = True
        if self.moe_ffn_hidden_size is None and self.num_moe_experts is not None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        derive_moe_defaults(self)
        if isinstance(self.pipeline_model_parallel_layout, (str, list)):
            self.pipeline_model_parallel_layout = PipelineParallelLayerLayout.from_str(
                self.pipeline_model_parallel_layout, self.pipeline_model_parallel_size
            )
        layout = self.pipeline_model_parallel_layout
        if layout is not None and self.virtual_pipeline_model_parallel_size is None:
            if layout.virtual_pipeline_model_parallel_size > 1:
                self.virtual_pipeline_model_parallel_size = layout.virtual_pipeline_model_parallel_size

    def _derive_init_methods(self):
        if self.init_method is None:
            self.init_method = init_method_normal(self.init_method_std)
        if self.output_layer_init_method is None:
            multiplier = 1.0 if self.is_hybrid_model else 2.0
            self.output_layer_init_method = scaled_init_method_normal(
                self.init_method_std, max(self.num_layers, 1), multiplier=multiplier
            )

    def _shape_problems(self) -> List[str]:
        problems = []
        tp = self.tensor_model_parallel_size
        if self.fp16 and self.bf16:
            problems.append("fp16 and bf16 are both True: choose one precision.")
        if self.num_attention_heads and self.num_attention_heads % tp != 0:
            problems.append(
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"tensor_model_parallel_size ({tp}): choose a TP size that divides {self.num_attention_heads}."
            )
        if self.num_query_groups and self.num_query_groups % tp != 0:
            problems.append(
                f"num_query_groups ({self.num_query_groups}) must be divisible by "
                f"tensor_model_parallel_size ({tp}): choose a TP size that divides {self.num_query_groups}."
            )
        if self.num_query_groups and self.num_attention_heads % self.num_query_groups != 0:
            problems.append(
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by num_query_groups "
                f"({self.num_query_groups}): each query group serves the same number of heads."
            )
        if self.normalization not in ("LayerNorm", "RMSNorm", "L2Norm"):
            problems.append(
                f"normalization ({self.normalization!r}) must be 'LayerNorm' or 'RMSNorm'."
            )
        if self.expert_model_parallel_size > 1 and self.num_moe_experts is None:
            problems.append(
                f"expert_model_parallel_size ({self.expert_model_parallel_size}) > 1 needs num_moe_experts: "
                "set num_moe_experts or use expert_model_parallel_size=1."
            )
        if self.cpu_offloading and self.pipeline_model_parallel_size > 1:
            problems.append("cpu_offloading is not supported with pipeline parallelism: set one of them off.")
        if self.multi_latent_attention and self.qk_layernorm and self.normalization == "L2Norm":
            problems.append("qk_layernorm with L2Norm is not supported by multi-latent attention.")
        return problems

    def _recompute_problems(self) -> List[str]:
        problems = []
        granularity, method, n = self.recompute_granularity, self.recompute_method, self.recompute_num_layers
        if granularity not in (None, "full", "selective"):
            problems.append(f"recompute_granularity ({granularity!r}) must be None, 'full' or 'selective'.")
        if method not in (None, "uniform", "block"):
            problems.append(f"recompute_method ({method!r}) must be None, 'uniform' or 'block'.")
        if granularity == "full":
            if method is None:
                problems.append(
                    "recompute_granularity='full' needs recompute_method: set 'uniform' or 'block'."
                )
            if n is None:
                problems.append(
                    "recompute_granularity='full' needs recompute_num_layers: set the number of layers "
                    "per recompute chunk ('uniform') or per stage ('block')."
                )
            elif method == "uniform" and not 1 <= n <= max(self.num_layers, 1):
                problems.append(
                    f"recompute_num_layers ({n}) must be between 1 and num_layers ({self.num_layers}) "
                    "with recompute_method='uniform'."
                )
            elif method == "block" and not 0 <= n <= max(self.num_layers // self.pipeline_model_parallel_size, 0):
                problems.append(
                    f"recompute_num_layers ({n}) must be between 0 and the layers per pipeline stage "
                    f"({self.num_layers // self.pipeline_model_parallel_size}) with recompute_method='block'."
                )
        elif method is not None:
            problems.append(
                f"recompute_method ({method!r}) is set but recompute_granularity is {granularity!r}: "
                "recompute_method only applies to recompute_granularity='full'."
            )
        if granularity == "selective" and n is not None:
            problems.append(
                f"recompute_num_layers ({n}) must be None with recompute_granularity='selective'."
            )
        if granularity != "full" and self.distribute_saved_activations:
            problems.append(
                "distribute_saved_activations needs recompute_granularity='full'."
            )
        if self.distribute_saved_activations and self.sequence_parallel:
            problems.append(
                "distribute_saved_activations and sequence_parallel cannot be combined: turn one off."
            )
        unknown = [m for m in self.recompute_modules if m not in ALLOWED_RECOMPUTE_MODULES]
        if unknown:
            problems.append(
                f"recompute_modules has unknown entries {unknown}: allowed are {list(ALLOWED_RECOMPUTE_MODULES)}."
            )
        return problems

    def _fusion_problems(self) -> List[str]:
        problems = []
        if self.bias_activation_fusion:
            if self.activation_func not in (F.gelu, F.silu):
                problems.append(
                    "bias_activation_fusion supports only gelu and silu (SwiGLU) activations: "
                    "turn bias_activation_fusion off for other activations."
                )
            if self.activation_func is F.gelu and not self.add_bias_linear and not self.gated_linear_unit:
                problems.append(
                    "bias_activation_fusion with gelu needs add_bias_linear=True: turn the fusion off "
                    "(--no-bias-gelu-fusion) or keep the linear biases."
                )
            if self.activation_func is F.silu and not self.gated_linear_unit:
                problems.append(
                    "bias_activation_fusion with silu needs gated_linear_unit=True (SwiGLU): "
                    "turn the fusion off (--no-bias-swiglu-fusion) or use --swiglu."
                )
        if self.activation_func_fp8_input_store and (
            self.activation_func is not F.silu or not self.gated_linear_unit
        ):
            problems.append("activation_func_fp8_input_store needs SwiGLU (silu with gated_linear_unit).")
        if self.first_last_layers_bf16 and self.fp8 is None:
            problems.append("first_last_layers_bf16 needs fp8 to be set.")
        return problems

    def _pipeline_split_problems(self) -> List[str]:
        problems = []
        pp = self.pipeline_model_parallel_size
        vpp = self.virtual_pipeline_model_parallel_size
        first, last = self.num_layers_in_first_pipeline_stage, self.num_layers_in_last_pipeline_stage
        layout = self.pipeline_model_parallel_layout
        uneven = first is not None or last is not None
        accounted = self.account_for_embedding_in_pipeline_split or self.account_for_loss_in_pipeline_split
        if layout is not None:
            if uneven or accounted:
                problems.append(
                    "pipeline_model_parallel_layout cannot be combined with num_layers_in_first/last_pipeline_stage "
                    "or account_for_embedding/loss_in_pipeline_split: the layout already places every layer."
                )
            problems.extend(layout.problems(self.num_layers, self.mtp_num_layers, vpp))
            return problems
        if uneven and accounted:
            problems.append(
                "num_layers_in_first/last_pipeline_stage cannot be combined with "
                "account_for_embedding/loss_in_pipeline_split: use one way of uneven splitting."
            )
            return problems
        for name, value in (("num_layers_in_first_pipeline_stage", first), ("num_layers_in_last_pipeline_stage", last)):
            if value is not None and value <= 0:
                problems.append(f"{name} ({value}) must be positive.")
            if value is not None and vpp is not None and value % vpp != 0:
                problems.append(
                    f"{name} ({value}) must be divisible by virtual_pipeline_model_parallel_size ({vpp})."
                )
        if uneven and pp > 1 and not problems:
            middle_stages = pp - (first is not None) - (last is not None)
            middle_layers = self.num_layers - (first or 0) - (last or 0)
            if middle_layers < 0 or (middle_stages == 0 and middle_layers != 0):
                problems.append(
                    f"num_layers ({self.num_layers}) does not fit first/last stage layers ({first}/{last}) "
                    f"on {pp} pipeline stages."
                )
            elif middle_stages > 0 and middle_layers % (middle_stages * (vpp or 1)) != 0:
                problems.append(
                    f"the {middle_layers} layers left for the {middle_stages} middle pipeline stages must be "
                    f"divisible by {middle_stages * (vpp or 1)} (middle stages x virtual stages)."
                )
        elif uneven and pp == 1:
            problems.append(
                "num_layers_in_first/last_pipeline_stage need pipeline_model_parallel_size > 1."
            )
        elif not uneven and pp > 1 and self.num_layers > 0:
            total = self.num_layers + self.account_for_embedding_in_pipeline_split
            total += self.account_for_loss_in_pipeline_split
            if total % (pp * (vpp or 1)) != 0:
                problems.append(
                    f"num_layers ({self.num_layers}, plus embedding/loss if accounted: {total}) must be divisible "
                    f"by pipeline_model_parallel_size x virtual stages ({pp * (vpp or 1)}): change num_layers or "
                    "use num_layers_in_first/last_pipeline_stage."
                )
        return problems

    def _moe_problems(self) -> List[str]:
        problems = []
        if self.moe_shared_expert_overlap and self.moe_shared_expert_intermediate_size is None:
            problems.append("moe_shared_expert_overlap needs moe_shared_expert_intermediate_size.")
        return problems + moe_config_problems(self)


@dataclass
class MLATransformerConfig(TransformerConfig):
    """TransformerConfig of multi-latent-attention models (DeepSeek style), built by `MLASelfAttention`."""

    multi_latent_attention: bool = True
    """Use multi-latent attention."""

    q_lora_rank: Optional[int] = 512
    """Rank of the query low-rank projection (None: full-rank queries)."""

    kv_lora_rank: int = 512
    """Rank of the key/value low-rank projection."""

    qk_head_dim: int = 128
    """Query/key head dimension without the rotary part."""

    qk_pos_emb_head_dim: int = 64
    """Rotary part of the query/key head dimension."""

    v_head_dim: int = 128
    """Value head dimension."""

    normalization: str = "RMSNorm"
    """Norm type (MLA models use RMSNorm)."""

    rope_type: str = "yarn"
    """RoPE variant: 'rope' or 'yarn'."""

    rotary_base: float = 10000
    """RoPE base."""

    rotary_percent: float = 1.0
    """Fraction of the head dimension that is rotated."""

    rotary_scaling_factor: float = 40
    """YaRN scaling factor."""

    original_max_position_embeddings: int = 4096
    """Context length the model was pre-trained with (YaRN)."""

    max_position_embeddings: int = 4096
    """Deprecated alias of original_max_position_embeddings."""

    beta_fast: float = 32
    """YaRN fast beta."""

    beta_slow: float = 1
    """YaRN slow beta."""

    mscale: float = 0.707
    """YaRN mscale."""

    mscale_all_dim: float = 0.707
    """YaRN mscale over all dimensions."""

    def __post_init__(self):
        super().__post_init__()
        problems = []
        if self.rope_type not in ("rope", "yarn"):
            problems.append(f"rope_type ({self.rope_type!r}) must be 'rope' or 'yarn'.")
        if self.rotary_interleaved:
            problems.append("rotary_interleaved is not supported with multi-latent attention (as in Megatron-LM).")
        if self.qk_l2_norm:
            problems.append("qk_l2_norm is not supported with multi-latent attention (as in Megatron-LM).")
        for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                problems.append(f"{name} ({getattr(self, name)}) must be positive.")
        if self.qk_pos_emb_head_dim % 2:
            problems.append(f"qk_pos_emb_head_dim ({self.qk_pos_emb_head_dim}) must be even (RoPE rotates pairs).")
        if problems:
            raise ValueError("invalid MLATransformerConfig:\n  " + "\n  ".join(problems))


__all__ = ["TransformerConfig", "MLATransformerConfig"]
