"""One rank of one suite test: pytest on one node id, its report as JUnit XML per rank.

``python -m benchmarks.horovod_suite.rank NODEID OUTDIR`` (started by mpirun; the suite's
directory and the shim are on PYTHONPATH).
"""
import os
import sys

import pytest


def main() -> int:
    """Run pytest on ``argv[1]`` and write ``argv[2]/rank<R>.xml``; returns pytest's exit code."""
    node, out = sys.argv[1], sys.argv[2]
    rank = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0"))
    return int(pytest.main([node, "-q", "-p", "no:cacheprovider",
                            f"--junitxml={os.path.join(out, f'rank{rank}.xml')}"]))


if __name__ == "__main__":
    sys.exit(main())
