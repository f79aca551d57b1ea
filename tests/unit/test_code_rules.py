"""Architecture and habit rules from the style guide, checked on the source tree.

- `megatron/core` never imports `megatron.training` and never calls `get_args()`.
- `megatron/core/{pipeline_parallel,distributed,optimizer}` do not import the model packages.
- Layers (transformer, models, fusions, tensor_parallel outside its communication modules) make no
  collective calls; pipeline p2p lives only in `pipeline_parallel/p2p_communication.py`.
- Files stay <= 1200 lines and functions <= 150 lines (hard limits; the soft 800/80 are reported).
- Importing every module prints nothing and loads no optional dependency.
"""
import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "megatron" / "core"

COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base", "reduce_scatter",
    "reduce_scatter_tensor", "_reduce_scatter_base", "broadcast", "all_to_all", "all_to_all_single",
    "send", "recv", "isend", "irecv", "batch_isend_irecv", "barrier", "gather", "scatter", "reduce",
    "all_gather_object", "broadcast_object_list",
}
P2P = {"send", "recv", "isend", "irecv", "batch_isend_irecv", "P2POp"}

# Modules allowed to communicate, and why.
COMMUNICATION_EXCEPTIONS = {
    "megatron/core/tensor_parallel/mappings.py": "owns every tensor-parallel collective",
    "megatron/core/tensor_parallel/data.py": "broadcast_data: the TP broadcast of a batch",
    "megatron/core/models/common/language_module/language_module.py":
        "one-time all-reduce that makes the tied output-layer copy equal to the embedding at init",
}
OPTIONAL_PACKAGES = ["transformer_engine", "apex", "flash_attn", "mamba_ssm", "wandb", "tensorboard", "nltk"]


def _py_files(base):
    return sorted(p for p in base.rglob("*.py") if "__pycache__" not in p.parts)


def _rel(path):
    return path.relative_to(ROOT).as_posix()


def _parse(path):
    return ast.parse(path.read_text(), filename=str(path))


def _imported_modules(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module
            for alias in node.names:
                yield node.lineno, f"{node.module}.{alias.name}"


def _attr_chain(node):
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return list(reversed(parts))


def _distributed_calls(tree, names):
    """Calls like torch.distributed.all_reduce(...) or dist.all_reduce(...)."""
    aliases = {"dist", "torch_dist", "distributed"}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        chain = _attr_chain(node.func)
        if len(chain) >= 2 and chain[-1] in names:
            owner = chain[:-1]
            if "distributed" in owner or owner[-1] in aliases:
                yield node.lineno, ".".join(chain)


def test_core_never_imports_training_or_calls_get_args():
    problems = []
    for path in _py_files(CORE):
        tree = _parse(path)
        for lineno, module in _imported_modules(tree):
            if module == "megatron.training" or module.startswith("megatron.training."):
                problems.append(f"{_rel(path)}:{lineno} imports {module}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _attr_chain(node.func)[-1:] == ["get_args"]:
                problems.append(f"{_rel(path)}:{node.lineno} calls get_args()")
    assert not problems, "\n".join(problems)


def test_lower_core_packages_do_not_import_models():
    problems = []
    for package in ("pipeline_parallel", "distributed", "optimizer"):
        for path in _py_files(CORE / package):
            for lineno, module in _imported_modules(_parse(path)):
                if module.startswith(("megatron.core.transformer", "megatron.core.models")):
                    problems.append(f"{_rel(path)}:{lineno} imports {module}")
    assert not problems, "\n".join(problems)


def test_layers_make_no_collective_calls():
    problems = []
    for package in ("transformer", "models", "fusions", "tensor_parallel"):
        for path in _py_files(CORE / package):
            if _rel(path) in COMMUNICATION_EXCEPTIONS:
                continue
            for lineno, call in _distributed_calls(_parse(path), COLLECTIVES):
                problems.append(f"{_rel(path)}:{lineno} calls {call}")
    assert not problems, "\n".join(problems)


def test_pipeline_p2p_only_in_p2p_communication():
    problems = []
    for path in _py_files(CORE / "pipeline_parallel"):
        if path.name == "p2p_communication.py":
            continue
        for lineno, call in _distributed_calls(_parse(path), P2P):
            problems.append(f"{_rel(path)}:{lineno} calls {call}")
    assert not problems, "\n".join(problems)


def _source_files():
    skip = {".venv", ".ci-venv", "build", ".git", "__pycache__"}
    for path in ROOT.rglob("*.py"):
        if not skip.intersection(path.relative_to(ROOT).parts):
            yield path


def test_file_and_function_sizes():
    problems, soft = [], []
    for path in _source_files():
        source = path.read_text()
        lines = source.count("\n")
        if lines > 1200:
            problems.append(f"{_rel(path)}: {lines} lines (limit 1200)")
        elif lines > 800:
            soft.append(f"{_rel(path)}: {lines} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > 150:
                    problems.append(f"{_rel(path)}:{node.lineno} {node.name}: {length} lines (limit 150)")
                elif length > 80:
                    soft.append(f"{_rel(path)}:{node.lineno} {node.name}: {length} lines")
    if soft:
        print("over the soft size limits (800 lines / 80 lines):\n  " + "\n  ".join(sorted(soft)))
    assert not problems, "\n".join(problems)


_IMPORT_ALL = r"""
import importlib, pkgutil, sys
import megatron
names = []
for info in pkgutil.walk_packages(megatron.__path__, "megatron."):
    names.append(info.name)
for name in sorted(names):
    importlib.import_module(name)
optional = %r
loaded = [m for m in optional if m in sys.modules]
if loaded:
    raise SystemExit("optional packages imported at import time: " + ", ".join(loaded))
"""


def test_importing_every_module_is_silent_and_loads_no_optional_dependency():
    code = _IMPORT_ALL % (OPTIONAL_PACKAGES,)
    env = dict(os.environ, PYTHONWARNINGS="default")
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout == "" and proc.stderr == "", f"import printed:\n{proc.stdout}{proc.stderr}"
