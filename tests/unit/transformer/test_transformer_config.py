"""TransformerConfig defaults and validation, ModuleSpec/build_module, layout parsing."""
import pytest
import torch
import torch.nn.functional as F

from megatron.core.transformer.enums import AttnBackend, AttnMaskType, LayerType
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
from megatron.core.transformer.spec_utils import ModuleSpec, build_module, import_module
from megatron.core.transformer.transformer_config import TransformerConfig


def test_config_derived_defaults():
    config = TransformerConfig(num_layers=4, hidden_size=64, num_attention_heads=8)
    assert config.ffn_hidden_size == 256
    assert config.kv_channels == 8
    assert config.num_query_groups == 8
    assert config.recompute_modules == ["core_attn"]
    assert config.hidden_dropout == 0.1 and config.attention_dropout == 0.1
    assert config.activation_func is F.gelu
    assert config.attention_backend is AttnBackend.auto
    assert config.autocast_dtype == torch.float32
    weight = torch.empty(2000, 10)
    config.init_method(weight)
    assert abs(weight.std().item() - 0.02) < 0.002
    config.output_layer_init_method(weight)
    assert abs(weight.std().item() - 0.02 / (2 * 4) ** 0.5) < 0.001
    scaled = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, apply_query_key_layer_scaling=True,
                               attention_softmax_in_fp32=False)
    assert scaled.attention_softmax_in_fp32


def test_config_fusions_never_require_te_or_apex():
    config = TransformerConfig(
        num_layers=2, hidden_size=16, num_attention_heads=2, apply_rope_fusion=True, persist_layer_norm=True,
        masked_softmax_fusion=True, gradient_accumulation_fusion=True, bias_dropout_fusion=True,
        bias_activation_fusion=True, memory_efficient_layer_norm=True,
    )
    assert config.apply_rope_fusion and config.persist_layer_norm


def test_config_collects_every_problem():
    with pytest.raises(ValueError) as info:
        TransformerConfig(
            num_layers=3, hidden_size=24, num_attention_heads=6, num_query_groups=3, tensor_model_parallel_size=4,
            recompute_granularity="full", recompute_method="sideways", activation_func=torch.tanh,
            bias_activation_fusion=True, recompute_modules=["core_attn", "everything"],
        )
    message = str(info.value)
    for expected in [
        "num_attention_heads (6) must be divisible by tensor_model_parallel_size (4)",
        "num_query_groups (3) must be divisible by tensor_model_parallel_size (4)",
        "recompute_method ('sideways')",
        "recompute_num_layers",
        "bias_activation_fusion supports only gelu and silu",
        "recompute_modules has unknown entries ['everything']",
    ]:
        assert expected in message, (expected, message)


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        (dict(recompute_method="uniform"), "only applies to recompute_granularity='full'"),
        (dict(recompute_granularity="selective", recompute_num_layers=1), "must be None with recompute_granularity"),
        (dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=9), "between 0 and"),
        (dict(activation_func=F.silu, bias_activation_fusion=True), "needs gated_linear_unit=True"),
        (dict(add_bias_linear=False, bias_activation_fusion=True), "needs add_bias_linear=True"),
        (dict(num_attention_heads=4, num_query_groups=3), "divisible by num_query_groups"),
        (dict(pipeline_model_parallel_size=2, pipeline_dtype=torch.float32, num_layers=3), "must be divisible"),
        (dict(pipeline_model_parallel_size=3, pipeline_dtype=torch.float32, num_layers_in_first_pipeline_stage=1,
              num_layers_in_last_pipeline_stage=1, account_for_loss_in_pipeline_split=True), "cannot be combined"),
        (dict(pipeline_model_parallel_size=2, pipeline_dtype=torch.float32,
              pipeline_model_parallel_layout="Et|ttL"), "places 3 decoder layers but num_layers is 4"),
    ],
)
def test_config_single_rules(kwargs, expected):
    base = dict(num_layers=4, hidden_size=16, num_attention_heads=2)
    base.update(kwargs)
    with pytest.raises(ValueError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        TransformerConfig(**base)


def test_config_layout_sets_virtual_stages():
    config = TransformerConfig(
        num_layers=6, hidden_size=16, num_attention_heads=2, pipeline_model_parallel_size=2,
        pipeline_dtype=torch.float32, pipeline_model_parallel_layout="Et|(t|)*3,tt|L",
    )
    layout = config.pipeline_model_parallel_layout
    assert isinstance(layout, PipelineParallelLayerLayout)
    assert config.virtual_pipeline_model_parallel_size == 3
    assert repr(layout) == "Et|t|t|t|tt|L"


def test_layout_grammar_and_queries():
    layout = PipelineParallelLayerLayout.from_str("E|(t|)*3,m|m||L", pipeline_model_parallel_size=4)
    assert layout.virtual_pipeline_model_parallel_size == 2
    assert [len(stage) for stage in layout.layout] == [1, 1, 1, 1, 1, 1, 0, 1]
    assert layout.get_num_layers_to_build(LayerType.decoder, vp_stage=0, pp_rank=2) == 1
    assert layout.get_layer_offset(LayerType.decoder, vp_stage=0, pp_rank=3) == 2
    assert layout.get_num_layers_to_build(LayerType.mtp, vp_stage=1, pp_rank=1) == 1
    nested = PipelineParallelLayerLayout.from_str("Et*2|((t|)*2)*2,tL", 3)
    assert repr(nested) == "Ett|t|t|t|t|tL"
    assert nested.get_layer_id_list(LayerType.decoder, vp_stage=1, pp_rank=2) == [6]
    listed = PipelineParallelLayerLayout.from_str([["embedding", "decoder"], ["decoder", "loss"]], 2)
    assert repr(listed) == "Et|tL"
    with pytest.raises(ValueError, match="unknown symbols"):
        PipelineParallelLayerLayout.from_str("Ex|tL", 2)
    with pytest.raises(ValueError, match="not a multiple"):
        PipelineParallelLayerLayout.from_str("Et|t|tL", 2)


class _Widget(torch.nn.Module):
    def __init__(self, size, scale=1.0, submodules=None):
        super().__init__()
        if size < 0:
            raise ValueError("size must be >= 0")
        self.size, self.scale, self.submodules = size, scale, submodules


def _plain_function(x):
    return x + 1


def test_build_module_variants():
    assert build_module(_plain_function) is _plain_function
    assert build_module(ModuleSpec(module=_plain_function)) is _plain_function
    built = build_module(ModuleSpec(module=_Widget, params={"scale": 2.0}, submodules="subs"), 3)
    assert (built.size, built.scale, built.submodules) == (3, 2.0, "subs")
    assert build_module(_Widget, 5).submodules is None
    by_path = build_module(ModuleSpec(module=("torch.nn", "Linear")), 2, 3)
    assert isinstance(by_path, torch.nn.Linear) and by_path.weight.shape == (3, 2)
    assert import_module(("megatron.core.transformer.identity_op", "IdentityOp")) is IdentityOp
    with pytest.raises(ValueError, match="size must be >= 0 when instantiating _Widget"):
        build_module(ModuleSpec(module=_Widget), -1)
    identity = build_module(IdentityOp, 1, config=None)
    assert identity(7, "ignored") == 7
    bda = build_module(IdentityFuncOp)
    assert bda(True, False)("x", "residual", 0.1) == "x"
    assert AttnMaskType.causal.value == 2 and AttnBackend.local.value == 4 and LayerType.decoder.value == 4
