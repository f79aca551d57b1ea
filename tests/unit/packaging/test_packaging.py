"""`pip install .` and `python setup.py --version` from a clean copy of the tree (the files git tracks).

Both read pyproject.toml, the one source of metadata: the version setup.py prints and the version of the
installed distribution must equal `[project].version`, and the install must carry every `megatron`
package that the source tree has (a missing `__init__.py` or a wrong `packages.find` drops one silently).
Offline: `--no-build-isolation --no-deps`, with the setuptools of the running interpreter.
"""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
TIMEOUT_S = 240


def _project_version() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    match = re.search(r'^\[project\]\s*$(.*?)^\[', text, re.S | re.M)
    assert match, "pyproject.toml has no [project] table"
    version = re.search(r'^version\s*=\s*"([^"]+)"', match.group(1), re.M)
    assert version, "pyproject.toml [project] has no static version"
    return version.group(1)


def _clean_copy(dest: Path) -> Path:
    """The tracked files (plus untracked, not ignored ones: a fresh commit's content) copied to `dest`."""
    listing = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True, timeout=60,
    ).stdout.decode().split("\0")
    for rel in filter(None, listing):
        src = ROOT / rel
        if not src.is_file():
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)
    return dest


def _run(cmd, cwd, env=None):
    result = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    assert result.returncode == 0, f"{cmd} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def clean_tree(tmp_path_factory):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    return _clean_copy(tmp_path_factory.mktemp("clone") / "src")


def test_setup_py_version_matches_pyproject(clean_tree):
    out = _run([sys.executable, "setup.py", "--version"], clean_tree)
    assert out.strip().splitlines()[-1] == _project_version()


def test_pip_install_from_clean_tree(clean_tree, tmp_path):
    target = tmp_path / "site"
    env = dict(os.environ, PIP_NO_INPUT="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    _run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
          "--target", str(target), "."], clean_tree, env)
    dist_infos = list(target.glob("megatron_lite-*.dist-info"))
    assert len(dist_infos) == 1, sorted(p.name for p in target.iterdir())
    assert dist_infos[0].name == f"megatron_lite-{_project_version()}.dist-info"
    source_packages = {
        p.parent.relative_to(clean_tree).as_posix()
        for p in (clean_tree / "megatron").rglob("__init__.py")
    }
    installed = {p.parent.relative_to(target).as_posix() for p in (target / "megatron").rglob("__init__.py")}
    assert source_packages and source_packages == installed, sorted(source_packages ^ installed)
    assert (target / "megatron" / "training" / "arguments" / "manifest.json").is_file(), \
        "package data (the flag manifest) is missing from the install"
