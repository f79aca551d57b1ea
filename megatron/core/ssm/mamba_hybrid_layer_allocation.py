"""Megatron's hybrid layer allocation: which of the `num_layers` layers are Mamba, attention or MLP.

Symbols: `M` Mamba layer, `*` attention-only transformer layer, `-` MLP-only layer. Attention layers are spread
evenly between Mamba sections first, then MLP layers replace Mamba layers evenly; an override pattern replaces
the result, and must have the same per-symbol counts when a ratio is also given.
"""
from typing import List, Optional


class Symbols:
    """The layer-type symbols of a hybrid pattern."""

    MAMBA = "M"
    ATTENTION = "*"
    MLP = "-"
    VALID = {MAMBA, ATTENTION, MLP}


def _allocate_auto(total_layers: int, target_attention_ratio: float, target_mlp_ratio: float) -> List[str]:
    """The auto allocation (attention first, then MLP), as a list of symbols."""
    layers = [Symbols.MAMBA] * total_layers
    n_att = round(total_layers * target_attention_ratio)
    n_mamba = total_layers - n_att
    section = n_mamba / (n_att + 1)
    x = section
    for layer in range(total_layers):
        if x < 0.5:
            layers[layer] = Symbols.ATTENTION
            x += section
        else:
            x -= 1
    n_mlp = round(total_layers * target_mlp_ratio)
    if n_mlp > 0:
        n_mamba -= n_mlp
        ratio = n_mamba / n_mlp
        x = ratio
        for layer in range(total_layers):
            if layers[layer] == Symbols.MAMBA:
                if x < 0.5:
                    layers[layer] = Symbols.MLP
                    x += ratio
                else:
                    x -= 1
    return layers


def _check_ratios(total_layers, target_attention_ratio, target_mlp_ratio, override_pattern) -> List[str]:
    problems = []
    if not 0.0 <= target_attention_ratio <= 1.0:
        problems.append(f"--hybrid-attention-ratio ({target_attention_ratio}) must be in [0, 1].")
    if not 0.0 <= target_mlp_ratio <= 1.0:
        problems.append(f"--hybrid-mlp-ratio ({target_mlp_ratio}) must be in [0, 1].")
    if target_attention_ratio + target_mlp_ratio > 1.0:
        problems.append(f"--hybrid-attention-ratio ({target_attention_ratio}) + --hybrid-mlp-ratio "
                        f"({target_mlp_ratio}) must be <= 1.")
    if override_pattern is not None:
        if len(override_pattern) != total_layers:
            problems.append(f"--hybrid-override-pattern has {len(override_pattern)} symbols but --num-layers is "
                            f"{total_layers}: give one symbol per layer.")
        bad = sorted(set(override_pattern) - Symbols.VALID)
        if bad:
            problems.append(f"--hybrid-override-pattern contains {bad}: only 'M' (Mamba), '*' (attention) and "
                            "'-' (MLP) are allowed.")
    return problems


def allocate_layers(total_layers_count: int, target_attention_ratio: float, target_mlp_ratio: float,
                    override_pattern: Optional[str] = None) -> List[str]:
    """The symbol of every layer (Megatron's `allocate_layers`); ValueError naming the flags on bad input."""
    problems = _check_ratios(total_layers_count, target_attention_ratio, target_mlp_ratio, override_pattern)
    if problems:
        raise ValueError(" ".join(problems))
    layers = _allocate_auto(total_layers_count, target_attention_ratio, target_mlp_ratio)
    if override_pattern is None:
        return layers
    override = list(override_pattern)
    if target_attention_ratio > 0.0 or target_mlp_ratio > 0.0:
        for symbol, flag in ((Symbols.ATTENTION, "--hybrid-attention-ratio"), (Symbols.MLP, "--hybrid-mlp-ratio")):
            if override.count(symbol) != layers.count(symbol):
                raise ValueError(f"--hybrid-override-pattern has {override.count(symbol)} {symbol!r} layers but "
                                 f"{flag} gives {layers.count(symbol)}: make them agree or drop the ratio.")
    return override


def layer_type_counts(pattern: List[str]) -> dict:
    """{'M': n_mamba, '*': n_attention, '-': n_mlp} of a pattern."""
    return {symbol: pattern.count(symbol) for symbol in (Symbols.MAMBA, Symbols.ATTENTION, Symbols.MLP)}


__all__ = ["Symbols", "allocate_layers", "layer_type_counts"]
