"""The per-node actor: hosts the rendezvous store on node 0 and runs the local ranks.

One instance lives in each placement-group bundle. Its methods never block
for long, so the driver can poll it, stop it, or ask it anything while the
ranks train. Local processes are started with torch's own launcher machinery
(``torch.distributed.elastic.multiprocessing.start_processes``: spawn, per-rank
environment, log redirection, error files, return values, kill on close).
We do not use ``elastic_launch``: its static rendezvous binds the store on
node 0 itself, which would bring back the bind-close-publish port race.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import socket
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster.protocol import NodePoll, NodeState, RankFailure, WorkerPayload
from cluster.errors import RaylaunchError
from cluster.layout import attempt_dir, heartbeat_file, stack_dump_file
from cluster.stacks import SAMPLE_TIMEOUT_S, RankStack, sample_processes

__all__ = ["NodeActor", "NodeInfo", "RendezvousError"]

# The variables that name the collective backends' socket interface on a node.
SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


class RendezvousError(RaylaunchError, RuntimeError):
    """Node 0 could not host the rendezvous store; the message says what to change."""


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    ip: str  # the node's Ray address
    hostname: str
    pid: int
    gpu_ids: tuple[int, ...]
    # interface name -> its IP addresses, as psutil.net_if_addrs() sees them on the node
    interfaces: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # the SOCKET_IFNAME_VARS the node's environment sets
    socket_env: dict[str, str] = field(default_factory=dict)


# A rank's output is read at most this much per poll, and a line longer than MAX_LINE is cut
# (the rest of it skipped up to its newline): a 100 MB line or a progress bar that only ever
# writes carriage returns keeps this actor's and the driver's memory bounded.
MAX_READ = 4 * 2**20
MAX_LINE = 64 * 2**10


class _Tail:
    """Reads the complete lines a growing file gained since the last call.

    A carriage return starts the line over, as on a terminal (a tqdm bar shows its last state).
    ``max_line=None`` never cuts (the runner's own event lines)."""

    def __init__(self, path: str, max_line: int | None = MAX_LINE) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""
        self.max_line = max_line
        self.skipping = False  # inside a line already cut: drop bytes up to its newline

    def read(self, final: bool = False) -> list[str]:
        """The lines since the last call: at most MAX_READ bytes' worth, or all of it when ``final``."""
        out: list[bytes] = []
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                while True:
                    data = f.read(MAX_READ if self.max_line else -1)
                    self.offset += len(data)
                    self._feed(data, out)
                    if not final or not self.max_line or len(data) < MAX_READ:
                        break
        except FileNotFoundError:
            return []
        if final and self.partial:
            out.append(self._shape(self.partial))
            self.partial = b""
        return [line.decode("utf-8", "replace") for line in out]

    def _feed(self, data: bytes, out: list[bytes]) -> None:
        pieces = data.split(b"\n")
        tail = pieces.pop()  # not ended by a newline yet
        for piece in pieces:
            line, skipped = self.partial + piece, self.skipping
            self.partial, self.skipping = b"", False
            if not skipped:  # else: the end of a line already given, cut
                out.append(self._shape(line))
        if not self.skipping:
            self.partial = self.partial + tail
            if self.max_line:
                self.partial = self._last_segment(self.partial)
                if len(self.partial) > self.max_line:
                    out.append(self._shape(self.partial))
                    self.partial, self.skipping = b"", True

    def _last_segment(self, line: bytes) -> bytes:
        """What a terminal shows of a line rewritten with carriage returns."""
        cut = line.rfind(b"\r", 0, len(line) - 1) if line.endswith(b"\r") else line.rfind(b"\r")
        return line[cut + 1:] if cut >= 0 else line

    def _shape(self, line: bytes) -> bytes:
        if not self.max_line:
            return line
        line = self._last_segment(line)
        if len(line) > self.max_line:
            line = line[: self.max_line] + f" ... [line cut at {self.max_line} bytes]".encode()
        return line


class NodeActor:
    """Runs as a Ray actor, one per node (see ``cluster.group``)."""

    def __init__(self, node_rank: int) -> None:
        self.node_rank = node_rank
        self._tmp = tempfile.mkdtemp(prefix=f"raylaunch-node{node_rank}-")
        self._store = None
        self._pctx = None
        self._ranks: list[int] = []
        self._tails: list[tuple[int, str, _Tail]] = []
        self._state = NodeState.IDLE
        self._beats: dict[int, str] = {}
        self._dumps: dict[int, str] = {}  # world rank -> the file its faulthandler writes to
        self._flight: dict[int, str] = {}  # world rank -> its NCCL Flight Recorder dump
        self._released = False  # this actor's hold on the process's rank fork server
        # Ranks fork from a server that imported torch and Accelerate while the
        # driver was still reserving and checking storage: a rank starts in
        # milliseconds instead of importing torch itself, in every attempt.
        _FORKSERVER.acquire()

    def describe(self) -> NodeInfo:
        import socket

        import psutil
        import ray

        return NodeInfo(
            node_id=ray.get_runtime_context().get_node_id(),
            ip=ray.util.get_node_ip_address(),
            hostname=socket.gethostname(),
            pid=os.getpid(),
            gpu_ids=tuple(int(g) for g in ray.get_gpu_ids()),
            interfaces={name: tuple(a.address for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6))
                        for name, addrs in psutil.net_if_addrs().items()},
            socket_env={k: os.environ[k] for k in SOCKET_IFNAME_VARS if os.environ.get(k)},
        )

    def host_store(self, ip: str, timeout_s: float, ports: tuple[int, int] | None = None) -> int:
        """Bind and hold the rendezvous TCPStore on a free port; return the port.

        ``ports`` (low, high): the first port in the range that binds. Binding is the
        test, so two jobs starting together cannot both pick a port; the bound store
        then holds it. None: a port the system picks.
        """
        from datetime import timedelta

        from torch.distributed import DistNetworkError, TCPStore

        self._store = None  # a new store for every attempt: no stale rank can join
        candidates = [0] if ports is None else range(ports[0], ports[1] + 1)
        for port in candidates:
            # Bound here, on the node's own address (the one the ranks use), and handed to the
            # store: TCPStore would listen on every interface of the machine.
            sock = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((ip, port))
                sock.listen(512)
            except OSError as exc:
                sock.close()
                if port == 0 or exc.errno != errno.EADDRINUSE:
                    raise
                continue
            try:
                self._store = TCPStore(ip, sock.getsockname()[1], is_master=True, wait_for_workers=False,
                                       timeout=timedelta(seconds=timeout_s), master_listen_fd=sock.fileno())
            except DistNetworkError:
                sock.close()
                raise
            sock.detach()  # the store owns the descriptor now, and closes it with itself
            return self._store.port
        low, high = ports
        raise RendezvousError(
            f"no free port for the rendezvous store on node 0 ({ip}): all {high - low + 1} ports of "
            f"rendezvous.ports {low}-{high} are in use. Widen the range (--set rendezvous.ports=LOW-HIGH) "
            "or end what holds them."
        )

    def start(self, payloads: list[WorkerPayload], envs: list[dict[str, str]], attempt: int) -> None:
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std, start_processes

        if self._pctx is not None:
            raise RuntimeError("this node's ranks are still running; stop them first")
        log_dir = os.path.join(self._tmp, attempt_dir(attempt))
        os.makedirs(log_dir, exist_ok=True)
        full_envs = {}
        for i, env in enumerate(envs):
            full_envs[i] = {**env, "TORCHELASTIC_RUN_ID": "raylaunch", "TORCHELASTIC_RESTART_COUNT": str(attempt)}
        self._ranks = [p.context.world_rank for p in payloads]
        self._pctx = start_processes(
            name="raylaunch",
            entrypoint=_rank_main,
            args={i: (p,) for i, p in enumerate(payloads)},
            envs=full_envs,
            logs_specs=DefaultLogsSpecs(log_dir=log_dir, redirects=Std.ALL),
            start_method="forkserver",
        )
        self._beats = {p.context.world_rank: heartbeat_file(p.events_path) for p in payloads}
        self._dumps = {p.context.world_rank: stack_dump_file(p.events_path) for p in payloads}
        self._flight = {p.context.world_rank: env["TORCH_FR_DUMP_TEMP_FILE"] + str(p.context.world_rank)
                        for p, env in zip(payloads, envs) if "TORCH_FR_DUMP_TEMP_FILE" in env}
        self._tails = []
        for i, rank in enumerate(self._ranks):
            self._tails.append((rank, "stdout", _Tail(self._pctx.stdouts[i])))
            self._tails.append((rank, "stderr", _Tail(self._pctx.stderrs[i])))
            self._tails.append((rank, "event", _Tail(payloads[i].events_path, max_line=None)))
        self._state = NodeState.RUNNING

    def pids(self) -> dict[int, int]:
        """World rank -> process id of the ranks running now."""
        if self._pctx is None:
            return {}
        return {self._ranks[i]: pid for i, pid in self._pctx.pids().items()}

    def stacks(self, timeout_s: float = SAMPLE_TIMEOUT_S) -> tuple[list[RankStack], dict[int, bytes]]:
        """Every local rank's stacks, read at once within about ``timeout_s``, without
        stopping them; and the NCCL Flight Recorder dumps the ranks wrote (GPU nodes)."""
        stacks = sample_processes(self.pids(), self.node_rank, self._dumps, timeout_s)
        dumps = {}
        for rank, path in self._flight.items():
            if os.path.isfile(path):
                with open(path, "rb") as f:
                    dumps[rank] = f.read()
        return stacks, dumps

    def poll(self) -> NodePoll:
        out = NodePoll(state=self._state)
        if self._pctx is None:
            return out
        result = self._pctx.wait(0)
        if result is not None:
            out.state = self._state = NodeState.FAILED if result.is_failed() else NodeState.SUCCEEDED
            out.returns = {self._ranks[i]: v for i, v in result.return_values.items()}
            out.failures = [_failure(self._ranks[i], f) for i, f in result.failures.items()]
            if out.failures:
                out.failures += self._sibling_failures(set(result.failures))
        self._drain(out, final=result is not None)
        if result is not None:
            self._pctx = None
        else:
            import time

            now = time.time()
            for rank, path in self._beats.items():
                try:
                    out.beat_age_s[rank] = now - os.stat(path).st_mtime
                except FileNotFoundError:
                    pass
        return out

    def _sibling_failures(self, reported: set[int]) -> list[RankFailure]:
        """torch reports the first local failure and kills the rest; a sibling that had
        already raised left its error file, so the driver can group identical errors."""
        from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

        out = []
        for i, path in self._pctx.error_files.items():
            if i not in reported and path and os.path.isfile(path):
                f = ProcessFailure(local_rank=i, pid=0, exitcode=1, error_file=path)
                out.append(_failure(self._ranks[i], f))
        return out

    def _drain(self, out: NodePoll, final: bool) -> None:
        for rank, stream, tail in self._tails:
            for line in tail.read(final):
                if stream == "event":
                    if line.strip():
                        try:
                            out.events.append(json.loads(line))
                        except ValueError:  # a torn line (the rank was killed mid-write)
                            out.logs.append((rank, "stderr", f"raylaunch: an unreadable event line was skipped: "
                                                             f"{line[:200]!r}"))
                else:
                    out.logs.append((rank, stream, line))

    def stop(self) -> NodePoll:
        """Stop every local rank (SIGKILL: a rank blocked in a collective would not
        answer SIGTERM, and SIGTERM means "preempted" to a cooperative function)."""
        out = NodePoll(state=self._state)
        if self._pctx is not None:
            self._pctx.close(death_sig=signal.SIGKILL, timeout=5)
            self._pctx = None
            out.state = self._state = NodeState.STOPPED
            self._drain(out, final=True)
        self._store = None
        return out

    def shutdown(self) -> None:
        self.stop()
        self._store = None
        shutil.rmtree(self._tmp, ignore_errors=True)
        if not self._released:
            self._released = True
            _FORKSERVER.release()

    def read_file(self, uri: str) -> str | None:
        """The text of a file on storage as this node sees it, or None."""
        from cluster.storage_io import open_uri

        try:
            fs, path = open_uri(uri)
            with fs.open_input_stream(path) as f:
                return f.read().decode()
        except (OSError, FileNotFoundError):
            return None

    def scratch_dir(self) -> str:
        return self._tmp


def _failure(rank: int, f: Any) -> RankFailure:
    """A torch ``ProcessFailure`` as the driver reports it: the exception line and traceback."""
    if f.exitcode is not None and f.exitcode < 0:
        return RankFailure.killed(rank, f.exitcode, f.signal_name())
    data = f.error_file_data if isinstance(f.error_file_data, dict) else {}
    message = data.get("message")
    if isinstance(message, dict):  # written by the @record handler around our entry point
        traceback = message.get("extraInfo", {}).get("py_callstack", "")
        return RankFailure(rank, f.exitcode, str(message.get("message", "")), str(traceback))
    return RankFailure(rank, f.exitcode, f"exited with code {f.exitcode} (no Python exception)", "")


def _rank_main(payload: WorkerPayload) -> Any:
    from cluster.worker import run_worker

    if os.environ.pop(_SAFE_PATH_MARK, None):  # ours, not the user's: their subprocesses get the usual path
        os.environ.pop("PYTHONSAFEPATH", None)
    _die_with_parent()
    return run_worker(payload)


# What the rank fork server imports once, before any rank starts (not CUDA: importing torch
# does not initialise it, so forked ranks can still pick their GPU).
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "accelerate", "cluster.worker", "cluster.runtime"]


_SAFE_PATH_MARK = "RAYLAUNCH_SET_PYTHONSAFEPATH"


class _ForkServer:
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

    def acquire(self) -> None:
        with self._lock:
            self._holders += 1
            if self._thread is None:
                from multiprocessing import process

                config = process.current_process()._config
                if config.get("tempdir") is None:
                    prefix = f"raylaunch-mp-{_pid_namespace()}-"
                    _remove_abandoned(prefix)
                    # One per process; hex, short: the socket path under it has 107 bytes at most.
                    folder = Path(tempfile.gettempdir()) / f"{prefix}{os.getpid():x}"
                    shutil.rmtree(folder, ignore_errors=True)  # an earlier process's with this pid
                    folder.mkdir(mode=0o700)
                    self._folder = config["tempdir"] = str(folder)
                self._thread = threading.Thread(target=_start_forkserver, daemon=True, name="raylaunch-forkserver")
                self._thread.start()

    def release(self) -> None:
        with self._lock:
            self._holders -= 1
            if self._holders or self._thread is None:
                return
            from multiprocessing import forkserver, process

            self._thread.join(timeout=120)  # a server still starting is stopped once it runs
            self._thread = None
            # Its ranks are stopped already; asked to stop, it would exit as Python does, unloading
            # torch, which took 25 s on a loaded machine while the next attempt waited for this node.
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
                    config["tempdir"] = None
                self._folder = None


def _pid_namespace() -> str:
    """This process's PID namespace, in hex (the inode of ``/proc/self/ns/pid``)."""
    try:
        return f"{os.stat('/proc/self/ns/pid').st_ino:x}"
    except OSError:  # not Linux
        return "0"


def _remove_abandoned(prefix: str) -> None:
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
    import multiprocessing
    from multiprocessing import forkserver

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
    # And what this actor needs itself (the store, start_processes), before it is asked.
    import torch.distributed.elastic.multiprocessing  # noqa: F401

    _plain_elastic_log()


def _plain_elastic_log() -> None:
    """torch logs each rank failure it finds (and each process it closes) through the ``torch``
    logger, whose formatter imports ``torch._dynamo`` (sympy and more) on first use: 10 to 25
    seconds inside a poll on a loaded machine, while the driver waited on this node to stop its
    ranks after a peer was lost. Those records go to this actor's stderr with a plain formatter
    instead (the driver reports every failure itself, with the rank's traceback)."""
    import logging

    log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    if not log.propagate:  # done already (the fork server starts again after a full release)
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    log.addHandler(handler)
    log.propagate = False


def _die_with_parent() -> None:
    """If the node actor dies (killed, node lost), its ranks must not live on."""
    import threading
    import time

    parent = os.getppid()

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True, name="raylaunch-parent-watch").start()


_FORKSERVER = _ForkServer()
