"""Merge every `.bin/.idx` pair in a directory (sorted by name) into one dataset.

Usage: python tools/merge_datasets.py --input DIR --output-prefix OUT [--multimodal]
All inputs must share one token dtype. The output is written to `.partial` names and renamed at
the end, so an interrupted merge never leaves a complete-looking pair.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.core.datasets.indexed_dataset import (  # noqa: E402
    IndexedDataset,
    IndexedDatasetBuilder,
    get_bin_path,
    get_idx_path,
)


def get_args(argv=None):
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--input", type=str, required=True, help="directory holding the .bin/.idx pairs")
    parser.add_argument("--output-prefix", type=str, required=True, help="prefix of the merged output")
    parser.add_argument("--multimodal", action="store_true", help="the datasets carry a modes array")
    return parser.parse_args(argv)


def find_prefixes(directory: str):
    """Sorted prefixes with both files present; raises on an orphan .bin or .idx."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"--input {directory}: not a directory")
    names = sorted(os.listdir(directory))
    stems = {os.path.splitext(n)[0] for n in names if n.endswith((".bin", ".idx"))}
    prefixes = []
    for stem in sorted(stems):
        prefix = os.path.join(directory, stem)
        if not IndexedDataset.exists(prefix):
            raise FileNotFoundError(f"{prefix}: found only one of .bin/.idx")
        prefixes.append(prefix)
    if not prefixes:
        raise FileNotFoundError(f"--input {directory}: no .bin/.idx pairs")
    return prefixes


def main(argv=None) -> int:
    args = get_args(argv)
    try:
        prefixes = find_prefixes(args.input)
        first = IndexedDataset(prefixes[0], multimodal=args.multimodal)
        builder = IndexedDatasetBuilder(get_bin_path(args.output_prefix), dtype=first.index.dtype, multimodal=args.multimodal)
        try:
            for prefix in prefixes:
                IndexedDataset(prefix, multimodal=args.multimodal)
                builder.add_index(prefix)
        except BaseException:
            builder.abort()
            raise
        builder.finalize(get_idx_path(args.output_prefix))
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"merged {len(prefixes)} datasets into {args.output_prefix}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
