"""The rank fork server: one per actor process, preloaded with torch and Accelerate, that ranks fork from.

A rank forked from it starts in milliseconds instead of importing torch itself, in every
attempt; the node actor starts it as soon as it exists, while the driver is still reserving
nodes and checking storage. CUDA is not initialised there (importing torch does not), so a
forked rank still chooses its GPU. It runs on multiprocessing's forkserver, whose folder and
process this module manages through multiprocessing's private state (``process._config``,
``forkserver._forkserver``): the one place that touches it.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from multiprocessing import forkserver, process, resource_tracker, spawn
from pathlib import Path
from typing import Any

from cluster import patches
from cluster.hosting import rankhost
from cluster.hosting.hostproc import pid_namespace
from cluster.hosting.rankhost import Claim, WarmHost

__all__ = ["FORKSERVER_PRELOAD", "FORK_SERVER", "ForkServer", "HOST_PRELOAD", "drop_safe_path", "pid_namespace",
           "process_folder", "remove_abandoned"]


# What the rank fork server imports once, before any rank starts (not CUDA: importing torch does not initialise it,
# so forked ranks can still pick their GPU). torch._dynamo too: every torch optimizer's constructor imports it, 1.9 s
# of a core in each rank otherwise.
# Last, ``cluster.hosting.frozen``: what was imported is frozen before any rank forks (``gc.freeze``).
_IMPORTS = ["torch", "torch.distributed", "torch._dynamo", "accelerate", "cluster.hosting.ranks", "cluster.rank.worker",
            "cluster.rank.session", "cluster.runtime"]
FORKSERVER_PRELOAD = [*_IMPORTS, "cluster.hosting.frozen"]
# A warm rank host imports transformers too: paid once per node, not once per job.
HOST_PRELOAD = [*_IMPORTS, "transformers", "cluster.hosting.frozen"]


_SAFE_PATH_MARK = "RAYLAUNCH_SET_PYTHONSAFEPATH"


_SPAWNING = threading.Lock()  # held while ``ForkServer.starting`` replaces multiprocessing's preparation data


class ForkServer:
    """The process's rank fork server, started by the first node actor and stopped by the last one's
    ``shutdown`` (in a Ray worker process there is one; tests make several in their own process).

    Its socket lives in a folder of its own, which multiprocessing would otherwise create as
    ``/tmp/pymp-*`` and remove only at a normal exit, never reached by an actor Ray ends:
    that folder is removed with the server. Only multiprocessing's folder is moved, not
    ``tempfile``'s default, so other temporary folders of the process stay where they were.
    An actor killed outright (its node's memory monitor, a lost job) cannot remove its folder:
    the folder is named for its process (``raylaunch-mp-<pid namespace>-<pid>``, both in hex), and the next
    server started on the machine removes those of processes that no longer run (in its own PID
    namespace only: a container beside it with the same /tmp has pids of its own).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._thread: threading.Thread | None = None
        self._folder: str | None = None  # ours, when we chose multiprocessing's folder
        self._host: Claim | None = None  # the warm rank host claimed (``cluster.hosting.rankhost``), if any
        self._host_fd: int | None = None  # what multiprocessing hands the host's children as its "alive" pipe
        self.note = ""  # where this process's ranks fork from, as the driver says it
        self._preloaded = False  # this process's own server has imported its preload (``preloaded``)

    @property
    def host_pid(self) -> int | None:
        """The warm rank host's pid while ranks fork (or will) from one."""
        return self._host.pid if self._host is not None else None

    def acquire(self, warm: WarmHost | None = None) -> str:
        """Hold the process's rank server: a warm rank host (``warm``) or one of this process's own; say which."""
        with self._lock:
            self._holders += 1
            if self._thread is None and self._host is None:
                found = rankhost.claim(warm or WarmHost(enabled=False), HOST_PRELOAD)
                if found.address is not None:
                    self._host, self.note = found, found.note
                else:
                    self.note = f"ranks fork from a server of this actor's own ({found.note})"
                    self._start_own()
            return self.note

    def ready(self) -> None:
        """Before ranks start: use the claimed host once it has imported everything, or, when it cannot be used
        (it ended, or the job's own modules would be shadowed), start a server of this process's own."""
        with self._lock:
            if self._host is None:
                return
            if self._host_fd is not None and rankhost.alive(self._host):
                return
            why = rankhost.ready(self._host) if self._host_fd is None else "the warm rank host ended"
            if why is None:
                self._point_at(self._host.address)
                return
            self._unpoint()
            rankhost.unclaim(self._host)
            self._host = None
            self.note = f"ranks fork from a server of this actor's own ({why})"  # the node actor says it
            self._start_own()

    def preloaded(self) -> None:
        """Wait until this process's own server (if its ranks fork from one) has imported its preload: a child
        that returns at once, started and joined (a warm host is ready once ``ready`` returns)."""
        if self._host is not None or self._thread is None or self._preloaded:
            return
        with self.starting():
            child = multiprocessing.get_context("forkserver").Process(target=os.getpid, daemon=True)
            child.start()
        child.join()
        self._preloaded = True

    def _point_at(self, address: str) -> None:
        """multiprocessing's fork-server client state, aimed at a server this process did not start."""
        fs = forkserver._forkserver
        self._host_fd = os.open(os.devnull, os.O_WRONLY)
        for name, value in (("_forkserver_address", address), ("_forkserver_alive_fd", self._host_fd),
                            ("_forkserver_pid", None),
                            ("ensure_running", resource_tracker.ensure_running)):  # nothing to start: the host runs
            patches.write(fs, name, value, "multiprocessing.forkserver._forkserver.ensure_running")

    def _unpoint(self) -> None:
        if self._host_fd is None:
            return
        fs = forkserver._forkserver
        fs.__dict__.pop("ensure_running", None)  # the class's own again
        for name in ("_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid"):
            patches.write(fs, name, None, "multiprocessing.forkserver._forkserver.ensure_running")
        os.close(self._host_fd)
        self._host_fd = None

    def _start_own(self) -> None:
        if self._thread is None:
            config = process.current_process()._config
            if config.get("tempdir") is None:
                # One per process; hex, short: the socket path under it has 107 bytes at most.
                self._folder = process_folder(f"raylaunch-mp-{pid_namespace()}-", fresh=True)
                patches.write(config, "tempdir", self._folder, "multiprocessing.process._config")
            self._thread = threading.Thread(target=_start_forkserver, daemon=True, name="raylaunch-forkserver")
            self._thread.start()

    @contextmanager
    def starting(self) -> Iterator[None]:
        """Around the start of this process's ranks: they do not run this process's main module again, and a
        warm rank host that never answers the start is not claimed again (``rankhost.starting``).

        multiprocessing has each child it starts run its parent's ``__main__`` again (as ``__mp_main__``), for a
        target defined there. A Ray worker's is Ray's ``default_worker.py``: every rank would import Ray and run
        that module's body (0.3 s of a core a rank) for nothing, as ``cluster.hosting.ranks.rank_process`` and a rank's
        payload live in importable modules."""
        original = spawn.get_preparation_data

        def without_main(name: str) -> dict[str, Any]:
            data = original(name)
            data.pop("init_main_from_path", None)
            data.pop("init_main_from_name", None)
            return data

        with _SPAWNING, (rankhost.starting(self._host) if self._host is not None else nullcontext()), \
                patches.scoped(spawn, "get_preparation_data", without_main,
                               "multiprocessing.spawn.get_preparation_data"):
            yield

    def release(self) -> None:
        with self._lock:
            self._holders -= 1
            if self._holders:
                return
            if self._host is not None:  # the host stays, warm, for the next job
                self._unpoint()
                rankhost.unclaim(self._host)
                self._host = None
            if self._thread is None:
                return
            self._thread.join(timeout=120)  # a server still starting is stopped once it runs
            self._thread = None
            self._preloaded = False
            # Its ranks are stopped already, so it is killed: a normal exit would unload torch first,
            # which can take tens of seconds while the next attempt waits for this node.
            if forkserver._forkserver._forkserver_pid is not None:
                try:
                    os.kill(forkserver._forkserver._forkserver_pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            forkserver._forkserver._stop()
            if self._folder is not None:
                shutil.rmtree(self._folder, ignore_errors=True)
                config = process.current_process()._config
                if config.get("tempdir") == self._folder:
                    patches.write(config, "tempdir", None, "multiprocessing.process._config")
                self._folder = None


def process_folder(prefix: str, fresh: bool = False) -> str:
    """This process's folder ``<prefix><pid in hex>`` in the temp folder (mode 0700), after removing those of
    processes that no longer run (one killed outright cannot remove its own); ``fresh``: emptied first (an earlier
    process's with this pid)."""
    remove_abandoned(prefix)
    folder = Path(tempfile.gettempdir()) / f"{prefix}{os.getpid():x}"
    if fresh:
        shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(mode=0o700, exist_ok=not fresh)
    return str(folder)


def remove_abandoned(prefix: str) -> None:
    """Remove the fork-server folders (``<prefix><pid in hex>`` in the temp folder) of processes that no longer run."""
    for folder in Path(tempfile.gettempdir()).glob(f"{prefix}*"):
        try:
            pid = int(folder.name[len(prefix):], 16)
        except ValueError:
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except OSError:  # runs, as another user
            pass


def _start_forkserver() -> None:
    multiprocessing.get_context("forkserver").set_forkserver_preload(FORKSERVER_PRELOAD)
    # The server is `python -c ...`, which puts its working folder (the project's) first on
    # sys.path: a project's own cluster/ folder would stand in for the runner's. PYTHONSAFEPATH
    # (Python 3.11+) leaves it out; the project stays reachable through PYTHONPATH.
    if "PYTHONSAFEPATH" not in os.environ:
        os.environ.update({"PYTHONSAFEPATH": "1", _SAFE_PATH_MARK: "1"})
    try:
        forkserver.ensure_running()
    finally:
        if os.environ.get(_SAFE_PATH_MARK):
            os.environ.pop("PYTHONSAFEPATH", None)
            os.environ.pop(_SAFE_PATH_MARK, None)


def drop_safe_path() -> None:
    """In a rank: the ``PYTHONSAFEPATH`` its server was started with is ours, not the user's (their subprocesses
    get the usual search path)."""
    if os.environ.pop(_SAFE_PATH_MARK, None):
        os.environ.pop("PYTHONSAFEPATH", None)


FORK_SERVER = ForkServer()
