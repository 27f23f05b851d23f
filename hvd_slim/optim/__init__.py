"""The optimizer front end: ``DistributedOptimizer`` (distributed_optimizer.py), the dynamic
subclass it builds around the user's optimizer (optimizer.py, wrapping.py), join's optimizer
side (join_sync.py), and what runs inside the wrapped step (inner/)."""
