"""Upcycling a dense GPT checkpoint into an MoE model (`--moe-use-upcycling`, Megatron 0.13.1's `upcycling_utils`;
arXiv 2410.07524).

The dense checkpoint is loaded into a dense twin of the MoE model (same args, no experts, FFN
`moe_ffn * granularity`); its state dict is converted in memory and loaded into the MoE model:
- a dense `mlp.linear_fc1.layer_norm_*` (TE layout) becomes `pre_mlp_layernorm.*`;
- the router is the first `E / g` rows of the MoE model's own freshly initialised router, each row repeated `g`
  times (`g` = granularity, `r = E / g` the expansion);
- fc1 is split into `g` row chunks (GLU: the gate and up halves are split separately and re-paired), fc2 into `g`
  column chunks, both multiplied by `scale = a^(1/3)` (GLU or squared ReLU) else `a^(1/2)` with
  `a = r * g * g / k` under `moe_router_pre_softmax` else `a = g`; the chunk list is repeated `r` times and local
  expert `j` of expert-parallel rank `p` takes chunk `p * L + j` (`L` local experts).
Works on each rank's local shards (as Megatron does); SequentialMLP (`local_experts.<j>.*`) and GroupedMLP
(`experts.weight1` / `weight2`) layouts.
"""
import re
from typing import Callable, Dict, List

import torch

_FC1, _FC2 = "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"


def _moe_mlp_config(moe_model):
    for module in moe_model.modules():
        if type(module).__name__ == "MoELayer":
            return module.config, module.experts
    raise ValueError("--moe-use-upcycling: the model has no MoE layer (give --num-experts).")


def _scale(config, granularity: int) -> float:
    expansion = config.num_moe_experts // granularity
    if config.moe_router_pre_softmax:
        a = expansion * granularity * granularity / config.moe_router_topk
    else:
        a = granularity
    glu_like = config.gated_linear_unit or getattr(config, "squared_relu", False)
    return a ** (1.0 / 3.0) if glu_like else a ** 0.5


def _fc1_chunks(weight: torch.Tensor, granularity: int, gated: bool) -> List[torch.Tensor]:
    """fc1 [ffn(*2), h] -> g row chunks; GLU: gate and up halves chunked separately and re-paired."""
    if not gated:
        return list(torch.chunk(weight, granularity, dim=0))
    gate, up = torch.chunk(weight, 2, dim=0)
    return [torch.cat([g, u]) for g, u in zip(torch.chunk(gate, granularity), torch.chunk(up, granularity))]


def _local_expert_chunks(chunks: List[torch.Tensor], config, experts) -> List[torch.Tensor]:
    """Chunk of each local expert: the list repeated r times, expert p * L + j for local j."""
    repeated = chunks * (config.num_moe_experts // len(chunks))
    local = experts.num_local_experts
    first = experts.local_expert_indices[0] if hasattr(experts, "local_expert_indices") else 0
    return [repeated[first + j] for j in range(local)]


def _experts_state(prefix: str, fc1_list, fc2_list, grouped: bool) -> Dict[str, torch.Tensor]:
    if not grouped:
        out = {}
        for j, (fc1, fc2) in enumerate(zip(fc1_list, fc2_list)):
            out[f"{prefix}mlp.experts.local_experts.{j}.linear_fc1.weight"] = fc1.clone()
            out[f"{prefix}mlp.experts.local_experts.{j}.linear_fc2.weight"] = fc2.clone()
        return out
    # GroupedMLP keeps expert e's matrices as consecutive memory blocks (viewed as [L, h, f] and [L, f, h]):
    # [L, h, ffn(*2)] -> weight1 [h, L*ffn(*2)]; [L, ffn, h] -> weight2 [L*ffn, h]
    hidden = fc1_list[0].shape[1]
    weight1 = torch.stack([fc1.t() for fc1 in fc1_list]).reshape(hidden, -1)
    weight2 = torch.stack([fc2.t() for fc2 in fc2_list]).reshape(-1, hidden)
    return {f"{prefix}mlp.experts.weight1": weight1.contiguous(), f"{prefix}mlp.experts.weight2": weight2.contiguous()}


def upcycle_state_dict(moe_model: torch.nn.Module, dense_model: torch.nn.Module, granularity: int = 1) -> Dict:
    """The MoE model's state dict built from `dense_model`'s (one model chunk each; see the module docstring)."""
    config, experts = _moe_mlp_config(moe_model)
    if config.num_moe_experts % granularity:
        raise ValueError(f"--moe-upcycling-granularity ({granularity}) must divide --num-experts "
                         f"({config.num_moe_experts}).")
    grouped = type(experts).__name__ == "GroupedMLP"
    scale = _scale(config, granularity)
    dense = dense_model.state_dict()
    moe = moe_model.state_dict()
    out = {}
    for key, value in dense.items():
        if key.endswith((_FC1, _FC2)) or re.search(r"mlp\.linear_fc[12]\.(_extra_state|bias)$", key):
            continue
        out[key.replace("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm.")] = value
    for key in [k for k in dense if k.endswith(_FC1)]:
        prefix = key[: -len(_FC1)]
        router = moe[prefix + "mlp.router.weight"]
        rows = config.num_moe_experts // granularity
        # first E/g rows of the fresh router, each repeated g times: [E/g, h] -> [E, h]
        out[prefix + "mlp.router.weight"] = router[:rows].repeat_interleave(granularity, dim=0).clone()
        fc1 = _fc1_chunks(dense[key] * scale, granularity, config.gated_linear_unit)
        fc2 = list(torch.chunk(dense[prefix + _FC2] * scale, granularity, dim=1))
        out.update(_experts_state(prefix, _local_expert_chunks(fc1, config, experts),
                                  _local_expert_chunks(fc2, config, experts), grouped))
    for key, value in moe.items():  # what the dense model lacks (expert bias, router extra state, ...)
        if key not in out:
            out[key] = value
    return out


def load_and_upcycle_model(load_dense_ckpt_func: Callable, moe_model: List[torch.nn.Module],
                           dense_model: List[torch.nn.Module], granularity: int = 1, strict: bool = True,
                           load_args=(), load_kwargs=None):
    """Load the dense checkpoint into `dense_model` (`load_dense_ckpt_func(*load_args, **load_kwargs)`), then
    the upcycled state into every chunk of `moe_model`; returns what the load function returned."""
    result = load_dense_ckpt_func(*load_args, **(load_kwargs or {}))
    for moe_chunk, dense_chunk in zip(moe_model, dense_model):
        state = upcycle_state_dict(moe_chunk, dense_chunk, granularity)
        moe_chunk.load_state_dict(state, strict=strict)
    return result


__all__ = ["upcycle_state_dict", "load_and_upcycle_model"]
