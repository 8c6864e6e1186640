"""The threads a rank's checkpoint writes run on: two long-lived ones, each running its jobs in order, so a save or a
snapshot hands its write over without starting a thread of its own. Imports nothing from Ray.

A thread started for each write held training for its start (``Thread.start`` waits until the new thread runs:
0.3-4.4 ms a snapshot on a loaded 2-core machine, ``make bench-recovery``'s bar's case), more than the whole copy of
a few hundred KB of state. There are two because a thread's CPU priority only goes one way: the copies the next
optimizer step waits for run at the rank's own priority (``COPY``), the writing beside training at a lower one
(``WRITE``, niceness ``BACKGROUND_NICE``), which a thread that lowered it cannot raise again without privileges.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections import deque
from typing import Callable

__all__ = ["BACKGROUND_NICE", "COPY", "Lane", "WRITE"]

# The niceness of a rank's background checkpoint writing (the rank itself stays at its own).
BACKGROUND_NICE = 10


class Lane:
    """One daemon thread that runs the callables given to ``submit`` one at a time, in order; started at the first,
    and again in a forked child (the parent's thread is not there). ``nice``: the niceness it sets itself first
    (None: the one it inherits from the thread that started it)."""

    def __init__(self, name: str, nice: int | None = None) -> None:
        self.name, self.nice = name, nice
        self._reset()
        if hasattr(os, "register_at_fork"):  # the lock may have been held by the parent's thread at the fork
            os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._jobs: deque[Callable[[], None]] = deque()
        self._ready = threading.Condition(threading.Lock())
        self._thread: threading.Thread | None = None

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job()`` on this lane's thread after the jobs before it (its exceptions are the job's to handle: one
        that escapes is printed and the lane goes on)."""
        with self._ready:
            self._jobs.append(job)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, daemon=True, name=self.name)
                self._thread.start()
            self._ready.notify()

    def _run(self) -> None:
        if self.nice is not None:  # (Linux: this thread only)
            with contextlib.suppress(OSError, AttributeError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
        while True:
            with self._ready:
                while not self._jobs:
                    self._ready.wait()
                job = self._jobs.popleft()
            try:
                job()
            except BaseException as exc:  # noqa: BLE001 - never the lane's end: the next write still runs
                print(f"raylaunch: {self.name}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            del job


# The rank's two lanes (named as tests/fns.py's slow storage recognises a checkpoint's background thread).
COPY = Lane("raylaunch-checkpoint-copy")
WRITE = Lane("raylaunch-checkpoint-write", nice=BACKGROUND_NICE)
