"""Where the ranks agree on a stop notice (SIGTERM: a spot node's, or the driver's for a node Ray drains): at steps
every rank checks, one all-reduce of two numbers on a gloo group of its own. Transformers' Trainer checks at its step
ends (``cluster.rank.trainer``), a function with snapshots where its loop asks for the next batch
(``cluster.rank.session``); both stop at the step they agreed on, with what a restart needs to resume there."""

from __future__ import annotations

import math
import time
from typing import Any

__all__ = ["StopCheck"]


class StopCheck:
    """When the ranks agree on a stop notice: at steps every rank checks (the same count of steps since training
    began), one all-reduce of one number each (and once the time a step took). Every step at first; after ``LEARN``
    checks, every ``every`` steps so the checks are at least ``EVERY_S`` apart at the slowest rank's pace (a
    preemption's notice is 30 s or more).

    >>> s = StopCheck(); [s.due() for _ in range(3)], s.next_check(5)
    ([True, True, True], 6)
    >>> s.every = 4; s.next_check(5), s.next_check(8)
    (8, 12)
    """

    LEARN = 8
    EVERY_S = 0.5

    def __init__(self) -> None:
        self.steps, self.every, self.checks = 0, 1, 0
        self._began: float | None = None
        self._group: Any = None

    def begin(self) -> None:
        """Training begins (a collective: every rank at once): counting starts here."""
        import torch.distributed as dist

        self.steps, self.every, self.checks, self._began = 0, 1, 0, time.monotonic()
        if dist.is_initialized() and dist.get_world_size() > 1 and self._group is None:
            self._group = dist.new_group(backend="gloo")

    def due(self) -> bool:
        """One more step: whether the ranks check at it (for a caller that counts its steps here)."""
        self.steps += 1
        return self.steps % self.every == 0

    def next_check(self, steps: int) -> int:
        """The step count after ``steps`` at which the ranks check next (for a caller that counts its own)."""
        return steps + self.every - steps % self.every

    def agreed(self, asked: bool) -> bool:
        """Whether any rank was asked to stop (every rank calls it at the same step; the first call begins, when
        ``begin`` was not called)."""
        import torch
        import torch.distributed as dist

        if self._began is None:
            self.begin()
        self.checks += 1
        learn = self.checks == self.LEARN
        facts = torch.tensor([1.0 if asked else 0.0,
                              (time.monotonic() - self._began) / self.checks if learn else 0.0], dtype=torch.float64)
        if self._group is not None:
            dist.all_reduce(facts, op=dist.ReduceOp.MAX, group=self._group)
        if learn:
            self.every = max(1, min(1000, math.ceil(self.EVERY_S / max(float(facts[1]), 1e-6))))
        return float(facts[0]) > 0
