#!/usr/bin/env bash
# The GPU tier in one command (under 5 minutes): CUDA parameters at 2 ranks on the machine's GPU(s)
# over NCCL, MPI and Gloo (tests/gpu/check_gpu.py under mpirun). Skipped without a GPU.
#   bash tests/gpu/run.sh            # uses .venv/bin/python, else python3 (PYTHON=... to choose)
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
if ! command -v mpirun >/dev/null 2>&1 || ! "$PY" -c "import mpi4py" 2>/dev/null; then
    echo "[gpu tier] needs Open MPI (mpirun) and mpi4py for $PY: run \`make install\` first" >&2
    exit 1
fi
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "[gpu tier] skipped: $PY sees no CUDA GPU (torch.cuda.is_available() is False)"
    exit 0
fi
"$PY" - <<'PYEOF'
import torch, torch.distributed as dist
print(f"[gpu tier] torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"NCCL {'.'.join(map(str, torch.cuda.nccl.version())) if dist.is_nccl_available() else 'none'}, "
      f"{torch.cuda.device_count()} GPU(s): {torch.cuda.get_device_name(0)}")
PYEOF
start=$(date +%s)
timeout -k 10 290 "$PY" -m pytest tests/gpu -q -rs -s -p no:cacheprovider --color=no
rc=$?
echo "[gpu tier] exit $rc after $(( $(date +%s) - start ))s"
exit $rc
