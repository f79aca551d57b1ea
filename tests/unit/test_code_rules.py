"""Architecture and habit rules from the style guide, checked on the source tree.

- `megatron/core` never imports `megatron.training` and never calls `get_args()`.
- The import graph of `megatron/core` (function-level imports included) has no cycle and follows the
  layering table of docs/design.md ("Layering of `megatron/core`"); compatibility re-exports are the one
  table `megatron/core/reexports.py` (every entry resolves; no other module defines a `__getattr__`).
- `megatron/core` reads no environment variable outside `ENVIRONMENT_ALLOW_LIST`.
- `megatron/core/{pipeline_parallel,distributed,optimizer}` do not import the model packages.
- Layers (transformer, models, fusions, tensor_parallel and context_parallel outside their communication
  modules) make no collective calls; pipeline p2p lives only in `pipeline_parallel/p2p_communication.py`.
- Files stay <= 1200 lines and functions <= 150 lines (hard limits; the soft 800/80 are reported).
- Importing every module prints nothing and loads no optional dependency.
"""
import ast
import importlib
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
    "megatron/core/tensor_parallel/peer_copy.py":
        "the copy-engine transport of --tp-comm-overlap (symmetric-memory rendezvous and barriers)",
    "megatron/core/tensor_parallel/data.py": "broadcast_data: the TP broadcast of a batch",
    "megatron/core/models/common/language_module/language_module.py":
        "one-time all-reduce that makes the tied output-layer copy equal to the embedding at init",
    "megatron/core/context_parallel/comm.py": "owns every context-parallel collective (ring, all-gather, all-to-all)",
}
OPTIONAL_PACKAGES = ["transformer_engine", "apex", "flash_attn", "mamba_ssm", "wandb", "tensorboard", "nltk"]

# The only places in megatron/core that touch environment variables, and why. Everything else that decides how
# the code runs is a config field set from a flag (the optimisation plan, docs/design.md).
ENVIRONMENT_ALLOW_LIST = {
    "megatron/core/models/common/language_module/language_module.py":
        "sets Transformer Engine's NVTE_* attention-backend variables for --attention-backend, as Megatron does",
    "megatron/core/rerun_state_machine.py":
        "writes SLURM_JOBID into the rejected-result tracker file's lines (a record, not a code path), as Megatron does",
}


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


def _module_name(path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _core_modules():
    return {_module_name(path): path for path in _py_files(CORE)}


def _deepest_module(name, modules):
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name


def _import_edges(modules):
    """(importer, imported, line) for every import statement of megatron.core into megatron.core, at module
    level or inside a function, relative imports resolved; `from pkg import name` counts pkg.name when that
    is a module."""
    for importer, path in modules.items():
        package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
        for node in ast.walk(_parse(path)):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            for target in targets:
                imported = _deepest_module(target, modules) if target.startswith("megatron.core") else ""
                if imported and imported != importer:
                    yield importer, imported, node.lineno


def _layering():
    """(module prefix -> layer, layer -> layers it may import, transitively) from docs/design.md."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("## Layering of `megatron/core`", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| layer |")]
    prefixes, direct = {}, {}
    for row in rows:
        layer, modules, may_import = (cell.strip() for cell in row.strip("|").split("|"))
        direct[layer] = {name.strip() for name in may_import.split(",") if name.strip() not in ("", "-")}
        for module in modules.split(","):
            module = module.strip().strip("`")
            prefixes["megatron.core" if module == "megatron.core" else f"megatron.core.{module}"] = layer
    allowed = {}
    for layer in direct:
        reach, todo = set(), [layer]
        while todo:
            for below in direct[todo.pop()]:
                assert below in direct, f"docs/design.md layering: unknown layer {below!r}"
                if below not in reach:
                    reach.add(below)
                    todo.append(below)
        allowed[layer] = reach | {layer}
    return prefixes, allowed


def _layer_of(module, prefixes):
    """The layer of the longest entry that is `module` or a package above it; the root `megatron.core` entry
    is the package module alone (a new top-level module has to be placed in the table)."""
    matches = [prefix for prefix in prefixes
               if module == prefix or (prefix != "megatron.core" and module.startswith(prefix + "."))]
    return prefixes[max(matches, key=len)] if matches else None


def _cycles(edges):
    """The strongly connected components with more than one module (Tarjan)."""
    graph = {}
    for importer, imported, _ in edges:
        graph.setdefault(importer, set()).add(imported)
        graph.setdefault(imported, set())
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for succ in graph[node]:
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_core_import_graph_has_no_cycle_and_follows_the_documented_layering():
    modules = _core_modules()
    edges = list(_import_edges(modules))
    prefixes, allowed = _layering()
    unplaced = sorted(module for module in modules if _layer_of(module, prefixes) is None)
    assert not unplaced, f"modules in no layer of docs/design.md: {unplaced}"
    climbing = []
    for importer, imported, line in edges:
        source, target = _layer_of(importer, prefixes), _layer_of(imported, prefixes)
        if target not in allowed[source]:
            climbing.append(f"{importer}:{line} ({source}) imports {imported} ({target})")
    assert not climbing, "imports that climb the layering of docs/design.md:\n" + "\n".join(climbing)
    cycles = _cycles(edges)
    assert not cycles, "import cycles in megatron.core: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_layering_test_can_fail():
    """A fp8 module importing the tensor-parallel layers, a lazy import inside a function, and a two-module
    cycle are caught (on synthetic edges: the same functions as the real check)."""
    prefixes, allowed = _layering()
    source = _layer_of("megatron.core.fp8.recipe", prefixes)
    assert _layer_of("megatron.core.tensor_parallel.mappings", prefixes) not in allowed[source]
    assert _layer_of("megatron.core.transformer.transformer_config", prefixes) == "base"
    assert _layer_of("megatron.core.optimization_plan.resolve", prefixes) in allowed["transformer"]
    assert "extensions" not in allowed["transformer"]
    assert _layer_of("megatron.core.a_new_top_level_module", prefixes) is None  # must be placed explicitly
    tree = ast.parse("def f():\n    from megatron.core.tensor_parallel import mappings\n")
    path = CORE / "fp8" / "recipe.py"
    modules = {"megatron.core.fp8.recipe": path, "megatron.core.tensor_parallel.mappings": path}
    original = globals()["_parse"]
    try:
        globals()["_parse"] = lambda _path: tree
        edges = list(_import_edges({"megatron.core.fp8.recipe": path, **modules}))
    finally:
        globals()["_parse"] = original
    assert ("megatron.core.fp8.recipe", "megatron.core.tensor_parallel.mappings", 2) in edges
    assert _cycles([("a", "b", 1), ("b", "a", 1), ("b", "c", 1)]) == [["a", "b"]]


def test_compatibility_reexports_are_one_table_and_resolve():
    from megatron.core import reexports

    modules = _core_modules()
    with_getattr = sorted(
        name for name, path in modules.items()
        if any(isinstance(node, ast.FunctionDef) and node.name == "__getattr__" for node in _parse(path).body))
    assert with_getattr == sorted(reexports.LAZY_ATTRIBUTES), "a module-level __getattr__ outside the table"
    for module_name, names in reexports.LAZY_ATTRIBUTES.items():
        module = importlib.import_module(module_name)
        for name, target in names.items():
            target_module, _, attribute = target.partition(":")
            expected = importlib.import_module(target_module)
            if attribute:
                expected = getattr(expected, attribute)
            assert reexports.lazy_attribute(module_name, name) is expected, f"{module_name}.{name}"
            assert getattr(module, name) is expected, f"{module_name}.{name} is not cached on the module"
    for shim in reexports.SHIM_MODULES:
        assert shim in modules, shim


def _environment_reads(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv", "unsetenv"):
            if isinstance(node.value, ast.Name) and node.value.id == "os":
                yield node.lineno, f"os.{node.attr}"
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            for alias in node.names:
                if alias.name in ("environ", "getenv", "putenv", "unsetenv"):
                    yield node.lineno, f"from os import {alias.name}"


def test_core_reads_no_environment_variable_outside_the_allow_list():
    problems = []
    for path in _py_files(CORE):
        if _rel(path) in ENVIRONMENT_ALLOW_LIST:
            continue
        for lineno, use in _environment_reads(_parse(path)):
            problems.append(f"{_rel(path)}:{lineno} uses {use}: make it a config field set from a flag")
    assert not problems, "\n".join(problems)
    assert sorted(_environment_reads(ast.parse("import os\nx = os.environ.get('A')\nfrom os import getenv\n"))) == [
        (2, "os.environ"), (3, "from os import getenv")]
    for allowed in ENVIRONMENT_ALLOW_LIST:
        assert list(_environment_reads(_parse(ROOT / allowed))), f"{allowed} no longer needs its allow-list entry"


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
    for package in ("transformer", "models", "fusions", "tensor_parallel", "context_parallel"):
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
    skip = {".venv", ".ci-venv", "build", ".git", "__pycache__", ".bench"}  # .bench: third-party sources the benchmarks read
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
