"""Layer specs of GPT models (Megatron Core's function names and signatures).

The local spec builds native layers with the norms as separate modules (`input_layernorm`,
`pre_mlp_layernorm`, with `sharded_state_dict_keys_map` naming their TE keys). The Transformer Engine
spec fuses the norms into `linear_qkv` / `linear_fc1` as TE does, so its parameter names and order equal
those of Megatron's default TE models. It builds TE's modules (`TESpecProvider`) when
`transformer_engine.pytorch` imports, and otherwise the native modules in the same layout
(`TECompatibleLocalSpecProvider`), saying so in one info line per process: Transformer Engine is never
required, and the two builds load each other's checkpoints.
"""
import logging
from typing import Optional

from megatron.core.extensions.transformer_engine import import_transformer_engine
from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider, TECompatibleLocalSpecProvider
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)

logger = logging.getLogger(__name__)

_KEYS_MAP = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_", "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
_te_notice_logged = False


def _transformer_engine_backend():
    """`TESpecProvider` when Transformer Engine imports; else the native layers in TE's layout, with one
    info line per process."""
    global _te_notice_logged
    try:
        import_transformer_engine()
    except ImportError as error:
        if not _te_notice_logged:
            logger.info("%s: the transformer_engine layer spec builds the native layers (same parameter names).", error)
            _te_notice_logged = True
        return TECompatibleLocalSpecProvider()
    return TESpecProvider()


def _unsupported(num_experts, multi_latent_attention, use_kitchen):
    if num_experts:
        raise ValueError(f"num_experts ({num_experts}): mixture-of-experts layers are not supported yet.")
    if multi_latent_attention:
        raise ValueError("multi_latent_attention: MLA layers are not supported yet.")
    if use_kitchen:
        raise ValueError("use_kitchen: nvidia_kitchen layers are not supported.")


def _dense_layer_spec(backend, qk_layernorm: bool, qk_l2_norm: bool, normalization: Optional[str]) -> ModuleSpec:
    """A dense layer; a backend that fuses norms puts them inside linear_qkv / linear_fc1 (TE's layout and keys)."""
    rms = normalization == "RMSNorm"
    fuse_norm = backend.fuse_layernorm_and_linear()
    layer_norm = IdentityOp if fuse_norm else backend.layer_norm(rms_norm=rms, for_qk=False)
    qkv = backend.column_parallel_layer_norm_linear() if fuse_norm else backend.column_parallel_linear()
    qk_norm = backend.l2_norm() if qk_l2_norm else backend.layer_norm(rms_norm=rms, for_qk=True)
    q_k_norm = qk_norm if (qk_layernorm or qk_l2_norm) else IdentityOp
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=layer_norm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=qkv,
                    core_attention=backend.core_attention(),
                    linear_proj=backend.row_parallel_linear(),
                    q_layernorm=q_k_norm,
                    k_layernorm=q_k_norm,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=layer_norm,
            mlp=_mlp_spec(backend),
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map={} if fuse_norm else dict(_KEYS_MAP),
        ),
    )


def _mlp_spec(backend) -> ModuleSpec:
    """A dense MLP of `backend`'s modules (the pre-MLP norm inside fc1 when the backend fuses norms)."""
    if backend.fuse_layernorm_and_linear():
        fc1 = backend.column_parallel_layer_norm_linear()
    else:
        fc1 = backend.column_parallel_linear()
    return ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=fc1, linear_fc2=backend.row_parallel_linear()))


def get_gpt_layer_local_spec(
    num_experts: Optional[int] = None,
    moe_grouped_gemm: Optional[bool] = False,
    qk_layernorm: Optional[bool] = False,
    multi_latent_attention: Optional[bool] = False,
    fp8: Optional[str] = None,
    moe_use_legacy_grouped_gemm: Optional[bool] = False,
    normalization: Optional[str] = None,
    qk_l2_norm: Optional[bool] = False,
    use_kitchen: bool = False,
) -> ModuleSpec:
    """Spec of a dense GPT layer built from native modules."""
    _unsupported(num_experts, multi_latent_attention, use_kitchen)
    return _dense_layer_spec(LocalSpecProvider(), bool(qk_layernorm), bool(qk_l2_norm), normalization)


def get_gpt_layer_with_transformer_engine_spec(
    num_experts: Optional[int] = None,
    moe_grouped_gemm: Optional[bool] = False,
    qk_layernorm: Optional[bool] = False,
    multi_latent_attention: Optional[bool] = False,
    fp8: Optional[str] = None,
    moe_use_legacy_grouped_gemm: Optional[bool] = False,
    qk_l2_norm: Optional[bool] = False,
    use_te_op_fuser: Optional[bool] = False,
    use_kitchen: bool = False,
) -> ModuleSpec:
    """Megatron's default (`--transformer-impl transformer_engine`) spec: TE's modules when Transformer
    Engine imports, else the native modules in TE's layout (one info line per process)."""
    backend = _transformer_engine_backend()
    _unsupported(num_experts, multi_latent_attention, use_kitchen)
    return _dense_layer_spec(backend, bool(qk_layernorm), bool(qk_l2_norm), None)


def get_mlp_module_spec(
    use_te: Optional[bool] = True,
    num_experts: Optional[int] = None,
    moe_grouped_gemm: Optional[bool] = False,
    fp8: Optional[str] = None,
    moe_use_legacy_grouped_gemm: Optional[bool] = False,
    use_te_op_fuser: Optional[bool] = False,
) -> ModuleSpec:
    """Spec of a dense MLP; with `use_te` the pre-MLP norm is fused into fc1 (TE's layout and keys), built
    from TE's modules when Transformer Engine imports."""
    if num_experts:
        raise ValueError(f"num_experts ({num_experts}): mixture-of-experts layers are not supported yet.")
    return _mlp_spec(_transformer_engine_backend() if use_te else LocalSpecProvider())


def _moe_pattern(config: TransformerConfig):
    freq = config.moe_layer_freq
    if config.num_moe_experts is None:
        return [0] * config.num_layers
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(config.num_layers)]
    return list(freq)


def get_gpt_decoder_block_spec(
    config: TransformerConfig,
    use_transformer_engine: bool,
    normalization: Optional[str] = None,
    qk_l2_norm: Optional[bool] = False,
    vp_stage: Optional[int] = None,
) -> TransformerBlockSubmodules:
    """Per-layer specs of this pipeline stage (dense layers) and the final norm."""
    if any(_moe_pattern(config)):
        raise ValueError("num_moe_experts: mixture-of-experts layers are not supported yet.")
    if use_transformer_engine:
        layer_spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm, qk_l2_norm=qk_l2_norm)
        final_norm = _transformer_engine_backend().layer_norm()
    else:
        layer_spec = get_gpt_layer_local_spec(
            qk_layernorm=config.qk_layernorm, normalization=normalization, qk_l2_norm=qk_l2_norm
        )
        final_norm = LocalSpecProvider().layer_norm()
    layer_specs = [layer_spec] * config.num_layers
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    local_specs = layer_specs[offset : offset + get_num_layers_to_build(config, vp_stage=vp_stage)]
    return TransformerBlockSubmodules(layer_specs=local_specs, layer_norm=final_norm)


__all__ = [
    "get_gpt_layer_local_spec",
    "get_gpt_layer_with_transformer_engine_spec",
    "get_gpt_decoder_block_spec",
    "get_mlp_module_spec",
]


def get_mlp_module_spec_for_backend(
    backend,
    num_experts: Optional[int] = None,
    moe_grouped_gemm: Optional[bool] = False,
    moe_use_legacy_grouped_gemm: Optional[bool] = False,
    use_te_op_fuser: Optional[bool] = False,
) -> ModuleSpec:
    """Spec of a dense MLP built from `backend`'s modules (a `BackendSpecProvider`: `LocalSpecProvider`,
    `TECompatibleLocalSpecProvider`, `TESpecProvider`); fc1 carries the pre-MLP norm when the backend fuses it.

    `num_experts` (mixture of experts) and `use_te_op_fuser` (Transformer Engine's fused-operation MLP) are
    refused with a ValueError: neither is built here yet.
    """
    if num_experts is not None:
        raise ValueError(f"num_experts ({num_experts}): mixture-of-experts layers are not supported yet.")
    if use_te_op_fuser:
        raise ValueError("use_te_op_fuser: Transformer Engine's fused-operation MLP is not supported; pass False.")
    return _mlp_spec(backend)
