"""Turn the data flags into blends: `get_blend_and_blend_per_split(args)`.

Reads `--data-path` / `--data-args-path` (one blend for all splits) or `--train-data-path`,
`--valid-data-path`, `--test-data-path` / `--per-split-data-args-path` (a JSON object with "train",
"valid", "test" lists). Every prefix is checked for its `.bin`/`.idx` pair, and all problems are
reported in one ValueError naming the flag.
"""
import json
from typing import List, Optional, Tuple

from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.utils import get_blend_from_list

Blend = Optional[Tuple[List[str], Optional[List[float]]]]


def _read_blend_file(path: str, flag: str, problems: List[str]) -> Optional[List[str]]:
    try:
        with open(path, encoding="utf-8") as stream:
            return stream.read().split()
    except OSError as err:
        problems.append(f"{flag} {path}: cannot be read ({err.strerror})")
        return None


def _check_prefixes(blend: Blend, flag: str, problems: List[str]) -> None:
    if blend is None:
        return
    for prefix in blend[0]:
        if not IndexedDataset.exists(prefix):
            problems.append(
                f"{flag}: {prefix}.bin/.idx not found (give the path prefix without .bin/.idx, e.g. "
                "out_text_document as written by tools/preprocess_data.py)"
            )


def get_blend_and_blend_per_split(args, check_files: bool = True) -> Tuple[Blend, Optional[List[Blend]]]:
    """(blend, blend_per_split) from the args; at most one of them is not None."""
    problems: List[str] = []
    blend, blend_per_split = None, None
    data_args_path = getattr(args, "data_args_path", None)
    per_split_path = getattr(args, "per_split_data_args_path", None)
    if getattr(args, "data_path", None) is not None or data_args_path is not None:
        flag = "--data-args-path" if data_args_path is not None else "--data-path"
        raw = _read_blend_file(data_args_path, flag, problems) if data_args_path is not None else args.data_path
        blend = get_blend_from_list(raw) if raw else None
        if check_files:
            _check_prefixes(blend, flag, problems)
    elif per_split_path is not None:
        try:
            with open(per_split_path, encoding="utf-8") as stream:
                per_split = json.load(stream)
        except (OSError, ValueError) as err:
            raise ValueError(f"--per-split-data-args-path {per_split_path}: cannot be read as JSON ({err})") from err
        blend_per_split = []
        for key in ("train", "valid", "test"):
            value = per_split.get(key)
            value = value.split() if isinstance(value, str) else value
            blend_per_split.append(get_blend_from_list(value))
            if check_files:
                _check_prefixes(blend_per_split[-1], f"--per-split-data-args-path [{key}]", problems)
    else:
        flags = ("train_data_path", "valid_data_path", "test_data_path")
        if any(getattr(args, f, None) is not None for f in flags):
            blend_per_split = [get_blend_from_list(getattr(args, f, None)) for f in flags]
            if check_files:
                for f, b in zip(flags, blend_per_split):
                    _check_prefixes(b, "--" + f.replace("_", "-"), problems)
    if problems:
        raise ValueError("data paths: " + "; ".join(problems))
    return blend, blend_per_split
