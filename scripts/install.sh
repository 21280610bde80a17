#!/usr/bin/env bash
# Create or reuse a virtual environment and install covey with its test tools.
#
# torch: a torch already importable in the environment is kept (a GPU user's
# own build). Otherwise COVEY_TORCH_SPEC is installed first (default
# torch==2.13.0, a CPU build on these machines); covey's own range (torch>=2.4)
# is then already satisfied, so pip never pulls a CUDA build behind your back.
set -euo pipefail
VENV=${1:-.venv}
PYTHON=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  "${PIP[@]}" install "${COVEY_TORCH_SPEC:-torch==2.13.0}"
fi
"${PIP[@]}" install -e ".[test]"
touch "$VENV/.installed"
