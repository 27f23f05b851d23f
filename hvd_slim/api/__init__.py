"""Horovod's tensor API (``hvd.allreduce`` and the rest, process sets, join, Adasum, the
timeline) and the engine thread its asynchronous operations run on. The public names are
exported from ``hvd_slim`` itself."""
