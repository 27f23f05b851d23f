"""Per-step slice selection (docs/design.md §2, "Select"): pure tensor functions.

``significance`` scores coordinates, :class:`CoreSelector` picks the exact top-k core in about
one pass, ``explore`` draws the seeded, stratified exploration set outside the core, and
``slice_indices`` joins the two into a slice's coordinates under a role's exploration key;
``tie_start`` says where a keyed selection starts among the entries tied at its threshold.
"""
from .core import CoreSelector, significance
from .explore import ROLE_PULL, ROLE_PUSH, explore, slice_indices, tie_start

__all__ = ["significance", "CoreSelector", "explore", "slice_indices", "ROLE_PUSH", "ROLE_PULL",
           "tie_start"]
