"""How often to checkpoint: Young and Daly's interval, from what a save costs and how often the run fails.

Used by ``session.checkpoint_due`` in the ranks (``checkpoint.every: auto``) and by the goodput ledger's
suggestion (``jobs.run.ledger``).
"""

from __future__ import annotations

import math

__all__ = ["ASSUMED_SAVE_S", "checkpoint_interval"]

# What ``checkpoint.every: auto`` assumes a save holds training before the first one is measured.
ASSUMED_SAVE_S = 1.0


def checkpoint_interval(save_s: float, mtbf_s: float) -> float:
    """The interval between checkpoints that loses the least time: about sqrt(2 x the time a save holds
    training x the mean time between failures), in seconds (Young 1974, Daly 2006).

    >>> round(checkpoint_interval(2.0, 3600.0))
    120
    """
    if save_s <= 0 or mtbf_s <= 0:
        raise ValueError("the cost of a save and the time between failures must be positive")
    return math.sqrt(2.0 * save_s * mtbf_s)
