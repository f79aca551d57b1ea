#!/usr/bin/env bash
# Set up a fresh virtual environment and run the whole test suite (CPU).
# Usage: bash scripts/setup_and_test.sh [extra pytest args]
# Environment: VENV (default .venv-test), TORCH_SPEC (default torch==2.13.0, the CPU wheel).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv-test}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
PYTHON="${PYTHON:-python3}"

rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install --quiet "$TORCH_SPEC"
python -m pip install --quiet -e ".[test]"
python -c "import torch, megatron.core; print('torch', torch.__version__, '| megatron.core', megatron.core.__version__)"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
python -m pytest -q --durations=15 tests "$@"
