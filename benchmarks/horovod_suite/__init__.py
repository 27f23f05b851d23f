"""Horovod's own test suite (``test/parallel/test_torch.py``) run against hvd_slim.

``python -m benchmarks.horovod_suite --suite PATH`` runs each test of the suite in a job of its
own under ``mpirun``, with ``horovod.torch`` replaced by a shim that only re-exports hvd_slim
(``shim/``), and writes which pass, fail and skip. The suite is not part of this repository:
pass the path of ``test/parallel/test_torch.py`` in a checkout of Horovod (tag v0.28.1).
"""
