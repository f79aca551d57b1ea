"""`set_model_to_sequence_parallel` on a built GPTModel: which attributes it switches, and the model still runs."""
import torch

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import set_model_to_sequence_parallel
from tests.unit.transformer.model_setup import init_single_rank

_ATTRS = ("sequence_parallel", "scatter_to_sequence_parallel", "reduce_scatter_embeddings")


def _model(position_embedding_type):
    config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True,
                               hidden_dropout=0.0, attention_dropout=0.0)
    return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=32, max_sequence_length=8,
                    position_embedding_type=position_embedding_type)


def _values(model, attr):
    return {name: getattr(module, attr) for name, module in model.named_modules() if hasattr(module, attr)}


def test_toggles_megatrons_attributes_and_leaves_excluded_modules():
    init_single_rank()
    for position_embedding_type in ("rope", "learned_absolute"):
        model = _model(position_embedding_type)
        before = {attr: _values(model, attr) for attr in _ATTRS}
        assert before["sequence_parallel"] and before["scatter_to_sequence_parallel"]
        param_flags = {n: getattr(p, "sequence_parallel", None) for n, p in model.named_parameters()}
        excluded = model.decoder.layers[1]

        set_model_to_sequence_parallel(model, set_to=True, exclude_modules=[excluded])
        assert model.config.sequence_parallel is True
        for attr in _ATTRS:
            for name, value in _values(model, attr).items():
                skipped = name.startswith("decoder.layers.1") or (
                    attr == "reduce_scatter_embeddings" and position_embedding_type == "learned_absolute")
                assert value is (before[attr][name] if skipped else True), (attr, name)
        # the linears and norms of the layers are among the switched modules
        switched = [n for n, v in _values(model, "sequence_parallel").items() if v]
        assert any(n.endswith("linear_qkv") for n in switched) and any(n.endswith("linear_fc2") for n in switched)
        # parameter flags (what finalize_model_grads reduces over TP) are not touched
        assert {n: getattr(p, "sequence_parallel", None) for n, p in model.named_parameters()} == param_flags

        set_model_to_sequence_parallel(model, set_to=False)
        assert model.config.sequence_parallel is False
        assert not any(v for attr in _ATTRS for v in _values(model, attr).values())


def test_model_output_is_unchanged_after_a_round_trip_at_tp1():
    init_single_rank()
    torch.manual_seed(0)
    model = _model("rope").eval()
    tokens = torch.randint(0, 32, (2, 8))
    positions = torch.arange(8).expand(2, 8)
    with torch.no_grad():
        before = model(tokens, positions, None)
        set_model_to_sequence_parallel(model, set_to=True)
        during = model(tokens, positions, None)  # at TP=1 the SP scatter/gather are identities
        set_model_to_sequence_parallel(model, set_to=False)
        after = model(tokens, positions, None)
    torch.testing.assert_close(during, before)
    torch.testing.assert_close(after, before)
