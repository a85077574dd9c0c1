#!/usr/bin/env bash
# The GPU check in one command, on a machine with one CUDA device (python -m cbpause.apps.bench.gpu: the CUDA tests,
# then python -m cbpause.apps.bench --device cuda --quick; figures as JSON and Markdown in gpu-results/).  Without a
# device the CUDA parts are skipped and the rest runs, so that this has run end to end before a GPU is there.
#
# It installs what is missing into the Python it runs with (PYTHON, default python3), keeping a torch that is
# already installed: a GPU machine usually has its CUDA build, which pip would otherwise replace or fetch.
# Usage: scripts/gpu-check.sh [OUT_DIR]   (nox -s gpu does the same in a virtual environment of its own)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${1:-gpu-results}

if "$PY" -c "import torch, transformers, pytest, matplotlib" 2>/dev/null; then
    "$PY" -m pip install -q --no-deps -e .
else
    "$PY" -m pip install -q -e ".[transformers,bench]" pytest pytest-timeout hypothesis
fi
"$PY" -c "import torch; print('gpu-check: torch', torch.__version__, '| CUDA available:', torch.cuda.is_available())"
exec "$PY" -m cbpause.apps.bench.gpu --out "$OUT"
