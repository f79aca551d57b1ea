"""The parser against Megatron-LM 0.13.1's flag list, the manifest, odd spellings and argument types."""
import argparse
import json
from pathlib import Path

import pytest

from megatron.core.transformer.enums import AttnBackend
from megatron.training.arguments import ArgumentsError, _parse, build_parser, get_rank_and_world_size
from megatron.training.arguments.flags_doc import render_flags_markdown
from megatron.training.arguments.manifest import STATUSES, load_manifest

FLAGS_JSON = Path(__file__).resolve().parents[3] / ".." / "shared" / "spec" / "megatron_flags.json"
ACTION_NAMES = {
    argparse._StoreAction: "_StoreAction",
    argparse._StoreTrueAction: "_StoreTrueAction",
    argparse._StoreFalseAction: "_StoreFalseAction",
}
# Megatron registers `--attention-backend` with an anonymous lambda; ours is a named function.
TYPE_NAMES = {"attention_backend_type": "<lambda>"}


@pytest.fixture(scope="module")
def megatron_flags():
    if not FLAGS_JSON.exists():
        pytest.skip(f"{FLAGS_JSON} not available")
    return json.loads(FLAGS_JSON.read_text())


@pytest.fixture(scope="module")
def parser_actions():
    parser = build_parser()
    groups = {id(a): g.title for g in parser._action_groups for a in g._group_actions}
    actions = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    return actions, groups


def _json_value(value):
    """Render a parser value the way megatron_flags.json records it."""
    if isinstance(value, AttnBackend):
        return repr(value)
    if isinstance(value, list):
        return [_json_value(v) for v in value]
    return value


def test_parser_manifest_and_megatron_flags_agree(megatron_flags, parser_actions):
    actions, groups = parser_actions
    parser_options = {s for a in actions for s in a.option_strings}
    json_options = {s for entry in megatron_flags for s in entry["flags"]}
    manifest = load_manifest()
    manifest_options = set(manifest) | {s for e in manifest.values() for s in e.get("aliases", ())}
    added = {flag for flag, entry in manifest.items() if entry["status"] == "added"}
    assert added == {"--compile-layers", "--compile-linears", "--fusion-kernels", "--tp-comm-overlap-transport"}
    assert parser_options == manifest_options == json_options | added and not json_options & added
    assert len(actions) == len(manifest) == len(megatron_flags) + len(added) and len(megatron_flags) == 501
    added_groups = {groups[id(a)] for a in actions if a.option_strings[0] in added}
    assert added_groups == {"optimization plan"}

    by_first = {a.option_strings[0]: a for a in actions}
    mismatches = []
    for entry in megatron_flags:
        action = by_first[entry["flags"][0]]
        type_name = None if action.type is None else TYPE_NAMES.get(action.type.__name__, action.type.__name__)
        got = {
            "flags": list(action.option_strings), "dest": action.dest, "action": ACTION_NAMES[type(action)],
            "type": type_name, "default": _json_value(action.default),
            "choices": None if action.choices is None else _json_value(list(action.choices)),
            "nargs": action.nargs, "required": action.required, "const": action.const, "group": groups[id(action)],
        }
        for key, value in got.items():
            if entry[key] != value or type(entry[key]) is not type(value) and entry[key] is not None:
                if not (isinstance(value, float) and entry[key] == value):
                    mismatches.append(f"{entry['flags'][0]} {key}: megatron {entry[key]!r}, ours {value!r}")
    assert not mismatches, "\n".join(mismatches)


def test_manifest_entries_are_well_formed():
    for flag, entry in load_manifest().items():
        assert entry["status"] in STATUSES, flag
        if entry["status"] != "supported":
            assert entry.get("reason"), f"{flag} needs a reason"
    manifest = load_manifest()
    assert manifest["--use-custom-fsdp"]["instead"] == "--use-torch-fsdp2"
    assert manifest["--transformer-impl"]["status"] == "supported"
    assert "zarr" in manifest["--ckpt-format"]["rejected_values"]
    for flag in ("--no-persist-layer-norm", "--no-gradient-accumulation-fusion", "--no-rope-fusion",
                 "--use-flash-attn"):
        assert manifest[flag]["status"] == "accepted", flag
    assert manifest["--fp8-format"]["status"] == "supported" and "mxfp8" in manifest["--fp8-recipe"]["rejected_values"]
    for flag in ("--moe-use-upcycling", "--multi-latent-attention", "--fp8-param-gather",
                 "--use-legacy-models", "--mtp-num-layers"):
        assert manifest[flag]["status"] == "rejected", flag
    for flag in ("--num-layers", "--swiglu", "--use-torch-fsdp2", "--use-distributed-optimizer", "--ckpt-format",
                 "--optimizer-cpu-offload", "--heterogeneous-layers-config-path",
                 "--num-experts", "--expert-model-parallel-size", "--moe-grouped-gemm", "--context-parallel-size",
                 "--cp-comm-type", "--hierarchical-context-parallel-sizes"):
        assert manifest[flag]["status"] == "supported", flag


def test_defaults_odd_spellings_and_types():
    args = _parse([])
    assert args.ckpt_format == "torch_dist" and args.transformer_impl == "transformer_engine"
    assert args.no_save_optim is None and args.async_save is None and args.use_cpu_initialization is None
    assert args.masked_softmax_fusion is True and args.apply_rope_fusion is True and args.add_bias_linear is True
    assert args.attention_backend is AttnBackend.auto and args.initial_loss_scale == 2**32
    assert args.iterations_to_skip == [] and args.cp_comm_type == ["p2p"] and args.profile_ranks == [0]
    args = _parse([
        "--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler", "--persistent-save-interval", "7",
        "--inference-max-requests", "3", "--fp8-format", "hybrid", "--no-rope-fusion", "--disable-bias-linear",
        "--moe-layer-freq", "([1]*3+[0])*2", "--no-rope-freq", "4", "--attention-backend", "flash",
        "--rampup-batch-size", "4", "4", "100", "--data-path", "0.3", "a", "0.7", "b",
    ])
    assert args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler
    assert args.save_interval == 7 and args.inference_max_batch_size == 3 and args.fp8 == "hybrid"
    assert args.apply_rope_fusion is False and args.add_bias_linear is False
    assert args.moe_layer_freq == [1, 1, 1, 0, 1, 1, 1, 0] and args.no_rope_freq == 4
    assert args.attention_backend is AttnBackend.flash
    assert args.rampup_batch_size == ["4", "4", "100"] and args.data_path == ["0.3", "a", "0.7", "b"]
    assert _parse(["--moe-layer-freq", "[0,1]*2"]).moe_layer_freq == [0, 1, 0, 1]
    for bad in (["--moe-layer-freq", "__import__('os').getcwd()"], ["--moe-layer-freq", "[1]*x"],
                ["--no-rope-freq", "two"], ["--num-layers", "x"], ["--attention-backend", "magic"],
                ["--ckpt-format", "pickle"]):
        with pytest.raises(ArgumentsError) as err:
            _parse(bad)
        assert bad[0] in str(err.value), bad
    with pytest.raises(ArgumentsError) as err:
        _parse("--num-layers x --hidden-size 16 --ckpt-format pickle --bogus --persistent-save-interval=y "
               "--micro-batch-size".split())
    problems = err.value.problems
    assert len(problems) == 5, problems
    for piece, problem in zip(["--num-layers: invalid int value: 'x'", "--ckpt-format: invalid choice: 'pickle'",
                               "--persistent-save-interval: invalid int value: 'y'",
                               "--micro-batch-size: expected one argument", "unrecognized argument --bogus"],
                              problems):
        assert piece in problem, (piece, problem)


def test_unknown_and_abbreviated_flags_are_collected_not_fatal():
    args = _parse(["--num-layer", "2", "--hidden-size", "16", "--frobnicate=3", "--lr", "-0.5"])
    assert args.hidden_size == 16 and args.num_layers is None and args.lr == -0.5
    problems = args._unknown_args
    assert len(problems) == 2
    assert "--num-layer 2" in problems[0] and "did you mean --num-layers?" in problems[0]
    assert "--frobnicate=3" in problems[1] and "did you mean" not in problems[1]
    assert _parse(["--num-layer", "2"], ignore_unknown_args=True)._unknown_args == []

    def extra(parser):
        parser.add_argument("--my-script-flag", type=int, default=5)
        return parser

    args = _parse(["--my-script-flag", "9"], extra_args_provider=extra)
    assert args.my_script_flag == 9 and args._unknown_args == []


def test_rank_and_world_size_from_environment():
    assert get_rank_and_world_size({}) == (0, 1)
    assert get_rank_and_world_size({"RANK": "3", "WORLD_SIZE": "8"}) == (3, 8)
    with pytest.raises(ArgumentsError, match="WORLD_SIZE"):
        get_rank_and_world_size({"WORLD_SIZE": "eight"})


def test_flags_doc_matches_manifest():
    doc = Path(__file__).resolve().parents[3] / "docs" / "flags.md"
    assert doc.read_text() == render_flags_markdown(), (
        "docs/flags.md is stale: run python -m megatron.training.arguments.flags_doc > docs/flags.md"
    )
