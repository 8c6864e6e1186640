"""The end of the training code in a rank, as ``python`` ends a program, less the part that aborts it.

A rank process is forked from its warm host and ends with ``os._exit`` (multiprocessing's end for a forked child):
the interpreter's finalization never runs in it. That finalization is where gloo's threads abort a process now and
then after a script's last line (SIGABRT, "terminate called without an active exception": pytorch/pytorch#179291;
under ``torchrun`` a script that finished is then reported failed). It is also where Python does two things a
script relies on: it calls what the program registered with ``atexit`` (an experiment tracker's last upload, a
results file written by a handler), and it writes what is still buffered in files the program left open (a log
file opened at the top of a script and never closed). ``as_python_ends`` does both, while the interpreter is
whole, when the training code returns or raises:

- the ``atexit`` handlers the training code registered run, last registered first, as Python runs them (an
  exception in one is printed and the next runs; the rank's outcome is not changed). Those registered before
  the fork, by the process the rank was forked from, are that process's own and never run in a rank, as before;
  ``logging.shutdown``, which Python runs for every program that imported ``logging``, runs last;
- then every file still open is flushed (not closed: the runner's own files go on after it).
"""

from __future__ import annotations

import atexit
import gc
import io
import logging
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["as_python_ends"]


@contextmanager
def as_python_ends() -> Iterator[None]:
    """Around the training code in a rank process (``cluster.rank.worker``): its ``atexit`` handlers run and the
    files it left open are flushed when it ends, returned or raised (``sys.exit`` too)."""
    atexit._clear()  # the host's, registered before the fork (cluster.patches: a private read)
    atexit.register(logging.shutdown)
    try:
        yield
    finally:
        atexit._run_exitfuncs()  # cluster.patches: a private read
        flush_open_files()


# What open() returns (text, buffered, raw) and what wraps it; a Python-level wrapper (gzip.GzipFile) writes through
# one of these, which is flushed: what it compressed is written, but not its end, which only its close writes.
_FILES = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom, io.FileIO)


def flush_open_files() -> int:
    """Flush every file object of this process still open for writing, as their finalizers would at the
    interpreter's end (0.08 s with torch and transformers imported); how many were flushed. One that cannot be
    flushed (its descriptor gone) is left."""
    flushed = 0
    for obj in gc.get_objects():
        if not issubclass(type(obj), _FILES):  # its type, not isinstance: that reads each object's __class__
            continue
        try:
            if obj.closed or not obj.writable():
                continue
            obj.flush()
            flushed += 1
        except (OSError, ValueError):  # detached, closed underneath, or its descriptor gone
            continue
    return flushed
