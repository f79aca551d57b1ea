"""One MoE layer's forward + backward on one GPU, not part of the product (not run yet: no GPU was available):

  python benchmarks/gpu/moe_layer_bench.py

Mixtral-like expert shapes at a small scale: hidden 2048, 8 experts of SwiGLU width 4096, top-2, 8192 tokens
([4096, 2, 2048] bf16), fp32 router, EP=1. Rows: GroupedMLP through torch._grouped_mm, GroupedMLP through the
per-expert matmul loop (the fallback), SequentialMLP; each with the alltoall and the allgather dispatcher.
Prints the mean time of 10 steps after 3 warm-ups and the expert GEMMs' rate (2 experts x 3 matrices per
token, forward and backward).
"""
import time, torch, torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.moe import grouped_gemm_util as gg

def layer(kind, disp):
    grouped = kind != "sequential"
    cfg = TransformerConfig(num_layers=1, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=4096, num_moe_experts=8,
        moe_router_topk=2, add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu, bf16=True,
        params_dtype=torch.bfloat16, moe_aux_loss_coeff=1e-2, moe_router_dtype="fp32", moe_token_dispatcher_type=disp,
        moe_grouped_gemm=grouped, hidden_dropout=0.0, attention_dropout=0.0)
    return build_module(get_moe_module_spec(use_te=False, num_experts=8, moe_grouped_gemm=grouped), config=cfg).cuda()

x = torch.randn(4096, 2, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
flops = 8192 * 2 * 3 * 2048 * 4096 * 2 * 3
for kind in ("grouped", "grouped-loop", "sequential"):
    for disp in ("alltoall", "allgather"):
        m = layer(kind, disp)
        orig = gg.torch_grouped_mm_supported
        if kind == "grouped-loop":
            gg.torch_grouped_mm_supported = lambda *a: False
        for _ in range(3):
            m(x)[0].sum().backward()
        torch.cuda.synchronize(); t = time.perf_counter(); n = 10
        for _ in range(n):
            m(x)[0].sum().backward()
        torch.cuda.synchronize(); dt = (time.perf_counter() - t) / n
        gg.torch_grouped_mm_supported = orig
        print(f"{kind:13s} {disp:9s} fwd+bwd {dt*1e3:7.2f} ms  expert GEMMs {flops/dt/1e12:6.1f} TFLOP/s", flush=True)
        del m
