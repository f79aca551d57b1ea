"""The "heterogeneous architecture" flags: Megatron-LM's check of the command line against the model's
Hugging Face style config.json (`validate_model_config_args_from_heterogeneous_config`), and the derived JSON.

A heterogeneous (Llama-Nemotron / DeciLM) model takes its per-layer blocks from `block_configs`, but its global
shape from the command line; Megatron requires the two to agree: SwiGLU (`hidden_act` silu), RMSNorm, GQA,
RoPE with Llama-3.1 scaling (`--use-rope-scaling`, `--rope-scaling-factor` = `rope_scaling.factor`,
`--rotary-base` = `rope_theta`, `--rotary-percent 1.0`, `--use-rotary-position-embeddings`), the layer count,
hidden size and heads, untied embeddings unless `tie_word_embeddings`, and `--num-query-groups` = heads //
`n_heads_in_group`, which must be the same in every block that sets it (the per-layer GQA of the core config
is not reachable from the command line in Megatron-LM 0.13.1 either).

As in Megatron, only `--heterogeneous-layers-config-path` selects the heterogeneous model; the encoded JSON alone
is checked but builds the ordinary model (a warning says so). `derive_heterogeneous_config` stores the file's
text in `heterogeneous_layers_config_encoded_json`, which checkpoints keep.
"""
import json
from pathlib import Path
from typing import List, Optional, Tuple

_SOURCE = "--heterogeneous-layers-config-path"


def _read_json(args) -> Tuple[Optional[dict], List[str]]:
    text, source = args.heterogeneous_layers_config_encoded_json, "--heterogeneous-layers-config-encoded-json"
    if text is None:
        source = f"{_SOURCE} ({args.heterogeneous_layers_config_path})"
        try:
            text = Path(args.heterogeneous_layers_config_path).read_text()
        except OSError as error:
            return None, [f"{source} cannot be read ({error}): give the path of the model's config.json."]
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        return None, [f"{source} is not valid JSON ({error})."]
    if not isinstance(document, dict) or not isinstance(document.get("block_configs"), list):
        return None, [f"{source} has no 'block_configs' list: give a Llama-Nemotron / DeciLM style config.json."]
    return document, []


def _heads_in_group(blocks: list) -> Tuple[Optional[int], List[str]]:
    values = []
    for index, block in enumerate(blocks):
        attention = block.get("attention") if isinstance(block, dict) else None
        if not isinstance(attention, dict) or "n_heads_in_group" not in attention:
            return None, [f"{_SOURCE}: block_configs[{index}].attention has no 'n_heads_in_group' (Megatron-LM "
                          "reads it from every block; null for a block without attention)."]
        if attention["n_heads_in_group"] is not None:
            values.append(attention["n_heads_in_group"])
    if not values:
        return None, [f"{_SOURCE}: no block sets 'n_heads_in_group', so --num-query-groups cannot be checked."]
    if any(value != values[0] for value in values):
        return None, [f"{_SOURCE}: n_heads_in_group differs between blocks ({sorted(set(values))}); Megatron-LM "
                      "needs the same query-head grouping in every layer that has attention."]
    return values[0], []


def _expected_args(document: dict, heads_in_group: int) -> Tuple[dict, List[str]]:
    """{args attribute: value the config demands}; missing config keys are reported."""
    required = ("hidden_act", "num_hidden_layers", "hidden_size", "num_attention_heads", "tie_word_embeddings",
                "rope_theta", "rope_scaling")
    missing = [key for key in required if key not in document]
    if missing or not isinstance(document["rope_scaling"], dict) or "factor" not in document["rope_scaling"]:
        return {}, [f"{_SOURCE}: the config lacks {', '.join(missing) or 'rope_scaling.factor'} (Megatron-LM reads "
                    "them to check the command line)."]
    problems = []
    if document["hidden_act"] != "silu":
        problems.append(f"{_SOURCE}: hidden_act is {document['hidden_act']!r}; Megatron-LM supports 'silu' only.")
    heads = document["num_attention_heads"]
    expected = {
        "swiglu": True, "normalization": "RMSNorm", "group_query_attention": True, "position_embedding_type": "rope",
        "rotary_percent": 1.0, "use_rope_scaling": True, "use_rotary_position_embeddings": True,
        "num_layers": document["num_hidden_layers"], "hidden_size": document["hidden_size"],
        "num_attention_heads": heads, "untie_embeddings_and_output_weights": not document["tie_word_embeddings"],
        "rotary_base": document["rope_theta"], "rope_scaling_factor": document["rope_scaling"]["factor"],
        "num_query_groups": heads // heads_in_group if isinstance(heads, int) and heads_in_group else None,
    }
    return expected, problems


def _mismatch(name: str, expected, given) -> str:
    flag = "--" + name.replace("_", "-")
    if isinstance(expected, bool):
        return f"{flag} (missing)" if expected else f"no {flag} (given)"
    return f"{flag} {expected} (given: {given})"


def heterogeneous_config_problems(args) -> List[str]:
    """Megatron-LM's rules for `--heterogeneous-layers-config-path` / `-encoded-json` (empty when unused)."""
    if args.heterogeneous_layers_config_path is None and args.heterogeneous_layers_config_encoded_json is None:
        return []
    problems = []
    if args.multi_latent_attention:
        problems.append(f"{_SOURCE} cannot be combined with --multi-latent-attention.")
    document, read_problems = _read_json(args)
    if document is None:
        return problems + read_problems
    heads_in_group, group_problems = _heads_in_group(document["block_configs"])
    if heads_in_group is None:
        return problems + group_problems
    expected, config_problems = _expected_args(document, heads_in_group)
    problems += config_problems
    mismatches = [_mismatch(name, value, getattr(args, name, None))
                  for name, value in expected.items() if getattr(args, name, None) != value]
    if mismatches:
        problems.append(f"{_SOURCE}: the command line differs from the model's config.json; pass "
                        + "; ".join(mismatches) + ".")
    return problems


def derive_heterogeneous_config(args) -> None:
    """Keep the config file's text in `heterogeneous_layers_config_encoded_json` (Megatron's validate_args)."""
    if args.heterogeneous_layers_config_path is not None and args.heterogeneous_layers_config_encoded_json is None:
        args.heterogeneous_layers_config_encoded_json = Path(args.heterogeneous_layers_config_path).read_text()
    elif args.heterogeneous_layers_config_encoded_json is not None and args.heterogeneous_layers_config_path is None:
        if getattr(args, "rank", 0) == 0:
            print("WARNING: --heterogeneous-layers-config-encoded-json without --heterogeneous-layers-config-path "
                  "builds the ordinary (homogeneous) model, as in Megatron-LM: only the path selects the "
                  "heterogeneous layer spec.", flush=True)


__all__ = ["heterogeneous_config_problems", "derive_heterogeneous_config"]
