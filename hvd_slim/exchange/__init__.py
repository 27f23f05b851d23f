"""One step of Slim-DP as a fixed sequence: compensate -> select -> push -> aggregate -> pull -> apply."""
from .layout import DENSE, SPARSE, Bucket, Layout
from .errors import ExchangeError, NonFiniteGradientError
from .step import SlimExchange

__all__ = ["DENSE", "SPARSE", "Bucket", "Layout", "ExchangeError", "NonFiniteGradientError",
           "SlimExchange"]
