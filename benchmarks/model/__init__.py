"""An analytic cost model of one data-parallel training step, per strategy of the benchmark.

    python -m benchmarks.model validate benchmarks/results/resnet18_4r_tbf1g.json
    python -m benchmarks.model extrapolate --out /tmp/model

:mod:`.net` holds the topologies and collectives, :mod:`.slim` hvd_slim's message sizes,
:mod:`.strategies` one function per strategy (the registry ``STRATEGIES``),
:mod:`.validate` the comparison with a benchmark JSON and :mod:`.extrapolate` the tables and
plots for large clusters. docs/performance.md ("The cost model") states the assumptions.
"""
from .net import Network
from .slim import SlimSettings, step_bytes
from .strategies import STRATEGIES, LocalCosts, Prediction, Scenario, parse, predict

__all__ = ["Network", "SlimSettings", "step_bytes", "STRATEGIES", "LocalCosts", "Prediction",
           "Scenario", "parse", "predict"]
