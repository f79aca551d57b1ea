"""Mamba / hybrid-model rules of the command line (what Megatron-LM 0.13.1 asserts while building the stack
and the mixer, reported with the flags' names before anything is built)."""
from types import SimpleNamespace
from typing import List

from megatron.core.ssm.mamba_hybrid_layer_allocation import allocate_layers
from megatron.core.ssm.mamba_context_parallel import cp_problems
from megatron.core.ssm.mamba_mixer import check_mamba_dims, mamba_dims


def is_mamba_run(args) -> bool:
    """Whether the command line builds a Mamba / hybrid stack (a Mamba `--spec`, a hybrid flag)."""
    spec = " ".join(args.spec or [])
    return ("mamba" in spec or args.is_hybrid_model or args.hybrid_override_pattern is not None
            or args.hybrid_attention_ratio > 0.0 or args.hybrid_mlp_ratio > 0.0)


def validate_mamba(args) -> List[str]:
    """Hybrid allocation, pipeline split and mixer sizes of a Mamba / hybrid run."""
    if not is_mamba_run(args):
        return []
    problems = []
    if args.num_layers is not None:
        try:
            allocate_layers(args.num_layers, args.hybrid_attention_ratio, args.hybrid_mlp_ratio,
                            args.hybrid_override_pattern)
        except ValueError as error:
            problems.append(str(error))
        pp = args.pipeline_model_parallel_size
        if args.num_layers % pp:
            problems.append(f"--num-layers ({args.num_layers}) must be divisible by --pipeline-model-parallel-size "
                            f"({pp}) for Mamba / hybrid models (each stage takes num_layers // PP layers).")
    virtual = (getattr(args, "num_layers_per_virtual_pipeline_stage", None),
               getattr(args, "num_virtual_stages_per_pipeline_rank", None))
    if any(value is not None for value in virtual):
        problems.append("--num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank: Mamba / "
                        "hybrid stacks have no virtual pipeline stages (as in Megatron-LM): drop the flag.")
    if args.hidden_size is not None:
        view = SimpleNamespace(mamba_head_dim=args.mamba_head_dim, mamba_num_groups=args.mamba_num_groups,
                               mamba_state_dim=args.mamba_state_dim, mamba_num_heads=args.mamba_num_heads)
        tp = args.tensor_model_parallel_size
        dims_problems = check_mamba_dims(view, args.hidden_size, tp)
        problems += dims_problems
        if not dims_problems and args.context_parallel_size > 1:
            dims = mamba_dims(view, args.hidden_size, tp_size=tp)
            problems += cp_problems(dims["nheads_local"], dims["ngroups_local"], args.context_parallel_size)
    return problems


__all__ = ["validate_mamba", "is_mamba_run"]
