"""Helpers over nested dicts and lists (state dicts): map, filter, merge, compare."""
from collections import defaultdict
from typing import Any, Callable, Dict, Iterable, Iterator, List, Tuple, Union

import torch

NestedContainer = Union[Dict, List]


def dict_list_map_inplace(fn: Callable, x: Any) -> Any:
    """Replace every leaf `v` of nested dicts/lists `x` with `fn(v)`, in place; returns `x`."""
    if isinstance(x, dict):
        for key, value in x.items():
            x[key] = dict_list_map_inplace(fn, value)
    elif isinstance(x, list):
        x[:] = (dict_list_map_inplace(fn, value) for value in x)
    else:
        return fn(x)
    return x


def dict_list_map_outplace(fn: Callable, x: Any) -> Any:
    """A copy of nested dicts/lists `x` with every leaf `v` replaced by `fn(v)`."""
    if isinstance(x, dict):
        return {key: dict_list_map_outplace(fn, value) for key, value in x.items()}
    if isinstance(x, list):
        return [dict_list_map_outplace(fn, value) for value in x]
    return fn(x)


def extract_matching_values(
    x: NestedContainer, predicate: Callable[[Any], bool], return_lists_as_dicts: bool = False
) -> Tuple[NestedContainer, NestedContainer]:
    """Split `x` into (leaves matching `predicate`, the rest), keeping the nesting; empty branches vanish."""

    def _split_list(items):
        if return_lists_as_dicts:
            return extract_matching_values(dict(enumerate(items)), predicate, True)
        matching, other = [], []
        for value in items:
            if isinstance(value, (dict, list)):
                sub_match, sub_other = extract_matching_values(value, predicate, return_lists_as_dicts)
                if sub_match:
                    matching.append(sub_match)
                if sub_other:
                    other.append(sub_other)
            elif predicate(value):
                matching.append(value)
            else:
                other.append(value)
        return matching, other

    if isinstance(x, list):
        return _split_list(x)
    if not isinstance(x, dict):
        raise TypeError(f"extract_matching_values expects a dict or list, got {type(x).__name__}")
    matching, other = {}, {}
    for key, value in x.items():
        if isinstance(value, (dict, list)):
            sub_match, sub_other = extract_matching_values(value, predicate, return_lists_as_dicts)
            if sub_match:
                matching[key] = sub_match
            if sub_other:
                other[key] = sub_other
        elif predicate(value):
            matching[key] = value
        else:
            other[key] = value
    return matching, other


def nested_values(x: Any) -> Iterator[Any]:
    """Every leaf of nested dicts/lists `x`."""
    values = x.values() if isinstance(x, dict) else x
    for value in values:
        if isinstance(value, (dict, list)):
            yield from nested_values(value)
        else:
            yield value


def nested_items_iter(x: Any) -> Iterator[Tuple[Any, Any]]:
    """(key, leaf) pairs of nested dicts/lists `x` (key of the innermost container)."""
    items = x.items() if isinstance(x, dict) else enumerate(x)
    for key, value in items:
        if isinstance(value, (dict, list)):
            yield from nested_items_iter(value)
        else:
            yield key, value


def merge(x1: NestedContainer, x2: NestedContainer, key: Tuple[str, ...] = ()) -> NestedContainer:
    """Merge `x2` into `x1` in place (dicts by key, lists by position); returns `x1`."""
    if isinstance(x1, dict) and isinstance(x2, dict):
        for k, v2 in x2.items():
            if k in x1:
                x1[k] = merge(x1[k], v2, key=key + (k,))
            else:
                x1[k] = v2
    elif isinstance(x1, list) and isinstance(x2, list):
        if len(x1) != len(x2):
            raise ValueError(
                f"cannot merge two lists of different lengths ({len(x1)} and {len(x2)}) at key {key}"
            )
        for i, v2 in enumerate(x2):
            x1[i] = merge(x1[i], v2, key=key + (i,))
    else:
        raise ValueError(f"cannot merge {type(x1).__name__} with {type(x2).__name__} at key {key}")
    return x1


def diff(x1: Any, x2: Any, prefix: Tuple = ()) -> Tuple[list, list, list]:
    """(keys only in x1, keys only in x2, keys whose values differ) between two nested containers."""
    mismatch = []
    if isinstance(x1, dict) and isinstance(x2, dict):
        only_left = [prefix + (k,) for k in x1.keys() - x2.keys()]
        only_right = [prefix + (k,) for k in x2.keys() - x1.keys()]
        for k in x1.keys() & x2.keys():
            sub = diff(x1[k], x2[k], prefix + (k,))
            only_left.extend(sub[0])
            only_right.extend(sub[1])
            mismatch.extend(sub[2])
    elif isinstance(x1, list) and isinstance(x2, list):
        only_left = [prefix + (i,) for i in range(len(x2), len(x1))]
        only_right = [prefix + (i,) for i in range(len(x1), len(x2))]
        for i, (a, b) in enumerate(zip(x1, x2)):
            sub = diff(a, b, prefix + (i,))
            only_left.extend(sub[0])
            only_right.extend(sub[1])
            mismatch.extend(sub[2])
    else:
        only_left, only_right = [], []
        if isinstance(x1, torch.Tensor) and isinstance(x2, torch.Tensor):
            equal = x1.shape == x2.shape and bool((x1 == x2).all())
        else:
            try:
                equal = bool(x1 == x2)
            except RuntimeError:
                equal = False
        if not equal:
            mismatch.append((prefix, type(x1), type(x2)))
    return only_left, only_right, mismatch


def map_reduce(xs: Iterable, key_fn: Callable = lambda x: x, value_fn: Callable = lambda x: x,
               reduce_fn: Callable = lambda x: x) -> dict:
    """Group `value_fn(x)` of every `x` in `xs` by `key_fn(x)` (first-seen key order, values in input order),
    then replace each group's list by `reduce_fn(list)` (the `more_itertools.map_reduce` interface)."""
    groups: Dict[Any, List[Any]] = defaultdict(list)
    for x in xs:
        groups[key_fn(x)].append(value_fn(x))
    return {key: reduce_fn(values) for key, values in groups.items()}
