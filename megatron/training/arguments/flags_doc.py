"""Render `docs/flags.md` (the flag-compatibility summary) from the parser and `manifest.json`.

Regenerate with `python -m megatron.training.arguments.flags_doc > docs/flags.md`; a test checks that
the checked-in file matches.
"""
from collections import Counter

from megatron.training.arguments.manifest import load_manifest
from megatron.training.arguments.parser import build_parser

_INTRO = """# Megatron-LM flags

Every command-line flag of Megatron-LM `core_v0.13.1` (501 of them) is parsed here with the same option
strings, dest, type, default, choices and nargs, so existing `torchrun pretrain_gpt.py ...` command lines
keep working. Each flag has one status (source: `megatron/training/arguments/manifest.json`):

- **supported**: behaves as in Megatron-LM;
- **accepted**: parsed, but has no effect here (the note says why, e.g. a Transformer Engine or Apex kernel
  toggle whose native replacement is always used);
- **rejected**: giving it a non-default value fails validation with
  "`--foo` is a Megatron-LM flag this framework does not implement yet", plus what to use instead;
- **added**: not a Megatron-LM flag; this framework's own (group "optimization plan": decisions of the
  optimisation plan that Megatron makes without a flag or not at all, see docs/design.md).

A bad command line fails once, listing every problem (unknown flags with a "did you mean", rejected flags,
rule violations). Prefixes of flags are not accepted (`allow_abbrev=False`).
"""


def _note(entry: dict) -> str:
    parts = []
    if entry.get("reason"):
        parts.append(entry["reason"])
    if entry.get("instead"):
        parts.append(f"use {entry['instead']}")
    for value, message in entry.get("rejected_values", {}).items():
        parts.append(f"value `{value}` rejected: {message}")
    return "; ".join(parts).replace("|", "\\|")


def render_flags_markdown() -> str:
    """The full text of docs/flags.md."""
    manifest = load_manifest()
    counts = Counter(entry["status"] for entry in manifest.values())
    lines = [_INTRO, f"Totals: {counts['supported']} supported, {counts['accepted']} accepted, "
             f"{counts['rejected']} rejected; {counts['added']} added.", ""]
    parser = build_parser()
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.option_strings and a.option_strings[0] in manifest]
        if not actions:
            continue
        lines += [f"## {group.title}", "", "| flag | status | note |", "|---|---|---|"]
        for action in actions:
            entry = manifest[action.option_strings[0]]
            names = " / ".join(f"`{s}`" for s in action.option_strings)
            lines.append(f"| {names} | {entry['status']} | {_note(entry)} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(render_flags_markdown(), end="")
