"""``python -m benchmarks.convergence``: the convergence study (see the package docstring)."""
from .study import main

main()
