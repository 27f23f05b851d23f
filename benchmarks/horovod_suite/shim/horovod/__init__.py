"""A stand-in ``horovod`` package for running Horovod's own test suite against hvd_slim.

``horovod.torch`` is hvd_slim; ``horovod.runner.util.threads.in_thread`` is the one other name
the suite's helpers (test/utils/common.py) import. Nothing of a real Horovod is used, so the
suite runs the same whether or not Horovod is installed.
"""
