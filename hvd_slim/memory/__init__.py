"""Memory: residuals and momentum correction for workers and the server (pure tensor code)."""
from .residual import ResidualMemory

__all__ = ["ResidualMemory"]
