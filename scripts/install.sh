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
# The trackio dashboard's test (tests/runtime/test_loggers.py) opens the page in headless Chromium: as root
# with apt-get, the system's package is installed when no Chromium is there (about 350 MB; COVEY_NO_BROWSER=1
# leaves it out). Elsewhere, or if it fails, that one test skips and says why.
if [ -z "${COVEY_NO_BROWSER:-}" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
   && ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1 \
   && ! command -v google-chrome >/dev/null 2>&1; then
  echo "install.sh: installing chromium (apt-get) for the dashboard test; COVEY_NO_BROWSER=1 skips this"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; } \
    >/dev/null 2>&1 || echo "install.sh: chromium could not be installed: the dashboard test will skip" >&2
fi
touch "$VENV/.installed"
