"""Local steps (``local_steps=H``): rounds of H local steps, then one outer step of the
pseudo-gradient through the Slim-DP exchange (docs/design.md §2, "Local steps")."""
from .rounds import (OuterRounds, check_outer_optimizer, default_outer_optimizer,
                     describe_outer_optimizer)

__all__ = ["OuterRounds", "check_outer_optimizer", "default_outer_optimizer",
           "describe_outer_optimizer"]
