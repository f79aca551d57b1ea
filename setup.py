"""Legacy entry point beside pyproject.toml: `python setup.py --version`, `python setup.py sdist`, old pips.

Every piece of metadata (name, version, dependencies, extras, packages) lives in pyproject.toml's
`[project]` and `[tool.setuptools]` tables; setuptools reads them from there, so this file adds nothing
and the two can never disagree. tests/unit/packaging checks both paths from a clean copy of the tree.
"""
from setuptools import setup

setup()
