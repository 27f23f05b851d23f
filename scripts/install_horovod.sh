#!/usr/bin/env bash
# Build Horovod 0.28.1 from PyPI against the project's torch (used by `make install-horovod`, CI).
#
# Why a recipe: 0.28.1 (Horovod's last release) fails to build against torch >= 2.1 in two ways:
#   1. pip's build isolation pulls CMake 4.x, which rejects the cmake_minimum_required of Horovod's
#      bundled gloo: build with the system CMake (3.x) and --no-build-isolation instead;
#   2. the torch extension is compiled as C++14 while torch's headers need C++17: compile through
#      a wrapper that appends -std=c++17 (the last -std flag wins).
# Idempotent: does nothing when `import horovod.torch` already works in the venv.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYBIN="$VENV/bin/python"
HOROVOD_VERSION=${HOROVOD_VERSION:-0.28.1}

if [ ! -x "$PYBIN" ]; then
    echo "[install-horovod] $PYBIN not found: run \`make install\` first" >&2
    exit 1
fi
if "$PYBIN" -c "import horovod.torch" >/dev/null 2>&1; then
    echo "[install-horovod] horovod.torch already importable: $("$PYBIN" -c 'import horovod; print(horovod.__version__)')"
    exit 0
fi

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
cmake_major() { cmake --version 2>/dev/null | awk 'NR==1 {split($3, v, "."); print v[1]}'; }
# A pip-installed cmake (4.x) in the venv would shadow the system one inside the build.
if "$PYBIN" -m pip show cmake >/dev/null 2>&1; then
    echo "[install-horovod] removing the pip cmake package from $VENV (Horovod's gloo needs CMake 3.x)"
    "$PYBIN" -m pip uninstall -y -q cmake
fi
if [ "$(cmake_major)" != "3" ] || ! command -v g++ >/dev/null 2>&1; then
    echo "[install-horovod] installing cmake 3.x and g++ from apt"
    $SUDO apt-get update -q
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q cmake g++ make
fi
if [ "$(cmake_major)" != "3" ]; then
    echo "[install-horovod] need CMake 3.x on PATH, found: $(cmake --version 2>/dev/null | head -1)" >&2
    exit 1
fi

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cat > "$WORK/cxx17" <<'WRAP'
#!/bin/sh
exec g++ "$@" -std=c++17
WRAP
chmod +x "$WORK/cxx17"

# Runtime dependencies first: --no-build-isolation builds against what the venv already holds.
"$PYBIN" -m pip install -q cloudpickle psutil pyyaml packaging
echo "[install-horovod] building horovod==$HOROVOD_VERSION (takes a few minutes)"
start=$(date +%s)
# MAKEFLAGS from an enclosing `make` would leak its jobserver into Horovod's own cmake build.
env -u MAKEFLAGS -u MFLAGS -u MAKELEVEL \
    PATH="$(dirname "$(command -v cmake)"):$PATH" \
    CXX="$WORK/cxx17" \
    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 \
    HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=MPI \
    "$PYBIN" -m pip install -q --no-build-isolation --no-cache-dir "horovod==$HOROVOD_VERSION"
echo "[install-horovod] built in $(( $(date +%s) - start ))s"
"$PYBIN" -c "import horovod, horovod.torch as hvd; assert hvd.mpi_built(), 'Horovod was built without MPI'; print('[install-horovod] ok: horovod', horovod.__version__, 'mpi_built', hvd.mpi_built(), 'gloo_built', hvd.gloo_built())"
