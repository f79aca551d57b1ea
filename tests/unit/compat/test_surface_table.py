"""`docs/megatron_core_surface.md` matches the code: every name it marks as present can be imported from its
Megatron module path, and no name it marks as absent (`missing`, `later: ...`) exists there (so the table
cannot go stale when a name is added)."""
import importlib
import re
from pathlib import Path

import pytest

TABLE = Path(__file__).resolve().parents[3] / "docs" / "megatron_core_surface.md"
_ROW = re.compile(r"^\| `(?P<module>[\w.]+)` \| `(?P<name>\w+)` \| (?P<status>[^|]+?) \|")
_STATUSES = ("here", "here (native)", "alias", "missing")


def _rows():
    rows = []
    for line in TABLE.read_text(encoding="utf-8").splitlines():
        match = _ROW.match(line)
        if match:
            rows.append((match["module"], match["name"], match["status"].strip()))
    return rows


def _resolve(path: str):
    """A module by dotted path, or an attribute of a module (`megatron.core.mpu` is an attribute alias)."""
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError:
        parent, _, attr = path.rpartition(".")
        return getattr(importlib.import_module(parent), attr)


def test_table_is_well_formed():
    rows = _rows()
    assert len(rows) > 600, "the surface table lost its rows"
    bad = [(m, n, s) for m, n, s in rows if s not in _STATUSES and not s.startswith("later: ")]
    assert not bad, f"unknown statuses: {bad[:10]}"
    duplicates = {(m, n) for m, n, _ in rows if sum(1 for r in rows if r[:2] == (m, n)) > 1}
    assert not duplicates, f"rows listed twice: {sorted(duplicates)[:10]}"
    count = {kind: sum(1 for _, _, s in rows if s.split(":")[0].split(" ")[0] == kind)
             for kind in ("alias", "here", "later", "missing")}
    totals = (f"Totals: alias {count['alias']}, here {count['here']}, later {count['later']}, "
              f"missing {count['missing']} ({len(rows)} names).")
    assert totals in TABLE.read_text(encoding="utf-8"), f"the Totals line is stale: expected '{totals}'"


def test_every_present_name_imports():
    missing = []
    for module, name, status in _rows():
        if not (status.startswith("here") or status == "alias"):
            continue
        try:
            owner = _resolve(module)
        except Exception as error:  # an import error of the module itself is a failure to report, not to raise
            missing.append(f"{module} (module: {type(error).__name__}: {error})")
            continue
        if not hasattr(owner, name):
            missing.append(f"{module}.{name}")
    assert not missing, "names the surface table marks as present do not exist:\n  " + "\n  ".join(missing)


def _has_name(module: str, name: str) -> bool:
    try:
        owner = _resolve(module)
    except (ImportError, AttributeError):
        return False
    return hasattr(owner, name)


def test_no_absent_name_exists():
    stale = [f"{module}.{name} ({status})" for module, name, status in _rows()
             if not (status.startswith("here") or status == "alias") and _has_name(module, name)]
    assert not stale, ("names the surface table marks as absent exist now: update their rows\n  "
                       + "\n  ".join(stale))


@pytest.mark.parametrize("status", ["here", "later", "missing"])
def test_each_status_is_used(status):
    assert any(s.startswith(status) for _, _, s in _rows())
