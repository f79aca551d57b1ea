"""CPU side of per-layer CUDA graphs: off the GPU the plan leaves the layers alone (and says so in its table),
and the config rules match the argument validation. The graphs themselves are checked on GPUs by
tests/functional/test_cuda_graph_gpu.py."""
import torch

from megatron.core.optimization_plan.resolve import DeviceFacts, cuda_graph_problems, resolve_plan
from megatron.core.transformer.cuda_graphs import GraphedLayer
from megatron.core.transformer.transformer_config import TransformerConfig


def _config(**kwargs):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, enable_cuda_graph=True,
                hidden_dropout=0.0, attention_dropout=0.0)
    base.update(kwargs)
    return TransformerConfig(**base)


def test_plan_graphs_only_cuda_layers():
    cpu = resolve_plan(_config(), DeviceFacts("cpu")).cuda_graphs
    assert cpu.value is None and "on cpu: no graphs" in cpu.why
    cuda = resolve_plan(_config(cuda_graph_warmup_steps=2), DeviceFacts("cuda", True, (9, 0))).cuda_graphs
    assert cuda.value == {"warmup_steps": 2}
    assert resolve_plan(_config(enable_cuda_graph=False), DeviceFacts("cuda", True)).cuda_graphs.value is None


def test_config_rules():
    assert cuda_graph_problems(_config()) == []
    problems = cuda_graph_problems(_config(hidden_dropout=0.1, recompute_granularity="full", recompute_method="uniform",
                                           recompute_num_layers=1))
    assert len(problems) == 2 and "dropout" in problems[0] and "recompute" in problems[1]


def test_graphed_layer_runs_eagerly_outside_training_with_grad():
    layer = torch.nn.Linear(4, 4)
    calls = []

    def forward(hidden_states, **kwargs):
        calls.append(hidden_states.shape)
        return layer.__class__.forward(layer, hidden_states), None

    layer.forward = forward
    graphed = GraphedLayer(layer, graph_pool=None)
    with torch.no_grad():
        output, context = graphed(torch.ones(2, 4))
    assert output.shape == (2, 4) and context is None and calls == [(2, 4)]
    layer.eval()
    graphed(torch.ones(3, 4, requires_grad=True))
    assert calls[-1] == (3, 4) and graphed.forward_graph is None


def test_main_grad_flags_are_restored_after_warm_up_and_capture():
    from megatron.core.transformer.cuda_graphs import main_grad_flags_restored

    flagged, fused, plain = (torch.nn.Parameter(torch.zeros(1)) for _ in range(3))
    flagged.grad_added_to_main_grad, fused.grad_added_to_main_grad = True, False
    with main_grad_flags_restored([flagged, fused, plain], reset=True):
        assert flagged.grad_added_to_main_grad is False and fused.grad_added_to_main_grad is False
        fused.grad_added_to_main_grad = True  # what a fused linear's backward does
    assert flagged.grad_added_to_main_grad is True and fused.grad_added_to_main_grad is False
    assert not hasattr(plain, "grad_added_to_main_grad")
    with main_grad_flags_restored([fused]):
        fused.grad_added_to_main_grad = True
    assert fused.grad_added_to_main_grad is False


def _moe(**kwargs):
    base = dict(num_moe_experts=4, moe_router_topk=2, moe_token_dispatcher_type="alltoall", add_bias_linear=False)
    base.update(kwargs)
    return _config(**base)


def test_moe_layers_are_graphable_only_dropless_alltoall_without_ep_or_expert_tp():
    assert cuda_graph_problems(_moe()) == []
    cases = {
        "expert parallelism (--expert-model-parallel-size 2": _moe(expert_model_parallel_size=2),
        "expert tensor parallelism (--expert-tensor-parallel-size 2": _moe(expert_tensor_parallel_size=2),
        "--moe-token-dispatcher-type allgather": _moe(moe_token_dispatcher_type="allgather"),
        "--moe-expert-capacity-factor 1.0": _moe(moe_expert_capacity_factor=1.0),
        "--moe-router-load-balancing-type sinkhorn": _moe(moe_router_load_balancing_type="sinkhorn",
                                                          moe_aux_loss_coeff=0.0),
        "--moe-input-jitter-eps 0.01": _moe(moe_input_jitter_eps=0.01),
        "--moe-router-force-load-balancing": _moe(moe_router_force_load_balancing=True),
    }
    for expected, config in cases.items():
        problems = cuda_graph_problems(config)
        assert len(problems) == 1 and problems[0].startswith(expected), (expected, problems)


def test_warm_up_side_effects_on_buffers_and_the_aux_loss_tracker_are_undone():
    from megatron.core import parallel_state
    from megatron.core.transformer.cuda_graphs import forward_side_effects_undone

    tracker = parallel_state.get_moe_layer_wise_logging_tracker()
    tracker.clear()
    tracker["load_balancing_loss"] = {"values": torch.tensor([1.0, 2.0])}
    module = torch.nn.Module()
    module.register_buffer("counts", torch.tensor([3.0, 4.0]))
    with forward_side_effects_undone(module):
        module.counts += 1
        tracker["load_balancing_loss"]["values"][1] += 5.0
        tracker["z_loss"] = {"values": torch.tensor([7.0])}  # first recorded inside the block
    assert torch.equal(module.counts, torch.tensor([3.0, 4.0]))
    assert torch.equal(tracker["load_balancing_loss"]["values"], torch.tensor([1.0, 2.0]))
    assert torch.equal(tracker["z_loss"]["values"], torch.tensor([0.0]))
    tracker.clear()


def test_warm_up_backward_gives_the_aux_losses_a_zero_gradient():
    """The warm-up backward starts from a zero output gradient; an attached auxiliary loss must not make the
    gradients upstream of the MoE layer (which fused linears add into main_grad) non-zero."""
    from megatron.core.transformer.cuda_graphs import aux_loss_gradients_zeroed
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    weight = torch.nn.Parameter(torch.tensor([1.0, 2.0]))

    def grad_of_weight():
        activation = weight * 3.0
        output = MoEAuxLossAutoScaler.apply(activation, (activation ** 2).sum())
        return torch.autograd.grad(output, weight, grad_outputs=torch.zeros_like(output))[0]

    before = MoEAuxLossAutoScaler.main_loss_backward_scale
    try:
        for scale in (None, torch.tensor([0.5])):
            MoEAuxLossAutoScaler.main_loss_backward_scale = scale
            with aux_loss_gradients_zeroed():
                assert torch.equal(grad_of_weight(), torch.zeros(2))
            assert MoEAuxLossAutoScaler.main_loss_backward_scale is scale
            if scale is not None:
                assert torch.equal(scale, torch.tensor([0.5]))
                assert torch.allclose(grad_of_weight(), 0.5 * 2 * 9.0 * weight.detach())
    finally:
        MoEAuxLossAutoScaler.main_loss_backward_scale = before
