"""An analytic cost model of one data-parallel training step, per strategy of the benchmark.

    python -m benchmarks.model validate benchmarks/results/resnet18_4r_tbf1g.json
    python -m benchmarks.model extrapolate --out /tmp/model

:mod:`.net` holds the topologies, phases, token buckets and the ring and tree collectives,
:mod:`.bcast` the broadcasts (libnbc's choice), :mod:`.openmpi` Open MPI 4.1's own allreduce and
allgather over its TCP BTL, :mod:`.slim` hvd_slim's message sizes, :mod:`.scenario` the inputs
and outputs every strategy shares, :mod:`.strategies` one function per baseline strategy and
the registry ``STRATEGIES`` (hvd_slim's in :mod:`.slim_steps`), :mod:`.inputs` a benchmark
JSON as inputs, :mod:`.validate` the comparison with it (tables: :mod:`.tables`) and
:mod:`.extrapolate` the tables and plots for large clusters. docs/performance.md ("The cost
model") states the assumptions.
"""
from .net import Network
from .slim import SlimSettings, step_bytes
from .strategies import STRATEGIES, LocalCosts, Prediction, Scenario, parse, predict

__all__ = ["Network", "SlimSettings", "step_bytes", "STRATEGIES", "LocalCosts", "Prediction",
           "Scenario", "parse", "predict"]
