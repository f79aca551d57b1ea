"""Layer specs of GPT models (Megatron Core's function names and signatures).

MoE layers (`num_experts`) get an `MoELayer` MLP (`moe_module_specs`) and, in both specs, a separate
`pre_mlp_layernorm` module; the local spec's key map still renames it to `mlp.linear_fc1.layer_norm_*` in
distributed checkpoints (Megatron's behaviour: local-spec MoE checkpoints store the pre-MLP norm there),
while the TE spec stores `pre_mlp_layernorm.*`. `get_gpt_decoder_block_spec` picks MoE or dense specs per
layer from `moe_layer_freq`.

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
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.multi_latent_attention import MLASelfAttention, MLASelfAttentionSubmodules
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlockSubmodules,
    MultiTokenPredictionLayer,
    MultiTokenPredictionLayerSubmodules,
    get_mtp_num_layers_to_build,
)
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


def _unsupported(use_kitchen):
    if use_kitchen:
        raise ValueError("use_kitchen: nvidia_kitchen layers are not supported.")


def _dense_layer_spec(backend, qk_layernorm: bool, qk_l2_norm: bool, normalization: Optional[str],
                      num_experts: Optional[int] = None, moe_grouped_gemm: bool = False,
                      moe_use_legacy_grouped_gemm: bool = False) -> ModuleSpec:
    """A transformer layer; a backend that fuses norms puts them inside linear_qkv / linear_fc1 (TE's layout and
    keys). With `num_experts` the MLP is an MoE layer and the pre-MLP norm a module of its own."""
    rms = normalization == "RMSNorm"
    fuse_norm = backend.fuse_layernorm_and_linear()
    layer_norm = IdentityOp if fuse_norm else backend.layer_norm(rms_norm=rms, for_qk=False)
    qkv = backend.column_parallel_layer_norm_linear() if fuse_norm else backend.column_parallel_linear()
    qk_norm = backend.l2_norm() if qk_l2_norm else backend.layer_norm(rms_norm=rms, for_qk=True)
    q_k_norm = qk_norm if (qk_layernorm or qk_l2_norm) else IdentityOp
    if num_experts:
        mlp = get_moe_module_spec_for_backend(backend, num_experts, moe_grouped_gemm, moe_use_legacy_grouped_gemm)
        pre_mlp_layernorm = backend.layer_norm(rms_norm=rms, for_qk=False)
    else:
        mlp, pre_mlp_layernorm = _mlp_spec(backend), layer_norm
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
            pre_mlp_layernorm=pre_mlp_layernorm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map={} if fuse_norm else dict(_KEYS_MAP),
        ),
    )


def _mla_layer_spec(backend, qk_layernorm: bool, normalization: Optional[str], num_experts: Optional[int] = None,
                    moe_grouped_gemm: bool = False, moe_use_legacy_grouped_gemm: bool = False) -> ModuleSpec:
    """A multi-latent-attention layer (Megatron's MLA specs): `input_layernorm` is always a module of its own; a
    backend that fuses norms carries the q/kv latent norms in linear_q_up_proj / linear_kv_up_proj
    (`layer_norm_weight`) and a dense layer's pre-MLP norm in linear_fc1, else they are `q_layernorm`,
    `kv_layernorm` and `pre_mlp_layernorm`. No key remapping in either spec (as in Megatron)."""
    rms = normalization == "RMSNorm"
    fuse_norm = backend.fuse_layernorm_and_linear()
    norm = backend.layer_norm(rms_norm=rms, for_qk=False)
    if fuse_norm:
        up_proj = backend.column_parallel_layer_norm_linear() if qk_layernorm else backend.column_parallel_linear()
        latent_norm = IdentityOp
    else:
        up_proj = backend.column_parallel_linear()
        latent_norm = backend.layer_norm(rms_norm=rms, for_qk=True) if qk_layernorm else IdentityOp
    if num_experts:
        mlp = get_moe_module_spec_for_backend(backend, num_experts, moe_grouped_gemm, moe_use_legacy_grouped_gemm)
        pre_mlp_layernorm = norm
    else:
        mlp, pre_mlp_layernorm = _mlp_spec(backend), (IdentityOp if fuse_norm else norm)
    column = backend.column_parallel_linear()
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=ModuleSpec(
                module=MLASelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=MLASelfAttentionSubmodules(
                    linear_q_proj=column,
                    linear_q_down_proj=column,
                    linear_q_up_proj=up_proj,
                    linear_kv_down_proj=column,
                    linear_kv_up_proj=up_proj,
                    core_attention=backend.core_attention(),
                    linear_proj=backend.row_parallel_linear(),
                    q_layernorm=latent_norm,
                    kv_layernorm=latent_norm,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=pre_mlp_layernorm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
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
    """Spec of a GPT layer built from native modules (an MoE layer with `num_experts`)."""
    _unsupported(use_kitchen)
    if multi_latent_attention:
        if qk_l2_norm:
            raise ValueError("qk_l2_norm is not supported with multi_latent_attention (as in Megatron-LM).")
        return _mla_layer_spec(LocalSpecProvider(), bool(qk_layernorm), normalization, num_experts,
                               bool(moe_grouped_gemm), bool(moe_use_legacy_grouped_gemm))
    return _dense_layer_spec(LocalSpecProvider(), bool(qk_layernorm), bool(qk_l2_norm), normalization, num_experts,
                             bool(moe_grouped_gemm), bool(moe_use_legacy_grouped_gemm))


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
    _unsupported(use_kitchen)
    if multi_latent_attention:
        if qk_l2_norm:
            raise ValueError("qk_l2_norm is not supported with multi_latent_attention (as in Megatron-LM).")
        return _mla_layer_spec(backend, bool(qk_layernorm), None, num_experts, bool(moe_grouped_gemm),
                               bool(moe_use_legacy_grouped_gemm))
    return _dense_layer_spec(backend, bool(qk_layernorm), bool(qk_l2_norm), None, num_experts, bool(moe_grouped_gemm),
                             bool(moe_use_legacy_grouped_gemm))


def get_mlp_module_spec(
    use_te: Optional[bool] = True,
    num_experts: Optional[int] = None,
    moe_grouped_gemm: Optional[bool] = False,
    fp8: Optional[str] = None,
    moe_use_legacy_grouped_gemm: Optional[bool] = False,
    use_te_op_fuser: Optional[bool] = False,
) -> ModuleSpec:
    """Spec of a dense MLP (with `use_te` the pre-MLP norm is fused into fc1: TE's layout and keys, TE's modules
    when Transformer Engine imports), or of an MoE block with `num_experts`."""
    backend = _transformer_engine_backend() if use_te else LocalSpecProvider()
    if num_experts:
        return get_moe_module_spec_for_backend(backend, num_experts, bool(moe_grouped_gemm),
                                               bool(moe_use_legacy_grouped_gemm))
    return _mlp_spec(backend)


def moe_layer_pattern(config: TransformerConfig):
    """1 (MoE) or 0 (dense) per layer from `moe_layer_freq` (an int N: every N-th layer from layer 0)."""
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(config.num_layers)]
    if isinstance(freq, list):
        if len(freq) != config.num_layers:
            raise ValueError(f"moe_layer_freq has {len(freq)} entries but num_layers is {config.num_layers}: give "
                             "one 0/1 per layer.")
        if any(v not in (0, 1) for v in freq):
            raise ValueError(f"moe_layer_freq ({freq}) may only contain 0 (dense) and 1 (MoE).")
        return list(freq)
    raise ValueError(f"moe_layer_freq ({freq!r}) must be an int or a list of 0/1 per layer.")


def get_gpt_decoder_block_spec(
    config: TransformerConfig,
    use_transformer_engine: bool,
    normalization: Optional[str] = None,
    qk_l2_norm: Optional[bool] = False,
    vp_stage: Optional[int] = None,
) -> TransformerBlockSubmodules:
    """Per-layer specs of this pipeline stage (MoE or dense per `moe_layer_freq`) and the final norm."""
    if use_transformer_engine:
        def layer_spec(num_experts):
            return get_gpt_layer_with_transformer_engine_spec(
                num_experts, config.moe_grouped_gemm, config.qk_layernorm, config.multi_latent_attention,
                moe_use_legacy_grouped_gemm=config.moe_use_legacy_grouped_gemm, qk_l2_norm=qk_l2_norm,
                use_kitchen=config.use_kitchen)
        final_norm = _transformer_engine_backend().layer_norm()
    else:
        def layer_spec(num_experts):
            return get_gpt_layer_local_spec(
                num_experts, config.moe_grouped_gemm, config.qk_layernorm, config.multi_latent_attention,
                moe_use_legacy_grouped_gemm=config.moe_use_legacy_grouped_gemm, normalization=normalization,
                qk_l2_norm=qk_l2_norm, use_kitchen=config.use_kitchen)
        final_norm = LocalSpecProvider().layer_norm()
    dense_spec, moe_spec = layer_spec(None), layer_spec(config.num_moe_experts)
    layer_specs = [moe_spec if is_moe else dense_spec for is_moe in moe_layer_pattern(config)]
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    local_specs = layer_specs[offset : offset + get_num_layers_to_build(config, vp_stage=vp_stage)]
    return TransformerBlockSubmodules(layer_specs=local_specs, layer_norm=final_norm)


def get_mtp_layer_spec(transformer_layer_spec: ModuleSpec, use_transformer_engine: bool) -> ModuleSpec:
    """An MTP layer (enorm, hnorm, eh_proj, final norm of the backend) around `transformer_layer_spec`."""
    backend = _transformer_engine_backend() if use_transformer_engine else LocalSpecProvider()
    norm = backend.layer_norm()
    return ModuleSpec(
        module=MultiTokenPredictionLayer,
        submodules=MultiTokenPredictionLayerSubmodules(
            enorm=norm, hnorm=norm, eh_proj=backend.column_parallel_linear(),
            transformer_layer=transformer_layer_spec, layer_norm=norm,
        ),
    )


def get_gpt_mtp_block_spec(
    config: TransformerConfig,
    spec,
    use_transformer_engine: bool,
    vp_stage: Optional[int] = None,
) -> Optional[MultiTokenPredictionBlockSubmodules]:
    """The MTP layers of this stage (all on the last pipeline stage; None elsewhere or without MTP). Each wraps the
    decoder's last layer spec (`spec`: a block spec of the last stage, or one layer spec)."""
    num_layers_to_build = get_mtp_num_layers_to_build(config, vp_stage=vp_stage)
    if num_layers_to_build == 0:
        return None
    if isinstance(spec, TransformerBlockSubmodules):
        if not spec.layer_specs:
            raise ValueError("get_gpt_mtp_block_spec: the block spec of the MTP stage has no decoder layer; pass a "
                             "layer spec instead.")
        layer_spec = spec.layer_specs[-1]
    elif isinstance(spec, ModuleSpec) and spec.module is TransformerLayer:
        layer_spec = spec
    else:
        raise ValueError(f"get_gpt_mtp_block_spec: spec must be a TransformerBlockSubmodules or a TransformerLayer "
                         f"ModuleSpec, got {spec!r}.")
    mtp_spec = get_mtp_layer_spec(layer_spec, use_transformer_engine)
    return MultiTokenPredictionBlockSubmodules(layer_specs=[mtp_spec] * num_layers_to_build)


__all__ = [
    "get_gpt_mtp_block_spec",
    "get_mtp_layer_spec",
    "get_gpt_layer_local_spec",
    "get_gpt_layer_with_transformer_engine_spec",
    "get_gpt_decoder_block_spec",
    "get_mlp_module_spec",
    "moe_layer_pattern",
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
