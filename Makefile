# hvd_slim: every target sets itself up on a fresh machine (Open MPI, .venv, torch CPU, package).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hvd_slim-installed
# mpirun refuses root without these; harmless for other users.
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export OMPI_MCA_rmaps_base_oversubscribe := 1
NP ?= 4

.PHONY: install test test-unit test-mpi test-torchrun demo clean

install: $(STAMP)

$(STAMP): setup.py scripts/install.sh
	VENV=$(VENV) bash scripts/install.sh
	touch $(STAMP)

## make test: the whole suite (unit tier in one process, then the MPI tier at 2 and 3 ranks over
## MPI and Gloo, the torchrun tier at 2 and 3 processes, the Horovod tier when Horovod is
## importable, the GPU tier when a GPU is visible)
test: install
	$(PY) -m pytest tests -q -p no:cacheprovider

test-unit: install
	$(PY) -m pytest tests -m unit -q -p no:cacheprovider

test-mpi: install
	$(PY) -m pytest tests/distributed/test_tier_mpi.py -q -p no:cacheprovider

## make test-torchrun: only the torchrun tier (hvd.init() on torch.distributed, no MPI)
test-torchrun: install
	$(PY) -m pytest tests/torchrun/test_tier_torchrun.py -q -p no:cacheprovider

## make install-horovod: build Horovod 0.28.1 against the venv's torch (system CMake 3.x, a C++17
## compiler wrapper; README "Running inside Horovod"). Skips when `import horovod.torch` works.
.PHONY: install-horovod test-horovod test-gpu
install-horovod: install
	VENV=$(VENV) bash scripts/install_horovod.sh

## make test-horovod: only the Horovod tier (horovodrun -np 2, mpirun -np 3); make test runs it too
test-horovod: install
	$(PY) -m pytest tests/horovod/test_tier_horovod.py -q -p no:cacheprovider

## make test-gpu: CUDA parameters at 2 ranks over NCCL, MPI and Gloo (skipped without a GPU)
test-gpu: install
	bash tests/gpu/run.sh

## make demo: dense vs Slim-DP (hvd_slim's defaults) on real MNIST, 4 ranks, on the emulated
## switched cluster at 1 Gbit/s as root (else on the loopback, saying so)
demo: install
	$(PY) -m benchmarks.demo --np $(NP)

## make convergence: the untuned battery (Horovod's MNIST CNN: dense, the defaults, 0.001) and the
## language model with their peers, then dense vs Slim-DP (pull slim/union, exploration 0/0.1)
## on MNIST and MNIST-1D, 4 ranks, 3 seeds; PRESET=quick: 1 seed, MNIST-1D only. Each mpirun
## has a hard timeout inside; finished runs are kept, so a rerun resumes. CONVERGENCE_ARGS adds
## flags, e.g. --groups ablation
.PHONY: convergence
PRESET ?= full
CONVERGENCE_ARGS ?=
convergence: install
	$(PY) -m benchmarks.convergence --preset $(PRESET) --np $(NP) $(CONVERGENCE_ARGS)

## make horovod-suite HOROVOD_SUITE=<checkout>/test/parallel/test_torch.py: Horovod's own torch
## tests against hvd_slim (one mpirun per test, at 2 and 3 ranks; the suite is not in this
## repository: clone Horovod at v0.28.1). Results in benchmarks/results/horovod_suite/
.PHONY: horovod-suite
HOROVOD_SUITE ?= horovod/test/parallel/test_torch.py
horovod-suite: install
	$(PY) -m benchmarks.horovod_suite --suite $(HOROVOD_SUITE) --np 2,3

## make bench: the cluster study on a switched cluster (one 1 Gbit/s NIC per host; needs root):
## every peer at 4 hosts, real compute, 2-8 hosts at 100 Mbit/s, one slow host, the shared
## medium for comparison (benchmarks/cluster_study.py); BENCH_ARGS="--series scaling" picks some
.PHONY: bench
BENCH_ARGS ?=
bench: install
	@command -v tc >/dev/null 2>&1 || { [ "$$(id -u)" -eq 0 ] \
	  && apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q iproute2; } \
	  || echo "make bench: iproute2 (ip, tc) is missing; the emulated network needs it"
	trap '$(PY) -m benchmarks.netem --cleanup-stale' EXIT; $(PY) -m benchmarks.cluster_study $(BENCH_ARGS)

## make bench-one BENCH_ARGS="--model smallcnn --hosts 2 --ranks 2": one benchmarks.run job
.PHONY: bench-one
bench-one: install
	trap '$(PY) -m benchmarks.netem --cleanup-stale' EXIT; $(PY) -m benchmarks.run $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info

## make image: the reproduction image (Dockerfile) with docker, or podman where no Docker engine
## runs; WITH_HOROVOD=1 builds Horovod into it too (tag hvd-slim:horovod). make image-test: in the
## image, offline (--network none), make demo, the unit tier and with WITH_HOROVOD=1 the Horovod
## tier. make image-compare: make demo here too, and the figures of both side by side. All three
## are scripts/image.sh; docs/image.md has the engine commands and the measured times.
.PHONY: image image-test image-compare
WITH_HOROVOD ?= 0
image:
	WITH_HOROVOD=$(WITH_HOROVOD) bash scripts/image.sh build

image-test: image
	WITH_HOROVOD=$(WITH_HOROVOD) bash scripts/image.sh test

image-compare: install
	WITH_HOROVOD=$(WITH_HOROVOD) bash scripts/image.sh compare
