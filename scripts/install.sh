#!/usr/bin/env bash
# One install script for a fresh machine, used by `make install`, CI and the Dockerfile.
# Idempotent: every step checks before it acts.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"

if ! command -v mpirun >/dev/null 2>&1 || ! command -v mpicc >/dev/null 2>&1; then
    echo "[install] Open MPI not found: installing openmpi-bin libopenmpi-dev"
    $SUDO apt-get update -q
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q openmpi-bin libopenmpi-dev
fi

if [ ! -x "$VENV/bin/python" ]; then
    echo "[install] creating $VENV"
    "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip setuptools wheel
# Pin torch first: an unpinned torch would pull a multi-GB CUDA build.
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    echo "[install] torch==$TORCH_VERSION (CPU)"
    $PIP install -q "torch==$TORCH_VERSION"
fi
echo "[install] hvd_slim (editable) with test, example and framework extras"
$PIP install -q -e ".[test,examples,frameworks]"
"$VENV/bin/python" -c "import torch, mpi4py, numpy, hvd_slim; print('[install] ok: torch', torch.__version__, 'mpi4py', mpi4py.__version__)"
