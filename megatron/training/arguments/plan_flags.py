"""Flags of the optimisation plan that Megatron-LM does not have (group "optimization plan").

Each sets the `TransformerConfig` / `ModelParallelConfig` field of the same name; the plan
(`megatron.core.optimization_plan`) resolves them, with Megatron's own FP8, CUDA-graph, overlap and fusion
flags, once at start-up and prints what it chose and why. Their manifest status is `added`.
"""
from megatron.training.arguments._spec import add_group, flag
from megatron.training.arguments.manifest import flag_help

PLAN_FLAGS = (
    flag("--compile-layers", default="auto", choices=["auto", "on", "off"],
         help="torch.compile each transformer layer; auto: on for CUDA layers of hidden size >= 2048 without "
              "tensor + sequence parallelism or selective recompute."),
    flag("--compile-linears", default="auto", choices=["auto", "on", "off"],
         help="Trace the tensor-parallel linears into the compiled layers' graphs (on) or call them eagerly (off); "
              "auto: off."),
    flag("--fusion-kernels", default="auto", choices=["auto", "compiled", "eager"],
         help="Fused elementwise functions on CUDA: compiled (torch.compile, Triton kernels) or eager (the plain "
              "PyTorch reference, for numerics comparisons); auto: compiled on CUDA."),
    flag("--tp-comm-overlap-transport", default="auto", choices=["auto", "copy-engine", "p2p"],
         help="How the --tp-comm-overlap pipelines move chunks: copy-engine peer copies (TP ranks on one host) or "
              "p2p sends; auto: copy-engine on CUDA with NCCL."),
)


def _add_optimization_plan_args(parser):
    return add_group(parser, "optimization plan", PLAN_FLAGS, flag_help)
