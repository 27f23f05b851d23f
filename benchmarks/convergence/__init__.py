"""The convergence study: dense training vs hvd_slim (Slim-DP) on real MNIST and MNIST-1D, 4 ranks.

    .venv/bin/python -m benchmarks.convergence                  # the study (make convergence)
    .venv/bin/python -m benchmarks.convergence --preset quick   # 1 seed, MNIST-1D only
    .venv/bin/python -m benchmarks.convergence --groups ablation
    .venv/bin/python -m benchmarks.convergence --report-only     # table and plots from results

Groups of runs (each config x each seed x each dataset):

* ``grid``: dense, and hvd_slim at density 0.01 and 0.001, each with pull "slim" and "union" and
  exploration 0 and 0.1 (the issue's study).
* ``kept``: the earlier results at the shipped defaults (density 0.02 passed explicitly, every
  other keyword left alone) and at 0.001: SGD with momentum 0.9 and the cosine schedule
  (``SETTINGS``), and Adam (also with ``adam_variance="live"``), against dense.
* ``baselines``: the top-k + error-feedback allgather baseline (topk.py) at both densities.
* ``ablation``: hvd_slim's defaults with one knob changed: momentum correction off, its
  velocity kept (``momentum_masking=False``) or halved (0.5) where a coordinate is sent, core fixed
  for 4 steps, magnitude weight 0.1, a 4x denser pull, a dense warm-up over the first 10% of
  the steps (emulated outside hvd_slim: training.py ``DenseWarmup``), hvd_slim's own
  warm-up (``warmup_dense_steps``: the first 10% dense; and 5% dense then a geometric decay over
  the next 10%).
* ``adam``: dense Adam, and hvd_slim under Adam at both densities: the default
  (``adam_variance="rescaled"``), Adam's own step on the bursts (``"live"``), and the default
  after hvd_slim's warm-up (5% dense, 10% decay).
* ``schedule``: dense and slim with a constant LR instead of the cosine decay, and with the
  cosine applied by scaling the loss instead of the LR (``training.Schedule``'s ``via``).
* ``longer``: dense and slim trained for twice the epochs (MNIST: 4).
* ``time``: time to accuracy at the ``longer`` settings: dense, Horovod's own
  DistributedOptimizer (run through train.py: one MPI runtime per process), slim at
  0.01 and slim at 0.001 with a 4x pull (``pull_density=0.004``). Seeds are interleaved
  (seed 0 of every config, then seed 1, ...) so that load drift on a shared machine hits every
  config alike. Meant for ``--net tbf1g``.

``--net tbf1g``/``tbf10g`` runs every job inside benchmarks/netem.py's emulated network (a
network namespace whose loopback carries a ``tc tbf`` rate limit; Open MPI over TCP on that
``lo`` only), measures the link once with a 16 MiB ping-pong (benchmarks/worker.py) and stores
both in every result (``network``); keys get an ``@<net>`` suffix. The namespace is removed
afterwards, also on failure. Needs root.

Every run of a dataset uses the same epochs, batch size and LR schedule (``SETTINGS``). The
runs go to sweep.py inside one ``mpirun`` per dataset (interpreter start-up and data
loading dominate short runs here); finished runs are appended to ``results.jsonl`` and skipped
on the next invocation, so an interrupted study resumes. The report is ``table.md`` (with a
"time to 98.5%" table per network for MNIST runs that carry timed evaluations) plus
``<dataset>_accuracy_vs_epoch.png`` and ``<dataset>_accuracy_vs_bytes.png`` in ``--out``.
"""
