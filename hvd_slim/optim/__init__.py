"""The optimizer front end: ``DistributedOptimizer`` (distributed_optimizer.py), the dynamic
subclass it builds around the user's optimizer (optimizer.py, wrapping.py), the per-layer wait
of ``overlap_forward`` (forward_apply.py), and what runs inside the wrapped step (inner/).
A joined rank's side of ``hvd.join()`` is the tensor API's (api/join.py)."""
