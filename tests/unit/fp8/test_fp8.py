"""Native FP8 (`megatron.core.fp8`) on CPU: quantization, the emulated scaled GEMM, the FP8 linear's three
GEMMs against a reference built from explicitly quantized operands, delayed scaling's amax history,
gradient-accumulation fusion, the model wiring and the command line."""
import pytest
import torch

from megatron.core.fp8 import kernels
from megatron.core.fp8.kernels import E4M3, E5M2
from megatron.core.fp8.linear import fp8_linear
from megatron.core.fp8.recipe import Fp8LinearState, Fp8Recipe, TensorScaling, fp8_config_problems
from tests.unit.transformer.model_setup import apply_plan, init_single_rank, seed_all


def _dequantized(tensor, dtype):
    """What the FP8 path computes with: tensor rounded to `dtype` under its own tensorwise scale."""
    scale = kernels.FP8_MAX[dtype] / tensor.abs().max().float()
    return (tensor.float() * scale).clamp(-kernels.FP8_MAX[dtype], kernels.FP8_MAX[dtype]).to(dtype).float() / scale


def test_quantize_rounds_within_the_format_and_writes_the_transpose():
    torch.manual_seed(0)
    x = torch.randn(40, 24) * 5
    for dtype, rel in ((E4M3, 2 ** -4), (E5M2, 2 ** -3)):
        q, q_t, scale_inv = kernels.quantize(x, kernels.amax(x), dtype, transpose=True)
        assert q.dtype == dtype and q_t.shape == (24, 40)
        assert torch.equal(q_t.view(torch.uint8), q.t().contiguous().view(torch.uint8))
        assert q.float().abs().max().item() == kernels.FP8_MAX[dtype]  # the amax lands on the format's maximum
        back = q.float() * scale_inv
        normal = x.abs() > x.abs().max() * 2 ** -6
        assert ((back - x).abs()[normal] <= rel * x.abs()[normal] + 1e-7).all()


def test_scale_edge_cases_zero_amax_and_margin():
    zero = torch.zeros(1)
    assert kernels.scale_from_amax(zero, E4M3).item() == 1.0
    amax_ = torch.tensor([2.0])
    assert kernels.scale_from_amax(amax_, E4M3).item() == 224.0
    assert kernels.scale_from_amax(amax_, E4M3, margin=1).item() == 112.0
    q, _, inv = kernels.quantize(torch.zeros(4, 4), zero, E4M3)
    assert inv.item() == 1.0 and not q.float().any()


def test_non_finite_and_tiny_amax_give_usable_scales_and_nan_stays_nan():
    for bad in (float("inf"), float("nan")):
        assert kernels.scale_from_amax(torch.tensor([bad]), E4M3).item() == 1.0
    assert kernels.scale_from_amax(torch.tensor([1e-45]), E4M3).item() == torch.finfo(torch.float32).max
    x = torch.tensor([[1.0, float("nan")], [float("inf"), -2.0]])
    q, _, inv = kernels.quantize(x, kernels.amax(x), E4M3)
    assert inv.item() == 1.0 and torch.isnan(q.float()[0, 1]) and q.float()[1].tolist() == [448.0, -2.0]
    scaling = TensorScaling(Fp8Recipe("hybrid", amax_history_len=2), E4M3)
    scaling.quantize(torch.full((2, 2), 4.0), transpose=False)
    scaling.quantize(torch.tensor([[1.0, float("inf")]]), transpose=False)  # an overflowing step
    assert scaling.amax_history.tolist() == [4.0, 4.0]  # the amax used is repeated, not inf


def test_quantize_delayed_reduces_the_amax_before_recording_it():
    history = torch.tensor([4.0, 1.0])
    seen = []

    def reduce(amax_):  # stands in for the all-reduce (MAX) over the ranks holding shards
        seen.append(amax_.item())
        return amax_ * 3

    q, _, inv = kernels.quantize_delayed(torch.tensor([[2.0, -1.0]]), history, True, E4M3, amax_reduce=reduce)
    assert seen == [2.0] and history.tolist() == [6.0, 4.0] and inv.item() == pytest.approx(4 / 448)
    kernels.quantize_delayed(torch.tensor([[9.0]]), history, False, E4M3, record=False, amax_reduce=reduce)
    assert seen == [2.0] and history.tolist() == [6.0, 4.0]  # without recording nothing is reduced or kept


def test_quantize_with_an_older_amax_saturates_and_records_the_current_one():
    x = torch.tensor([[1.0, -8.0], [0.5, 2.0]])
    current = torch.zeros(1)
    q, _, inv = kernels.quantize(x, torch.tensor([2.0]), E4M3, amax_out=current)
    assert current.item() == 8.0
    assert (q.float() * inv).tolist() == [[1.0, -2.0], [0.5, 2.0]]  # clamped to the old range, not NaN


def test_scaled_mm_emulation_and_bias():
    torch.manual_seed(1)
    a, b, bias = torch.randn(8, 16), torch.randn(4, 16), torch.randn(4)
    qa, _, ia = kernels.quantize(a, kernels.amax(a), E4M3)
    qb, _, ib = kernels.quantize(b, kernels.amax(b), E4M3)
    out = kernels.scaled_mm(qa, qb, ia, ib, torch.float32, bias=bias)
    torch.testing.assert_close(out, (qa.float() * ia) @ (qb.float() * ib).t() + bias)
    with pytest.raises(ValueError, match="inner dimensions"):
        kernels.scaled_mm(qa, qb[:, :8].contiguous(), ia, ib, torch.float32)


@pytest.mark.parametrize("fp8_format", ["hybrid", "e4m3"])
def test_fp8_linear_matches_the_quantized_reference(fp8_format):
    torch.manual_seed(2)
    x = torch.randn(6, 2, 32, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(48, 32) * 0.1)
    bias = torch.nn.Parameter(torch.randn(48))
    state = Fp8LinearState(Fp8Recipe(fp8_format, recipe="tensorwise"))
    out = fp8_linear(x, weight, bias, state)
    grad_out = torch.randn(6, 2, 48)
    out.backward(grad_out)

    grad_dtype = E5M2 if fp8_format == "hybrid" else E4M3
    x2d, g2d = x.detach().reshape(12, 32), grad_out.reshape(12, 48)
    xq, wq, gq = _dequantized(x2d, E4M3), _dequantized(weight.detach(), E4M3), _dequantized(g2d, grad_dtype)
    torch.testing.assert_close(out.detach().reshape(12, 48), xq @ wq.t() + bias.detach())
    torch.testing.assert_close(x.grad.reshape(12, 32), gq @ wq)
    torch.testing.assert_close(weight.grad, gq.t() @ xq)
    torch.testing.assert_close(bias.grad, g2d.sum(0))
    # and close to the exact linear, within FP8's precision
    exact = x2d @ weight.detach().t()
    assert (out.detach().reshape(12, 48) - bias.detach() - exact).norm() / exact.norm() < 0.06


def test_fp8_linear_without_fp8_wgrad_keeps_the_input_precision_for_the_weight_gradient():
    torch.manual_seed(3)
    x = torch.randn(8, 16, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(8, 16))
    state = Fp8LinearState(Fp8Recipe("hybrid", recipe="tensorwise", wgrad=False))
    grad_out = torch.randn(8, 8)
    fp8_linear(x, weight, None, state).backward(grad_out)
    torch.testing.assert_close(weight.grad, grad_out.t() @ x.detach())


def test_delayed_scaling_uses_the_history_and_rolls_it():
    scaling = TensorScaling(Fp8Recipe("hybrid", amax_history_len=3, amax_compute_algo="max"), E4M3)
    inverse_scales = []
    for peak in (2.0, 5.0, 1.0, 0.5, 0.25):
        tensor = torch.tensor([[peak, -peak / 2]])
        inverse_scales.append(scaling.quantize(tensor, transpose=False)[2].item())
    # the first call scales by its own amax (no history yet); then the max of the last three amaxes seen
    assert inverse_scales == pytest.approx([2 / 448, 2 / 448, 5 / 448, 5 / 448, 5 / 448])
    assert scaling.amax_history.tolist() == [0.25, 0.5, 1.0]
    recent = TensorScaling(Fp8Recipe("hybrid", amax_history_len=2), E4M3)
    seen = [recent.quantize(torch.tensor([[peak]]), transpose=False)[2].item() for peak in (4.0, 1.0, 2.0)]
    assert seen == pytest.approx([4 / 448, 4 / 448, 1 / 448])
    # a value above the recorded amax saturates at the format's maximum instead of overflowing
    q, _, inv = recent.quantize(torch.tensor([[16.0, 1.0]]), transpose=False)
    assert q.float().tolist() == [[448.0, 224.0]] and inv.item() == pytest.approx(2 / 448)


def test_forward_without_autograd_leaves_the_history_so_recompute_matches():
    torch.manual_seed(5)
    x, weight = torch.randn(8, 16), torch.nn.Parameter(torch.randn(8, 16))
    state = Fp8LinearState(Fp8Recipe("hybrid", amax_history_len=1))
    fp8_linear(x * 3, weight, None, state).sum().backward()  # a first step fills the histories
    history = state.input.amax_history.clone()
    with torch.no_grad():  # evaluation, or the first pass of activation recompute
        first = fp8_linear(x, weight, None, state)
    assert torch.equal(state.input.amax_history, history)
    recomputed = fp8_linear(x, weight, None, state)
    assert torch.equal(first, recomputed.detach())
    assert state.input.amax_history.item() == x.abs().max().item()


def test_scaling_state_kept_restores_histories_in_place():
    from megatron.core.fp8.recipe import fp8_scaling_state_kept

    layer = torch.nn.Linear(4, 4)
    layer.fp8 = Fp8LinearState(Fp8Recipe("hybrid", amax_history_len=2))
    layer.fp8.input.quantize(torch.full((2, 4), 3.0), transpose=False)
    history = layer.fp8.input.amax_history
    before = history.clone()
    with fp8_scaling_state_kept(layer):
        layer.fp8.input.quantize(torch.full((2, 4), 7.0), transpose=False)
        layer.fp8.weight.quantize(torch.full((4, 4), 7.0), transpose=False)
        assert history[0].item() == 7.0
    assert layer.fp8.input.amax_history is history and torch.equal(history, before)
    assert layer.fp8.weight.amax_history is None  # had none before: starts afresh


def test_weight_gradient_goes_into_main_grad_through_the_sink():
    from megatron.core.tensor_parallel.layers import add_weight_grad_to_main_grad

    torch.manual_seed(4)
    x = torch.randn(16, 32, dtype=torch.bfloat16)
    weight = torch.nn.Parameter(torch.randn(16, 32, dtype=torch.bfloat16))
    weight.main_grad = torch.ones(16, 32)
    weight.grad_added_to_main_grad = False
    grad_out = torch.randn(16, 16, dtype=torch.bfloat16)
    state = Fp8LinearState(Fp8Recipe("hybrid", recipe="tensorwise"))
    fp8_linear(x, weight, None, state, add_weight_grad_to_main_grad).backward(grad_out)
    expected = 1 + _dequantized(grad_out.float(), E5M2).t() @ _dequantized(x.float(), E4M3)
    torch.testing.assert_close(weight.main_grad, expected, rtol=1e-5, atol=1e-5)
    assert weight.grad_added_to_main_grad and weight.grad is not None


def _gpt(fp8=None, recipe="tensorwise"):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    seed_all(7)
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, hidden_dropout=0.0,
                               attention_dropout=0.0, fp8=fp8, fp8_recipe=recipe, use_cpu_initialization=True)
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=128, max_sequence_length=32)
    return apply_plan(model)[0]


def _loss_and_grads(model):
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 128, (2, 32), generator=generator)
    labels = torch.randint(0, 128, (2, 32), generator=generator)
    loss = model(tokens, torch.arange(32).expand(2, 32), None, labels=labels).mean()
    loss.backward()
    return loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_gpt_with_fp8_linears_tracks_the_exact_model(recipe):
    init_single_rank()
    exact = _gpt()
    model = _gpt("hybrid", recipe)
    fp8_layers = [m for m in model.modules() if getattr(m, "fp8", None) is not None]
    assert len(fp8_layers) == 8 and model.output_layer.fp8 is None  # 4 linears per layer; the head stays bf16
    assert model.state_dict().keys() == exact.state_dict().keys()  # no new checkpoint entries
    ref_loss, ref_grads = _loss_and_grads(exact)
    for _ in range(2):  # delayed scaling: the second step uses the recorded amaxes
        model.zero_grad()
        loss, grads = _loss_and_grads(model)
    assert abs(loss - ref_loss) < 2e-3 * ref_loss
    assert (grads - ref_grads).norm() / ref_grads.norm() < 0.1


def test_config_problems_are_checked_once_by_the_plan():
    from megatron.core.optimization_plan.resolve import DeviceFacts, PlanError, resolve_plan
    from megatron.core.transformer.transformer_config import TransformerConfig

    bad = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, fp8="hybrid", fp8_recipe="mxfp8",
                            fp8_param=True, fp8_amax_history_len=0)  # the config itself does not judge FP8
    with pytest.raises(PlanError) as error:
        resolve_plan(bad, DeviceFacts())
    text = str(error.value)
    assert "--fp8-recipe (fp8_recipe='mxfp8')" in text and "fp8_param" not in text  # FP8 parameters are built
    assert "fp8_amax_history_len (0)" in text
    attention = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, fp8="e4m3",
                                  fp8_dot_product_attention=True)
    with pytest.raises(PlanError, match="fp8_dot_product_attention: FP8 attention is not implemented"):
        resolve_plan(attention, DeviceFacts())
    with pytest.raises(PlanError, match=r"Transformer Engine's modules \(TELinear\).*--transformer-impl local"):
        resolve_plan(attention, DeviceFacts(transformer_engine_modules=("TELinear",)))
    assert fp8_config_problems(TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4)) == []
    plan = resolve_plan(TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, fp8="hybrid",
                                          fp8_amax_history_len=16, fp8_amax_compute_algo="max"),
                        DeviceFacts("cuda", True, (9, 0), True, "nccl"))
    assert plan.fp8_recipe == Fp8Recipe("hybrid", "delayed", 0, 16, "max", True)
    assert "torch._scaled_mm on compute capability 9.0" in plan.fp8.why
    e4m3 = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, fp8="e4m3")
    assert "fp32 emulation" in resolve_plan(e4m3, DeviceFacts("cuda", True, (8, 0))).fp8.why  # no FP8 tensor cores
    assert resolve_plan(e4m3, DeviceFacts()).fp8.value["fp8_format"] == "e4m3"


def test_command_line_fp8_flags(monkeypatch):
    import sys

    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.arguments.errors import ArgumentsError
    from megatron.training.arguments.to_configs import core_transformer_config_from_args

    base = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
            "--micro-batch-size 2 --global-batch-size 4 --train-iters 2 --mock-data --tokenizer-type NullTokenizer "
            "--vocab-size 128 --lr 1e-3").split()
    bad = ["--fp8-format", "hybrid", "--fp8-recipe", "blockwise", "--fp8-param-gather"]
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py"] + base + bad)
    with pytest.raises(ArgumentsError) as error:
        validate_args(parse_args())
    text = str(error.value)
    assert "--fp8-recipe blockwise" in text and "--fp8-param-gather is only supported with the distributed" in text
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py"] + base + ["--bf16", "--fp8-format", "e4m3",
                                                                   "--fp8-amax-history-len", "4", "--no-fp8-wgrad"])
    config = core_transformer_config_from_args(validate_args(parse_args()))
    assert (config.fp8, config.fp8_recipe, config.fp8_amax_history_len, config.fp8_wgrad) == ("e4m3", "delayed", 4,
                                                                                               False)
