"""Validation of the context-parallel flags (`--context-parallel-size`, `--cp-comm-type`,
`--hierarchical-context-parallel-sizes`) and of their combinations, with Megatron-LM 0.13.1's rules plus the
ones its Transformer Engine attention enforces at run time (reported here, before any process starts)."""
import math
from typing import List

from megatron.core.context_parallel.attention import CP_COMM_TYPES


def context_parallel_problems(args) -> List[str]:
    """Every violated CP rule as a message naming the flags, the values, the rule and the fix."""
    cp = args.context_parallel_size
    hierarchical = args.hierarchical_context_parallel_sizes
    comm_types = args.cp_comm_type if isinstance(args.cp_comm_type, (list, tuple)) else [args.cp_comm_type]
    problems = []
    if hierarchical and math.prod(hierarchical) != cp:
        problems.append(f"--hierarchical-context-parallel-sizes {' '.join(map(str, hierarchical))} must multiply "
                        f"to --context-parallel-size ({cp}): give sizes whose product is {cp}.")
    if "a2a+p2p" in comm_types and not hierarchical:
        problems.append("--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes (the all-to-all size, "
                        "then the ring size): add it, e.g. --hierarchical-context-parallel-sizes 2 "
                        f"{max(cp // 2, 1)}.")
    if cp <= 1:
        return problems
    unknown = sorted({c for c in comm_types if c not in CP_COMM_TYPES}, key=str)
    if unknown:
        problems.append(f"--cp-comm-type {' '.join(map(str, unknown))}: each value must be one of "
                        f"{', '.join(CP_COMM_TYPES)} ('allgather' is spelled all_gather).")
    problems += _per_layer_problems(args, comm_types)
    problems += _shape_problems(args, cp, comm_types, hierarchical)
    return problems


def _per_layer_problems(args, comm_types) -> List[str]:
    if len(comm_types) <= 1 or args.num_layers is None or len(comm_types) > args.num_layers:
        return []
    return [f"--cp-comm-type has {len(comm_types)} values for {args.num_layers} layers: as in Megatron-LM, a "
            "per-layer list is indexed by the 1-based layer number, so it needs --num-layers + 1 = "
            f"{args.num_layers + 1} values (the first is unused)."]


def _shape_problems(args, cp, comm_types, hierarchical) -> List[str]:
    problems = []
    seq = args.seq_length
    if seq is not None and seq % (2 * cp) != 0:
        problems.append(f"--seq-length ({seq}) must be divisible by 2 x --context-parallel-size ({2 * cp}): every "
                        f"sequence is cut into {2 * cp} chunks (two per CP rank); choose a multiple of {2 * cp}.")
    heads, tp = args.num_attention_heads, args.tensor_model_parallel_size
    if heads is not None and heads % tp == 0:
        splits = {"a2a": cp, "a2a+p2p": hierarchical[0] if hierarchical else None}
        for comm_type in sorted(set(comm_types) & set(splits), key=str):
            parts = splits[comm_type]
            if parts and (heads // tp) % parts != 0:
                problems.append(
                    f"--cp-comm-type {comm_type}: the {heads // tp} attention heads per tensor-parallel rank "
                    f"(--num-attention-heads {heads} / --tensor-model-parallel-size {tp}) must be divisible by the "
                    f"all-to-all size ({parts}); choose sizes that divide them.")
    if hierarchical and "a2a+p2p" in comm_types and len(hierarchical) != 2:
        problems.append(f"--hierarchical-context-parallel-sizes {' '.join(map(str, hierarchical))}: a2a+p2p uses "
                        "exactly two levels (all-to-all size, ring size).")
    if getattr(args, "mtp_num_layers", None):
        problems.append("--mtp-num-layers cannot be combined with --context-parallel-size > 1 (as in Megatron-LM).")
    if getattr(args, "enable_cuda_graph", False):
        problems.append("--enable-cuda-graph cannot be combined with --context-parallel-size > 1 yet (the ring "
                        "exchange is not captured): drop one of the two.")
    return problems


__all__ = ["context_parallel_problems"]
