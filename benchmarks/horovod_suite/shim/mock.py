"""``import mock`` for the suite's helpers: the standard library's unittest.mock."""
from unittest.mock import *  # noqa: F401,F403
