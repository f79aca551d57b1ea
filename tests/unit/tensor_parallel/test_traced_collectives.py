"""A TP=2 + sequence-parallel transformer layer traces as one `torch.compile` graph on the NCCL code path.

Each graph break in a compiled layer costs the host a return to Python and a new guarded graph call; with
the work handles of asynchronous collectives in the linears' backward, dynamo split every layer into 8
graphs, which made TP runs host-bound on H200 (docs/performance.md). Inside a trace the collectives are
issued synchronously (`mappings.PendingCollective`), which dynamo turns into its own asynchronous
collectives. The check runs dynamo's `explain` (no code generation) in a subprocess on torch's fake process
group, whose backend is not gloo, so the NCCL branches of `mappings` are the ones traced. The linears are
traced too (the plan's `--compile-linears on`, applied here by `apply_layer_compile`; by default a compiled
layer calls them eagerly).
"""
import os
import subprocess
import sys

from tests.harness import repo_root

PROBE = """
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
from megatron.core import parallel_state as ps
ps.initialize_model_parallel(tensor_model_parallel_size=2, create_gloo_process_groups=False)
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
model_parallel_cuda_manual_seed(1)
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig
config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, tensor_model_parallel_size=2,
                           sequence_parallel=True, hidden_dropout=0.0, attention_dropout=0.0,
                           use_cpu_initialization=True, bias_activation_fusion=True)
layer = build_module(get_gpt_layer_with_transformer_engine_spec(), config=config, layer_number=1)
from megatron.core.optimization_plan.apply import apply_layer_compile
eager_forward = layer.forward
apply_layer_compile([layer], trace_linears=True)  # sets the linears' trace_when_compiled
hidden = torch.randn(8, 2, 64, requires_grad=True)  # [s/tp, b, h]
result = torch._dynamo.explain(eager_forward)(hidden, attention_mask=None)
print("GRAPHS", result.graph_count, "BREAKS", result.graph_break_count)
for reason in result.break_reasons:
    print("BREAK", reason.reason.splitlines()[0], reason.user_stack[-1] if reason.user_stack else "")
"""


def test_compiled_tp_sp_layer_has_no_graph_breaks():
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=repo_root(), capture_output=True, text=True,
                          timeout=300, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "GRAPHS 1 BREAKS 0" in proc.stdout, proc.stdout[-3000:]
