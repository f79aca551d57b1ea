"""MoE on one CUDA GPU: the torch._grouped_mm path against the matmul loop, GroupedMLP against SequentialMLP in bf16,
and the host synchronisations of an MoE layer's forward and backward (alltoall: one wait for the split sizes)."""
import warnings

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu


def test_grouped_mm_path_matches_the_loop_in_bf16():
    from megatron.core.transformer.moe import grouped_gemm_util as gg

    device = torch.device("cuda", torch.cuda.current_device())
    assert gg.torch_grouped_mm_supported(device, torch.bfloat16), "torch._grouped_mm should work on this GPU"
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(1000, 256, generator=gen).to(device, torch.bfloat16)
    b = torch.randn(4, 256, 512, generator=gen).to(device, torch.bfloat16)
    sizes = torch.tensor([300, 0, 450, 250])
    grad = torch.randn(1000, 512, generator=gen).to(device, torch.bfloat16)
    results = []
    for fn in (gg.gmm, gg._loop_gmm):
        a_, b_ = a.clone().requires_grad_(), b.clone().requires_grad_()
        out = fn(a_, b_, sizes, False)
        out.backward(grad)
        results.append((out.float(), a_.grad.float(), b_.grad.float()))
    for got, want in zip(*results):
        assert ((got - want).norm() / want.norm()).item() < 1e-2
    assert results[0][2][1].abs().sum() == 0  # the empty group's weight gets a zero gradient


def _config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=1, hidden_size=256, num_attention_heads=4, ffn_hidden_size=512, num_moe_experts=8,
                moe_router_topk=2, add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu,
                bf16=True, params_dtype=torch.bfloat16, moe_aux_loss_coeff=1e-2, moe_router_dtype="fp32",
                moe_token_dispatcher_type="alltoall", hidden_dropout=0.0, attention_dropout=0.0)
    base.update(kw)
    return TransformerConfig(**base)


def _layer(grouped, **kw):
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.spec_utils import build_module

    config = _config(moe_grouped_gemm=grouped, **kw)
    return build_module(get_moe_module_spec(use_te=False, num_experts=8, moe_grouped_gemm=grouped), config=config)


def test_grouped_and_sequential_moe_layers_agree_in_bf16_on_cuda():
    from tests.parity.test_moe_parity import assemble, global_pieces, load_global

    torch.manual_seed(0)
    sequential = _layer(False).cuda()
    grouped = _layer(True).cuda()
    load_global(grouped, assemble([global_pieces(sequential)]))
    x = torch.randn(64, 4, 256, device="cuda", dtype=torch.bfloat16)
    outputs = []
    for layer in (sequential, grouped):
        xi = x.clone().requires_grad_()
        out, _ = layer(xi)
        out.float().square().sum().backward()
        outputs.append((out.float(), xi.grad.float()))
    for got, want in zip(*outputs):
        assert ((got - want).norm() / want.norm()).item() < 2e-2


@pytest.mark.parametrize("dispatcher,max_syncs,max_waits", [("alltoall", 0, 0), ("allgather", 1, 0)])
def test_moe_layer_host_synchronisations(dispatcher, max_syncs, max_waits, monkeypatch):
    """Implicit synchronisations (sync debug mode) and the dispatcher's explicit host-copy waits of one forward
    and backward without EP: alltoall needs no host value there (device counts into the grouped GEMM)."""
    from megatron.core.transformer.moe import token_dispatcher

    waits = []

    class CountingHostCopy(token_dispatcher._HostCopy):
        def wait(self):
            waits.append(1)
            return super().wait()

    monkeypatch.setattr(token_dispatcher, "_HostCopy", CountingHostCopy)
    layer = _layer(True, moe_token_dispatcher_type=dispatcher).cuda()
    x = torch.randn(64, 4, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    layer(x)[0].sum().backward()  # warm-up (probes, allocations)
    torch.cuda.synchronize()
    waits.clear()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            layer(x)[0].sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    print(dispatcher, len(syncs), "implicit host synchronisations:", syncs[:3], len(waits), "host-copy waits")
    assert len(syncs) <= max_syncs, syncs
    assert len(waits) <= max_waits


def test_grouped_mm_with_device_sizes_matches_host_sizes():
    from megatron.core.transformer.moe import grouped_gemm_util as gg

    gen = torch.Generator().manual_seed(1)
    a = torch.randn(96, 64, generator=gen).to("cuda", torch.bfloat16)
    b = torch.randn(3, 64, 32, generator=gen).to("cuda", torch.bfloat16)
    host = torch.tensor([40, 0, 56])
    torch.testing.assert_close(gg.gmm(a, b, host.cuda()), gg.gmm(a, b, host), rtol=0, atol=0)



def test_grouped_mm_probe_from_a_no_grad_first_call():
    """The one-time probe runs its own backward: a first gmm call under no_grad (inference, or inside an
    autograd.Function's forward) must still find torch._grouped_mm usable."""
    from megatron.core.transformer.moe import grouped_gemm_util as gg

    device = torch.device("cuda", torch.cuda.current_device())
    gg._GROUPED_MM_SUPPORT.clear()
    with torch.no_grad():
        gg.gmm(torch.zeros(16, 256, device=device, dtype=torch.bfloat16),
               torch.zeros(4, 256, 512, device=device, dtype=torch.bfloat16), torch.tensor([8, 0, 8, 0]))
    assert gg.torch_grouped_mm_supported(device, torch.bfloat16)


def test_compiled_softmax_aux_loss_routing_matches_eager():
    from megatron.core.transformer.moe import router as router_module

    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(4096, 8, generator=gen) * 2).cuda().requires_grad_()
    weight = torch.randn(4096, 8, generator=gen).cuda()
    outputs = []
    for fn in (router_module._softmax_topk_with_switch_loss_fused, router_module._softmax_topk_with_switch_loss):
        x = logits.detach().clone().requires_grad_()
        probs, routing_map, aux_loss = fn(x, 2, False, None, 1e-2)
        ((probs * weight).sum() + aux_loss).backward()
        outputs.append((probs.detach(), routing_map, aux_loss.detach(), x.grad))
    (probs_c, map_c, aux_c, grad_c), (probs_e, map_e, aux_e, grad_e) = outputs
    assert torch.equal(map_c, map_e)
    torch.testing.assert_close(probs_c, probs_e, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(aux_c, aux_e, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad_c, grad_e, rtol=1e-4, atol=1e-6)


def test_grouped_mlp_fused_weight_gradient_on_cuda_matches_the_unfused_path():
    """bf16 GroupedMLP under DDP's attributes: the Triton kernel accumulates the weight gradients in fp32 into
    main_grad; torch's path rounds them to bf16 first, hence the 1e-2 bound on the norms."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe import grouped_gemm_util as gg
    from megatron.core.transformer.spec_utils import build_module

    torch.manual_seed(0)
    layers = []
    for fusion in (False, True):
        config = _config(moe_grouped_gemm=True, gradient_accumulation_fusion=fusion)
        layers.append(build_module(get_moe_module_spec(use_te=False, num_experts=8, moe_grouped_gemm=True),
                                   config=config).cuda())
    unfused, fused = (layer.experts for layer in layers)
    fused.load_state_dict(unfused.state_dict())
    for param in fused.parameters():
        param.main_grad = torch.ones(param.shape, device="cuda")
        param.grad_added_to_main_grad = False
    x = torch.randn(1000, 256, device="cuda", dtype=torch.bfloat16)
    probs = torch.rand(1000, device="cuda")
    tokens_per_expert = torch.tensor([300, 0, 150, 50, 200, 100, 120, 80], device="cuda")
    assert gg.fused_wgrad_supported(x, fused.weight1, (8, 256, fused.weight1.shape[1] // 8))
    outputs = []
    for experts in (unfused, fused):
        xi = x.clone().requires_grad_()
        out, _ = experts(xi, tokens_per_expert, probs)
        out.float().square().sum().backward()
        outputs.append((out.float(), xi.grad.float()))
    for got, want in zip(*outputs):
        assert ((got - want).norm() / want.norm()).item() < 1e-2
    for param, reference in zip(fused.parameters(), unfused.parameters()):
        assert param.grad_added_to_main_grad
        expected = reference.grad.float() + 1
        assert ((param.main_grad - expected).norm() / (expected - 1).norm()).item() < 1e-2
