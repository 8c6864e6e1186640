"""The end of the training code in a rank, as ``python`` ends a program, less the part that aborts it.

A rank process is forked from its warm host and ends with ``os._exit`` (multiprocessing's end for a forked child):
the interpreter's finalization never runs in it. That finalization is where gloo's threads abort a process now and
then after a script's last line (SIGABRT, "terminate called without an active exception": pytorch/pytorch#179291;
under ``torchrun`` a script that finished is then reported failed). It is also where Python does what a script
relies on: it calls what the program registered with ``atexit`` (an experiment tracker's last upload, a results
file written by a handler), and it writes what is still buffered in files the program left open (a log file opened
at the top of a script and never closed). Here, while the interpreter is whole:

- ``as_python_ends``, around the training code: when it returns or raises (``sys.exit`` too), the ``atexit``
  handlers registered while it ran are called, last registered first (an exception in one is printed and the next
  runs; the rank's outcome is not changed), then ``logging.shutdown`` (a buffering handler writes what it held),
  then every file still open is flushed (not closed: the runner's own files go on after it). All before the rank
  reports its end.
- ``end_process``, the rank process's last step: the training code's non-daemon threads are waited for (as
  multiprocessing waits for them anyway, after the rank reported) and what they wrote is flushed.

Left out, each as before: handlers registered before the fork, by the process the rank was forked from (the
imports of torch, Accelerate and transformers there; they are not the rank's); ``weakref.finalize`` callbacks (a
``TemporaryDirectory`` left to its finalizer stays on disk); and Python's order, in which the threads are waited
for before the handlers are called. When one rank fails, the others are ended after a short grace
(``cluster.hosting.ranks``), which their handlers may not finish in.
"""

from __future__ import annotations

import atexit
import gc
import io
import logging
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["as_python_ends", "end_process", "flush_open_files"]


@contextmanager
def as_python_ends() -> Iterator[None]:
    """Around the training code in a rank process (``cluster.rank.worker``): the ``atexit`` handlers it registers
    are called, and the files it left open flushed, when it ends, returned or raised."""
    atexit._clear()  # the handlers of the process the rank was forked from (cluster.patches: a private read)
    atexit.register(logging.shutdown)  # as `import logging` registers it; called last
    try:
        yield
    finally:
        atexit._run_exitfuncs()  # never raises: an exception in a handler is printed (cluster.patches)
        flush_open_files()


def end_process() -> None:
    """The rank process's last step (``cluster.hosting.ranks``): its non-daemon threads waited for, as Python and
    multiprocessing wait for them (executors' own shutdown first), then what they wrote flushed. In the main
    thread only."""
    threading._shutdown()  # what multiprocessing calls next, and once only (cluster.patches: a private read)
    flush_open_files()


# What open() returns in text and buffered modes, and socket.makefile's pair; a Python-level wrapper (gzip.GzipFile)
# writes through one of these, which is flushed: what it compressed is written, not its end, which its close writes.
_FILES = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom, io.BufferedRWPair)


def flush_open_files() -> int:
    """Flush every file object of this process still open for writing, as their finalizers would at the
    interpreter's end (0.08 s with torch and transformers imported, more with a large heap); how many were flushed.
    One that cannot be flushed is left, and said on standard error: it never changes how the rank ended."""
    flushed = 0
    for obj in gc.get_objects():
        if not issubclass(type(obj), _FILES):  # its type, not isinstance: that reads each object's __class__
            continue
        try:
            if obj.closed or not obj.writable():
                continue
            obj.flush()
            flushed += 1
        except (OSError, ValueError):  # detached, closed underneath, or its descriptor gone: nothing to write to
            continue
        except Exception as exc:  # noqa: BLE001  (a file of a library's, over a stream of its own)
            _say(f"raylaunch: a file left open could not be written at the rank's end ({type(exc).__name__}: {exc})")
    return flushed


def _say(line: str) -> None:
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except Exception:  # noqa: BLE001  (standard error itself gone)
        pass
