"""The local processes of a node: its ranks of one attempt, and node 0's rendezvous store, forked from the node's
rank server (``cluster.hosting.forkserver``) and watched by its node actor without the actor importing torch.

Each rank's standard output and error go to files (every write, Python's and C++'s), its exception to an error
file in torch's own format (``TORCHELASTIC_ERROR_FILE``: a function under torch's ``@record`` writes the same
file), its return value to a file as JSON; the actor reads their exit codes without waiting. When a rank raises,
its siblings that are ending on their own get a moment to end (the same exception on every rank is reported as
one), then the rest are killed: the attempt has failed (after a rank killed by a signal, at once). The store is torch's ``TCPStore``, served by a process of
its own on the listening socket the actor bound.

The actor used to do this with torch's ``start_processes`` and a ``TCPStore`` of its own, which cost it 2.4 s of
a core (importing torch) on every node at every job start, and a sibling's SIGTERM grace of up to 30 s inside a
poll after a rank failed.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

from cluster.protocol import RankFailure, WorkerPayload

__all__ = ["Ended", "LocalRanks", "RankFiles", "StoreProcess"]


# After a rank raised, how long its siblings may take to end on their own before they are killed: one that raised
# the same exception writes its error file and exits within milliseconds.
SIBLING_GRACE_S = 0.3


@dataclass(frozen=True)
class RankFiles:
    """Where one rank's output, exception and return value go (its folder in the attempt's log folder)."""

    stdout: str
    stderr: str
    error: str
    result: str

    @classmethod
    def under(cls, folder: str) -> "RankFiles":
        os.makedirs(folder, exist_ok=True)
        return cls(*(os.path.join(folder, name) for name in ("stdout.log", "stderr.log", "error.json",
                                                              "result.json")))


@dataclass
class Ended:
    """The ranks of an attempt on this node once all have ended: return values (of those that returned) and
    failures, by local index."""

    returns: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, RankFailure] = field(default_factory=dict)


class LocalRanks:
    """One attempt's ranks on this node, started from the process's rank server (the caller holds
    ``FORK_SERVER.starting()`` around the construction)."""

    def __init__(self, log_dir: str, payloads: list[WorkerPayload], envs: list[dict[str, str]],
                 world_ranks: list[int]) -> None:
        ctx = multiprocessing.get_context("forkserver")
        self.world_ranks = world_ranks
        self.files = [RankFiles.under(os.path.join(log_dir, str(i))) for i in range(len(payloads))]
        self._procs: list[Any] = []
        for i, (payload, env) in enumerate(zip(payloads, envs)):
            # Not a daemon: a rank starts processes of its own (a DataLoader's workers).
            proc = ctx.Process(target=rank_process, args=(payload, env, self.files[i]), name=f"raylaunch-rank{i}")
            proc.start()
            self._procs.append(proc)

    def pids(self) -> dict[int, int]:
        """World rank -> process id."""
        return {self.world_ranks[i]: p.pid for i, p in enumerate(self._procs)}

    def sentinels(self) -> list[int]:
        """What ``multiprocessing.connection.wait`` wakes on when a rank still running ends."""
        return [p.sentinel for p in self._procs if p.exitcode is None]

    def poll(self) -> Ended | None:
        """None while the ranks run; once every rank returned, or one failed (the rest are then ended), what
        became of them."""
        codes = [p.exitcode for p in self._procs]
        failed = any(c not in (None, 0) for c in codes)
        if None in codes and not failed:
            return None
        if failed:
            # A rank raised: siblings that raised too are ending on their own, and get a moment (the same
            # exception on every rank is reported once). A rank killed by a signal leaves the rest waiting in a
            # collective: they are killed at once, which a recovery waits for.
            raised = any(c is not None and c > 0 for c in codes)
            live = [p.sentinel for p in self._procs if p.exitcode is None] if raised else []
            deadline = time.monotonic() + SIBLING_GRACE_S
            while live and time.monotonic() < deadline:
                wait(live, timeout=deadline - time.monotonic())
                live = [p.sentinel for p in self._procs if p.exitcode is None]
            codes = [p.exitcode for p in self._procs]
            self.close()
        out = Ended()
        for i, code in enumerate(codes):
            rank, files = self.world_ranks[i], self.files[i]
            if code == 0:
                out.returns[rank] = _read_json(files.result)
            elif code is not None:
                out.failures[rank] = _failure(rank, code, files.error)
            elif os.path.isfile(files.error):  # killed just now, but it had raised already: grouped with the rest
                out.failures[rank] = _failure(rank, 1, files.error)
        return out

    def close(self, timeout_s: float = 5.0) -> None:
        """Kill every rank still running (SIGKILL: a rank blocked in a collective would not answer SIGTERM, and
        SIGTERM means "preempted" to a cooperative function) and reap them."""
        for p in self._procs:
            p.kill()  # nothing once it has ended
        deadline = time.monotonic() + timeout_s
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))


def _read_json(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):  # the function ended the process itself (sys.exit(0)): nothing returned
        return None


def _failure(rank: int, exitcode: int, error_file: str) -> RankFailure:
    """How a rank ended badly, as the driver reports it: its exception and traceback (from its error file), the
    signal that ended it, or its exit code."""
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return RankFailure.killed(rank, exitcode, name)
    message = None
    try:
        with open(error_file) as f:
            message = json.load(f).get("message")
    except (OSError, ValueError, AttributeError):
        pass
    if isinstance(message, dict):
        trace = message.get("extraInfo", {}).get("py_callstack", "")
        return RankFailure.raised(rank, exitcode, str(message.get("message", "")), str(trace))
    return RankFailure.exited(rank, exitcode)


# --- in the rank ---------------------------------------------------------------------------------------------


def rank_process(payload: WorkerPayload, env: dict[str, str], files: RankFiles) -> None:
    """A forked rank: its output to its files, the job's environment, tied to its actor, then the worker; its
    return value or its exception to its files."""
    _redirect(files)
    if payload.environ is not None:  # forked by a warm rank host: the job's environment, not the host's
        os.environ.clear()
        os.environ.update(payload.environ)
    os.environ.update({**env, "TORCHELASTIC_ERROR_FILE": files.error})
    from cluster.hosting.forkserver import drop_safe_path

    drop_safe_path()
    # Processes the rank starts start as the interpreter's default has them (fork on Linux before Python 3.14), as
    # under torchrun or `accelerate launch`: forked by the fork server, the rank had inherited its "forkserver", so a
    # DataLoader worker was sent its dataset and collate function pickled (a closure's failed: "Can't pickle local
    # object") instead of inheriting them, and a library's lock (tqdm's) left a named semaphore in /dev/shm when the
    # rank was killed. (None: the default again, multiprocessing's public way.)
    multiprocessing.set_start_method(None, force=True)
    _die_with_parent()
    from cluster.rank.exiting import end_process
    from cluster.rank.worker import run_worker

    try:
        try:
            result = run_worker(payload)
        except SystemExit:  # the function ended the process: its exit code says how
            raise
        except BaseException as exc:
            _write_atomically(files.error, {"message": {
                "message": f"{type(exc).__name__}: {exc}",
                "extraInfo": {"py_callstack": traceback.format_exc(), "timestamp": str(int(time.time()))},
            }})
            sys.exit(1)  # told by its error file: no second traceback on stderr
        _write_atomically(files.result, result)
    finally:
        end_process()  # the training code's threads waited for, what they wrote flushed


def _redirect(files: RankFiles) -> None:
    """Standard output and error into the rank's files, at the descriptors: C++ writes (gloo, NCCL) too."""
    for fd, path in ((1, files.stdout), (2, files.stderr)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(target, fd)
        os.close(target)
    # Line by line, as a terminal would: the actor reads the files as the rank writes them.
    for stream in (sys.stdout, sys.stderr):
        if stream is not None and hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True)


def _write_atomically(path: str, data: Any) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def _wait_for_parent() -> None:
    """Until the node actor is gone (killed, node lost): it holds the other end of the pipe multiprocessing gave
    this process (its parent's sentinel), whichever server forked it, which reads as closed the moment the actor
    is gone. Waiting on it costs no CPU."""
    parent = multiprocessing.parent_process()
    if parent is not None:
        wait([parent.sentinel])


def _die_with_parent() -> None:
    """If the node actor dies, its ranks must not live on."""

    def watch() -> None:
        _wait_for_parent()
        os._exit(1)

    if multiprocessing.parent_process() is not None:
        threading.Thread(target=watch, daemon=True, name="raylaunch-parent-watch").start()


# --- node 0's rendezvous store ---------------------------------------------------------------------------------


class StoreProcess:
    """torch's ``TCPStore`` on a socket the actor bound and listens on, served by a process forked from the rank
    server (which has torch imported). Ranks may connect before it serves: the connection waits in the socket's
    backlog. It ends with ``close`` or with the actor."""

    def __init__(self, listener: socket.socket, timeout_s: float) -> None:
        ctx = multiprocessing.get_context("forkserver")
        self._ready_r, ready_w = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_serve_store, args=(listener, timeout_s, ready_w), daemon=True,
                                 name="raylaunch-store")
        self._proc.start()
        ready_w.close()
        listener.close()  # the store process holds it now

    def wait_ready(self, timeout_s: float) -> None:
        """Until the store serves; raises when it could not (its error says why)."""
        if not self._ready_r.poll(timeout_s):
            raise TimeoutError(f"the rendezvous store did not start within {timeout_s:g} s")
        try:
            error = self._ready_r.recv()
        except EOFError:
            error = f"the rendezvous store's process ended (exit code {self._proc.exitcode})"
        if error:
            raise OSError(error)

    def close(self) -> None:
        self._proc.kill()  # nothing once it has ended
        self._proc.join(5)
        self._ready_r.close()


def _serve_store(listener: socket.socket, timeout_s: float, ready: Any) -> None:
    from datetime import timedelta

    from torch.distributed import TCPStore

    host, port = listener.getsockname()[:2]
    try:
        store = TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s),
                         master_listen_fd=listener.fileno())
    except Exception as exc:  # noqa: BLE001  (said to the actor, which raises it)
        ready.send(f"{type(exc).__name__}: {exc}")
        return
    listener.detach()  # the store owns the descriptor now
    ready.send("")
    ready.close()
    _wait_for_parent()  # served by the store's own threads until the actor is gone (or kills it)
    del store
    os._exit(0)
