"""Slim-DP's settings: the frozen :class:`SlimConfig` (settings.py), the checks behind its
errors (checks.py), and its ``HVD_SLIM_*`` environment variables (env.py)."""
from .checks import ConfigError
from .settings import (DEFAULT_TIMEOUT, ENV_KEYWORDS, ENV_PREFIX, RESUMABLE_FIELDS, UNSET,
                       SlimConfig, default_pull_density)

__all__ = ["ConfigError", "DEFAULT_TIMEOUT", "ENV_KEYWORDS", "ENV_PREFIX", "RESUMABLE_FIELDS",
           "SlimConfig", "UNSET", "default_pull_density"]
