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

.PHONY: install test test-unit test-mpi demo clean

install: $(STAMP)

$(STAMP): setup.py scripts/install.sh
	VENV=$(VENV) bash scripts/install.sh
	touch $(STAMP)

## make test: the whole suite (unit tier in one process, then the MPI tier at 2 and 3 ranks)
test: install
	$(PY) -m pytest tests -q -p no:cacheprovider

test-unit: install
	$(PY) -m pytest tests/unit -q -p no:cacheprovider

test-mpi: install
	$(PY) -m pytest tests/test_distributed_tier.py -q -p no:cacheprovider

## make demo: dense vs Slim-DP (density 0.01) on real MNIST, 4 ranks
demo: install
	timeout 600 mpirun -np $(NP) --oversubscribe --bind-to none $(PY) examples/demo.py

clean:
	rm -rf $(VENV) build *.egg-info
