"""The architecture facts a conversion needs, read from Megatron args or a HuggingFace config.json.

Megatron side: the `args` of a checkpoint (a plain dict as this project writes it, or the
`argparse.Namespace` Megatron-LM pickles). HF side: Llama / Mistral / Qwen2 / Qwen3 and GPT-2 configs.
"""
import argparse
import math
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional

from tools.checkpoint.hf_mapping_moe import moe_fields_from_hf_config, moe_hf_config, moe_megatron_args

LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe")


@dataclass
class ModelDescription:
    """A GPT-style decoder as both Megatron and HF describe it."""

    num_layers: int
    """Number of transformer layers."""
    hidden_size: int
    """Model width h."""
    ffn_hidden_size: int
    """MLP width (per gate/up half for SwiGLU)."""
    num_attention_heads: int
    """Query heads."""
    num_query_groups: int
    """Key/value heads (== num_attention_heads without GQA)."""
    kv_channels: int
    """Head dim hn."""
    vocab_size: int
    """Rows of the stored embedding (Megatron's padded vocab)."""
    max_position_embeddings: int
    """Longest sequence (size of the learned position table)."""
    normalization: str = "LayerNorm"
    """"LayerNorm" or "RMSNorm"."""
    norm_epsilon: float = 1e-5
    """Epsilon of every norm."""
    swiglu: bool = False
    """Gated SiLU MLP; fc1 holds [gate; up]."""
    add_bias_linear: bool = True
    """Biases on every linear layer."""
    add_qkv_bias: bool = False
    """Bias on the QKV projection only (Qwen2)."""
    qk_layernorm: bool = False
    """Norms on per-head queries and keys (Qwen3)."""
    position_embedding_type: str = "learned_absolute"
    """"learned_absolute" or "rope"."""
    rotary_base: float = 10000.0
    """RoPE theta."""
    tie_embeddings: bool = True
    """Output layer shares the word embedding."""
    activation: str = "gelu"
    """"gelu" (exact), "gelu_tanh" (--openai-gelu) or "silu" (SwiGLU)."""
    true_vocab_size: Optional[int] = None
    """Tokenizer vocab before padding (HF vocab_size); None: same as vocab_size."""
    params_dtype: str = "float32"
    """dtype name of the weights."""
    rope_scaling: Optional[dict] = None
    """HF rope_scaling dict (Llama 3 style) or None."""
    num_experts: Optional[int] = None
    """Routed experts per MoE layer (None: dense model)."""
    moe_router_topk: int = 2
    """Experts per token."""
    moe_ffn_hidden_size: Optional[int] = None
    """MLP width of one expert (per gate/up half)."""
    moe_router_pre_softmax: bool = False
    """Softmax over all experts before the top k (no renormalization; Qwen3-MoE without norm_topk_prob)."""
    moe_layer_freq: Optional[List[int]] = None
    """1 (MoE) / 0 (dense) per layer; None: every layer is MoE."""

    @property
    def qkv_has_bias(self) -> bool:
        """Whether linear_qkv has a bias."""
        return self.add_bias_linear or self.add_qkv_bias


def _get(args: Any, name: str, default=None):
    if isinstance(args, argparse.Namespace):
        args = vars(args)
    value = args.get(name, default)
    return default if value is None else value


def _dtype_name(args) -> str:
    if _get(args, "bf16", False):
        return "bfloat16"
    if _get(args, "fp16", False):
        return "float16"
    return str(_get(args, "params_dtype", "float32")).replace("torch.", "")


def from_megatron_args(args: Any) -> ModelDescription:
    """Describe the model of a checkpoint's args (plain dict or Namespace)."""
    hidden = int(_get(args, "hidden_size"))
    heads = int(_get(args, "num_attention_heads"))
    swiglu = bool(_get(args, "swiglu", False))
    ffn = _get(args, "ffn_hidden_size")
    if ffn is None:
        ffn = int((4 * hidden * 2 / 3) / 64) * 64 if swiglu else 4 * hidden
    groups = int(_get(args, "num_query_groups", heads)) if _get(args, "group_query_attention", False) else heads
    activation = "silu" if swiglu else ("gelu_tanh" if _get(args, "openai_gelu", False) else "gelu")
    problems = []
    if _get(args, "squared_relu", False):
        problems.append("--squared-relu has no HF equivalent here")
    if _get(args, "apply_layernorm_1p", False):
        problems.append("--apply-layernorm-1p is not supported by the converter")
    if float(_get(args, "rotary_percent", 1.0)) != 1.0:
        problems.append(f"--rotary-percent {_get(args, 'rotary_percent')} (only 1.0 is supported)")
    moe = _moe_fields_from_args(args, problems)
    if problems:
        raise ValueError("cannot convert this checkpoint: " + "; ".join(problems))
    rope_scaling = None
    if _get(args, "use_rope_scaling", False):
        rope_scaling = {"rope_type": "llama3", "factor": float(_get(args, "rope_scaling_factor", 8.0)),
                        "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    return ModelDescription(
        num_layers=int(_get(args, "num_layers")), hidden_size=hidden, ffn_hidden_size=int(ffn),
        num_attention_heads=heads, num_query_groups=groups,
        kv_channels=int(_get(args, "kv_channels", hidden // heads)),
        vocab_size=int(_get(args, "padded_vocab_size", _get(args, "vocab_size", 0))),
        max_position_embeddings=int(_get(args, "max_position_embeddings", _get(args, "seq_length", 0))),
        normalization=str(_get(args, "normalization", "LayerNorm")), norm_epsilon=float(_get(args, "norm_epsilon", 1e-5)),
        swiglu=swiglu, add_bias_linear=bool(_get(args, "add_bias_linear", True)),
        add_qkv_bias=bool(_get(args, "add_qkv_bias", False)), qk_layernorm=bool(_get(args, "qk_layernorm", False)),
        position_embedding_type=str(_get(args, "position_embedding_type", "learned_absolute")),
        rotary_base=float(_get(args, "rotary_base", 10000)),
        tie_embeddings=not bool(_get(args, "untie_embeddings_and_output_weights", False)),
        activation=activation, true_vocab_size=_get(args, "true_vocab_size"), params_dtype=_dtype_name(args),
        rope_scaling=rope_scaling, **moe,
    )


def _moe_fields_from_args(args: Any, problems: List[str]) -> Dict[str, Any]:
    """ModelDescription MoE fields of Megatron args; what the converter cannot express goes to `problems`."""
    experts = int(_get(args, "num_experts", 0) or 0)
    if experts == 0:
        return {}
    for name, flag in (("moe_shared_expert_intermediate_size", "--moe-shared-expert-intermediate-size"),
                       ("moe_router_num_groups", "--moe-router-num-groups")):
        if _get(args, name):
            problems.append(f"{flag} has no Mixtral / Qwen3-MoE equivalent here")
    if _get(args, "moe_router_score_function", "softmax") != "softmax":
        problems.append("--moe-router-score-function sigmoid has no Mixtral / Qwen3-MoE equivalent")
    if _get(args, "moe_grouped_gemm", False):
        problems.append("--moe-grouped-gemm checkpoints: convert from torch_dist (SequentialMLP keys) instead")
    freq = _get(args, "moe_layer_freq", 1)
    layers = int(_get(args, "num_layers"))
    pattern = [int(i % freq == 0) for i in range(layers)] if isinstance(freq, int) else [int(f) for f in freq]
    return {"num_experts": experts, "moe_router_topk": int(_get(args, "moe_router_topk", 2)),
            "moe_ffn_hidden_size": int(_get(args, "moe_ffn_hidden_size", _get(args, "ffn_hidden_size"))),
            "moe_router_pre_softmax": bool(_get(args, "moe_router_pre_softmax", False)),
            "moe_layer_freq": None if all(pattern) else pattern}


def to_megatron_args(desc: ModelDescription, tp: int = 1, pp: int = 1, iteration: int = 0) -> Dict[str, Any]:
    """Plain-data Megatron args (flag dests) describing `desc`, as this project stores them."""
    gqa = desc.num_query_groups != desc.num_attention_heads
    return {
        "num_layers": desc.num_layers, "hidden_size": desc.hidden_size, "ffn_hidden_size": desc.ffn_hidden_size,
        "num_attention_heads": desc.num_attention_heads, "group_query_attention": gqa,
        "num_query_groups": desc.num_query_groups if gqa else None, "kv_channels": desc.kv_channels,
        "padded_vocab_size": desc.vocab_size, "vocab_size": desc.true_vocab_size,
        "max_position_embeddings": desc.max_position_embeddings, "seq_length": desc.max_position_embeddings,
        "normalization": desc.normalization, "norm_epsilon": desc.norm_epsilon, "swiglu": desc.swiglu,
        "add_bias_linear": desc.add_bias_linear, "add_qkv_bias": desc.add_qkv_bias,
        "qk_layernorm": desc.qk_layernorm, "position_embedding_type": desc.position_embedding_type,
        "rotary_base": int(desc.rotary_base) if float(desc.rotary_base).is_integer() else desc.rotary_base,
        "rotary_percent": 1.0, "untie_embeddings_and_output_weights": not desc.tie_embeddings,
        "openai_gelu": desc.activation == "gelu_tanh", "bf16": desc.params_dtype == "bfloat16",
        "fp16": desc.params_dtype == "float16", "params_dtype": f"torch.{desc.params_dtype}",
        "use_rope_scaling": desc.rope_scaling is not None,
        "rope_scaling_factor": (desc.rope_scaling or {}).get("factor", 8.0),
        "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp, "iteration": iteration,
        "transformer_impl": "local", "consumed_train_samples": 0, "consumed_valid_samples": 0,
        **moe_megatron_args(desc),
    }


def hf_architecture(desc: ModelDescription) -> str:
    """The transformers class that represents `desc`; ValueError listing what does not fit."""
    if desc.position_embedding_type == "learned_absolute":
        problems = [msg for bad, msg in (
            (desc.normalization != "LayerNorm", f"normalization {desc.normalization} (GPT-2 uses LayerNorm)"),
            (desc.swiglu, "SwiGLU (GPT-2 has a plain MLP)"),
            (not desc.add_bias_linear, "no linear biases (GPT-2 has biases)"),
            (desc.num_query_groups != desc.num_attention_heads, "grouped-query attention"),
            (desc.kv_channels * desc.num_attention_heads != desc.hidden_size, "kv_channels*heads != hidden"),
            (desc.qk_layernorm, "qk layernorm"),
        ) if bad]
        if problems:
            raise ValueError("a learned-position model exports as GPT-2, which does not support: " + "; ".join(problems))
        return "GPT2LMHeadModel"
    problems = [msg for bad, msg in (
        (desc.position_embedding_type != "rope", f"position embedding {desc.position_embedding_type}"),
        (desc.normalization != "RMSNorm", f"normalization {desc.normalization} (Llama-style models use RMSNorm)"),
        (not desc.swiglu, "a non-gated MLP (Llama-style models use SwiGLU)"),
    ) if bad]
    if problems:
        raise ValueError("cannot export as a Llama-style model: " + "; ".join(problems))
    if desc.num_experts:
        if desc.qk_layernorm:
            return "Qwen3MoeForCausalLM"
        if desc.moe_layer_freq is not None or desc.qkv_has_bias or desc.moe_ffn_hidden_size != desc.ffn_hidden_size:
            raise ValueError("an MoE model without qk layernorm exports as Mixtral, which has MoE in every layer, no "
                             "linear biases and --moe-ffn-hidden-size == --ffn-hidden-size")
        return "MixtralForCausalLM"
    if desc.qk_layernorm:
        return "Qwen3ForCausalLM"
    if desc.add_qkv_bias and not desc.add_bias_linear:
        return "Qwen2ForCausalLM"
    return "LlamaForCausalLM"


_MODEL_TYPES = {"GPT2LMHeadModel": "gpt2", "LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                "Qwen3ForCausalLM": "qwen3", "MixtralForCausalLM": "mixtral", "Qwen3MoeForCausalLM": "qwen3_moe"}


def to_hf_config(desc: ModelDescription) -> Dict[str, Any]:
    """config.json content for `desc`."""
    arch = hf_architecture(desc)
    vocab = desc.true_vocab_size or desc.vocab_size
    common = {"architectures": [arch], "model_type": _MODEL_TYPES[arch], "vocab_size": vocab,
              "tie_word_embeddings": desc.tie_embeddings, "torch_dtype": desc.params_dtype,
              "dtype": desc.params_dtype}
    if arch == "GPT2LMHeadModel":
        return {**common, "n_embd": desc.hidden_size, "n_layer": desc.num_layers, "n_head": desc.num_attention_heads,
                "n_inner": desc.ffn_hidden_size, "n_positions": desc.max_position_embeddings,
                "layer_norm_epsilon": desc.norm_epsilon,
                "activation_function": "gelu_new" if desc.activation == "gelu_tanh" else "gelu",
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    config = {**common, "hidden_size": desc.hidden_size, "intermediate_size": desc.ffn_hidden_size,
              "num_hidden_layers": desc.num_layers, "num_attention_heads": desc.num_attention_heads,
              "num_key_value_heads": desc.num_query_groups, "head_dim": desc.kv_channels,
              "max_position_embeddings": desc.max_position_embeddings, "rms_norm_eps": desc.norm_epsilon,
              "rope_theta": desc.rotary_base, "hidden_act": "silu", "attention_dropout": 0.0,
              "rope_scaling": desc.rope_scaling}
    if arch == "LlamaForCausalLM":
        config.update(attention_bias=desc.add_bias_linear, mlp_bias=desc.add_bias_linear)
    if arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        config.update(attention_bias=desc.qkv_has_bias)
    config.update(moe_hf_config(desc) if desc.num_experts else {})
    return config


def _pad_vocab(vocab: int, divisible_by: int, tp: int) -> int:
    multiple = divisible_by * tp
    return int(math.ceil(vocab / multiple) * multiple)


def from_hf_config(config: Dict[str, Any], make_vocab_size_divisible_by: Optional[int] = None,
                   tp: int = 1) -> ModelDescription:
    """Describe an HF config.json; the Megatron vocab is padded only when `make_vocab_size_divisible_by`."""
    model_type = config.get("model_type")
    vocab = int(config["vocab_size"])
    padded = _pad_vocab(vocab, make_vocab_size_divisible_by, tp) if make_vocab_size_divisible_by else vocab
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    tie = bool(config.get("tie_word_embeddings", model_type == "gpt2"))
    if model_type == "gpt2":
        h, heads = int(config["n_embd"]), int(config["n_head"])
        act = config.get("activation_function", "gelu_new")
        if act not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"GPT-2 activation_function {act!r} is not supported (gelu, gelu_new)")
        return ModelDescription(
            num_layers=int(config["n_layer"]), hidden_size=h, ffn_hidden_size=int(config.get("n_inner") or 4 * h),
            num_attention_heads=heads, num_query_groups=heads, kv_channels=h // heads, vocab_size=padded,
            max_position_embeddings=int(config["n_positions"]), normalization="LayerNorm",
            norm_epsilon=float(config.get("layer_norm_epsilon", 1e-5)), tie_embeddings=tie,
            activation="gelu" if act == "gelu" else "gelu_tanh", true_vocab_size=vocab, params_dtype=dtype)
    if model_type not in LLAMA_FAMILY:
        raise ValueError(f"config.json model_type {model_type!r} is not supported; choose one of gpt2, "
                         f"{', '.join(LLAMA_FAMILY)}")
    h, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    bias = bool(config.get("attention_bias", False))
    rope_theta = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    return ModelDescription(
        num_layers=int(config["num_hidden_layers"]), hidden_size=h, ffn_hidden_size=int(config["intermediate_size"]),
        num_attention_heads=heads, num_query_groups=int(config.get("num_key_value_heads") or heads),
        kv_channels=int(config.get("head_dim") or h // heads), vocab_size=padded,
        max_position_embeddings=int(config["max_position_embeddings"]), normalization="RMSNorm",
        norm_epsilon=float(config.get("rms_norm_eps", 1e-6)), swiglu=True,
        add_bias_linear=bias and model_type == "llama", add_qkv_bias=(model_type == "qwen2") or bias,
        qk_layernorm=model_type in ("qwen3", "qwen3_moe"), position_embedding_type="rope", rotary_base=float(rope_theta),
        tie_embeddings=tie, activation="silu", true_vocab_size=vocab, params_dtype=dtype,
        rope_scaling=config.get("rope_scaling"),
        **(moe_fields_from_hf_config(config) if model_type in ("mixtral", "qwen3_moe") else {}))


def describe(desc: ModelDescription) -> List[str]:
    """One line per field (for logs)."""
    return [f"{k} = {v}" for k, v in asdict(desc).items()]
