"""The flag-compatibility manifest: every Megatron-LM 0.13.1 flag with its status here.

`manifest.json` maps each flag's first option string to
- `{"status": "supported"}`: the flag works as in Megatron-LM;
- `{"status": "accepted", "reason": ...}`: parsed, but it has no effect here (the reason says why);
- `{"status": "rejected", "reason": ..., "instead": ...}`: giving it a non-default value is a validation error;
- `{"status": "added", "reason": ...}`: a flag of this framework that Megatron-LM does not have (the reason
  says what it decides).
Entries may also carry `aliases` (extra option strings of the same flag) and `rejected_values` (values of a
supported flag that are errors, with the message). The test suite checks that the parser and this manifest
hold the same option strings, and that these are exactly Megatron's flag list plus the `added` ones.
"""
import json
from functools import lru_cache
from pathlib import Path
from typing import Dict, List

MANIFEST_PATH = Path(__file__).with_name("manifest.json")
STATUSES = ("supported", "accepted", "rejected", "added")
NOT_IMPLEMENTED = "is a Megatron-LM flag this framework does not implement yet"


@lru_cache(maxsize=None)
def load_manifest() -> Dict[str, dict]:
    """The manifest as `{first option string: entry}` (read once)."""
    with open(MANIFEST_PATH) as handle:
        return json.load(handle)


def flag_status(option_string: str) -> str:
    """`supported`, `accepted`, `rejected` or `added` for a flag given by any of its option strings."""
    return _entry(option_string)["status"]


def _entry(option_string: str) -> dict:
    manifest = load_manifest()
    if option_string in manifest:
        return manifest[option_string]
    for entry in manifest.values():
        if option_string in entry.get("aliases", ()):
            return entry
    raise KeyError(f"{option_string} is neither a Megatron-LM 0.13.1 flag nor one this framework adds")


def flag_help(option_string: str, help_text=None) -> str:
    """The `--help` text of a flag: its own help plus, unless supported, its manifest status and reason."""
    entry = _entry(option_string)
    parts = [help_text] if help_text else []
    if entry["status"] == "accepted":
        parts.append(f"[accepted, no effect here: {entry['reason']}]")
    elif entry["status"] == "rejected":
        parts.append(f"[not implemented: {entry['reason']}]")
    elif entry["status"] == "added":
        parts.append("[not a Megatron-LM flag]")
    return " ".join(parts)


def rejected_flag_problems(args, actions) -> List[str]:
    """One message per rejected flag set to a non-default value, and per rejected value of a supported flag.

    `actions` are the parser's actions (to know each dest's option string and default).
    """
    problems = []
    manifest = load_manifest()
    for action in actions:
        if not action.option_strings or action.option_strings[0] not in manifest:
            continue
        entry = manifest[action.option_strings[0]]
        value = getattr(args, action.dest, action.default)
        typed = action.option_strings[0]
        if entry["status"] == "rejected" and not _is_default(value, action.default):
            problems.append(_rejection_message(typed, value, action, entry))
        for bad_value, message in entry.get("rejected_values", {}).items():
            if value == bad_value:
                problems.append(f"{typed} {bad_value}: {message}.")
    return problems


# `derive()` turns the precision-aware optimizer's dtype names into torch dtypes; compare them by name so that
# validating an already validated namespace (e.g. one restored from a checkpoint) still sees the default.
_DTYPE_NAMES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.uint8": "fp8"}


def _is_default(value, default) -> bool:
    if isinstance(default, str) and not isinstance(value, str) and str(value) in _DTYPE_NAMES:
        value = _DTYPE_NAMES[str(value)]
    if value is None and default is None:
        return True
    if isinstance(default, bool) or default is None:
        return value == default or (value is False and default is None)
    return value == default


def _rejection_message(typed: str, value, action, entry: dict) -> str:
    shown = typed if action.nargs == 0 else f"{typed} ({value})"
    reason = entry["reason"]
    if reason.startswith("was removed"):
        message = f"{shown} {reason}"
    else:
        message = f"{shown} {NOT_IMPLEMENTED}: {reason}"
    if entry.get("instead"):
        message += f"; use {entry['instead']} instead"
    return message + "."
