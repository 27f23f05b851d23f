"""``horovod.torch`` as hvd_slim: every public name of hvd_slim, nothing else."""
import hvd_slim as _slim
from hvd_slim import *  # noqa: F401,F403

globals().update({k: getattr(_slim, k) for k in dir(_slim) if not k.startswith("_")})
