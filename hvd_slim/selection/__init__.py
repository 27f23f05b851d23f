"""Per-step slice selection (docs/design.md §2, "Select"): pure tensor functions.

``significance`` scores coordinates, :class:`CoreSelector` picks the exact top-k core in about
one pass, and ``explore`` draws the seeded, stratified exploration set outside the core.
"""
from .core import CoreSelector, significance
from .explore import explore

__all__ = ["significance", "CoreSelector", "explore"]
