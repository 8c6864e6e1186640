"""The per-node actor: hosts the rendezvous store on node 0 and runs the local ranks.

One instance lives in each placement-group bundle. Its methods never block
for long, so the driver can poll it, stop it, or ask it anything while the
ranks train. Its processes (the ranks, node 0's store) are forked from the
node's rank server and watched by ``cluster.hosting.ranks``: the actor itself never
imports torch. We do not use torch's ``elastic_launch``: its static rendezvous
binds the store on node 0 itself, which would bring back the bind-close-publish
port race.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait

import ray

from cluster import snapshots as memory
from cluster.snapshots import snapshot_root
from cluster.errors import RaylaunchError
from cluster.hosting.forkserver import FORK_SERVER, pid_namespace, process_folder
from cluster.hosting.rankhost import PROJECT_VAR, WarmHost, rss_mb
from cluster.hosting.ranks import LocalRanks, StoreProcess
from cluster.hosting.tail import Tail
from cluster.layout import attempt_dir, heartbeat_file, stack_dump_file
from cluster.metric_rows import RowBatcher
from cluster.protocol import METRICS_ROWS, EventKind, NodePoll, NodeState, WorkerPayload, metrics_lines
from cluster.stacks import SAMPLE_TIMEOUT_S, RankStack, sample_processes

__all__ = ["SNAPSHOT_GROUP", "NodeActor", "NodeInfo", "RendezvousError", "wake_poll"]

# The variables that name the collective backends' socket interface on a node.
SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


# The actor's calls run one at a time on its main thread (but those that move snapshots' parts: a concurrency group
# of their own, SNAPSHOT_GROUP, so that a poll never waits seconds behind a copy of hundreds of MiB). An actor with a
# concurrency group runs its other calls in a thread pool too unless its ``max_concurrency`` is 0
# (``cluster.nodes.group``): Ray's task loop wakes the main thread every 10 ms to check for signals (its own GIL and
# timer round trip) except while a call runs there, so a poll held on it keeps the node actor at about 0.005 cores
# in steady training instead of 0.013-0.015 (#58: 101 wakeups a second, 0.0087 cores, on the idle main thread while
# the calls ran in the pool). A call that only looks (``pids``, ``stacks``) waits behind a held poll at most its hold
# (``jobs.driver.attempt.POLL_HOLD_S``, 1 s).
# How often a held poll reads the ranks' files (a rank that ends wakes it at once). A poll held for 1 s reads them
# three times and answers after the full second (it answered after 0.75 s with four reads at 0.25 s).
POLL_TICK_S = 0.5
# The concurrency group of the calls that move snapshots' parts (``cluster.snapshots``): a thread of their own.
SNAPSHOT_GROUP = "snapshots"
# What ranks report all along, which a held poll gathers: anything else (joined, a checkpoint part, a stop notice)
# answers at once.
ROUTINE_EVENTS = frozenset({EventKind.METRICS, EventKind.RESOURCES, EventKind.PACE, EventKind.SNAPSHOT})


def needs_driver(fresh: list[dict]) -> bool:
    """Whether events just gathered answer a held poll at once: anything but routine rows.

    >>> needs_driver([{"kind": "metrics"}, {"kind": "joined"}]), needs_driver([{"kind": "metrics"}])
    (True, False)
    """
    return any(e.get("kind") not in ROUTINE_EVENTS for e in fresh)


def oldest_time(events: list[dict]) -> float | None:
    """The earliest ``time`` of ``events`` (those a held poll gathered); None without any."""
    return min((e["time"] for e in events if isinstance(e.get("time"), (int, float))), default=None)


def next_look(left: float, oldest: float | None, now: float, max_age_s: float) -> float:
    """Seconds until a held poll looks again: the next tick, the hold's end (``left``), or the moment its oldest
    row (``oldest``) has waited ``max_age_s``, whichever comes first; 0: answer now.

    >>> next_look(0.9, None, 10.0, 0.5), round(next_look(0.9, 9.8, 10.0, 0.5), 3), next_look(0.2, 9.8, 10.0, 0.5)
    (0.5, 0.3, 0.2)
    >>> next_look(0.9, 9.4, 10.0, 0.5), next_look(-0.1, None, 10.0, 0.5)
    (0.0, 0.0)
    """
    due = oldest + max_age_s - now if oldest is not None else POLL_TICK_S
    return max(0.0, min(POLL_TICK_S, left, due))


def wake_poll(ip: str, port: int) -> None:
    """Have the node actor at ``ip`` answer its held poll now (``NodeInfo.wake_port``): one datagram, sent and not
    waited on. Lost (a firewall, a node gone), the poll answers at its hold's end as before."""
    if not port:
        return
    try:
        family = socket.getaddrinfo(ip, port, type=socket.SOCK_DGRAM)[0][0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.sendto(b"wake", (ip, port))
    except OSError:
        pass


def _wake_socket(ip: str) -> socket.socket | None:
    """The node actor's wake-up socket (``wake_poll``): UDP on an ephemeral port of the node's Ray address, or of
    every address where that one is not this host's (an address behind NAT); None where neither binds (the polls
    then answer at their hold's end)."""
    for host in (ip, ""):
        try:
            sock = socket.socket(socket.getaddrinfo(ip, 0, type=socket.SOCK_DGRAM)[0][0], socket.SOCK_DGRAM)
        except OSError:
            return None
        try:
            sock.bind((host, 0))
            sock.setblocking(False)
            return sock
        except OSError:
            sock.close()
    return None


def _drain_datagrams(sock: socket.socket) -> None:
    while True:
        try:
            sock.recv(64)
        except OSError:  # (BlockingIOError: none left)
            return


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
    # where the node's ranks fork from (a warm rank host, or the actor's own server, and why), its pid if a host
    rank_host: str = ""
    rank_host_pid: int | None = None
    # where the node keeps snapshots in memory (``cluster.checkpoint.memory.snapshot_root``) and its free bytes there
    snapshot_root: str = ""
    # the UDP port at ``ip`` that wakes the node's held poll (``wake_poll``)
    wake_port: int = 0


class NodeActor:
    """Runs as a Ray actor, one per node (see ``cluster.nodes.group``)."""

    def __init__(self, node_rank: int, warm: WarmHost | None = None, environ: dict[str, str] | None = None) -> None:
        """``environ``: variables this actor sets on itself first (``cluster.nodes.connect.node_environment``); the
        folders of its ``PYTHONPATH`` go on its search path, which its ranks get."""
        if environ:
            os.environ.update(environ)
            sys.path[1:1] = [p for p in dict.fromkeys(environ.get("PYTHONPATH", "").split(os.pathsep))
                             if p and p not in sys.path]
        self.node_rank = node_rank
        self._tmp = tempfile.mkdtemp(prefix=f"node{node_rank}-", dir=_process_scratch())
        self._listener: socket.socket | None = None  # node 0: the store's socket, bound, until its process serves it
        self._store_timeout_s = 0.0
        self._store: StoreProcess | None = None
        self._pctx: LocalRanks | None = None
        self._ranks: list[int] = []
        self._tails: list[tuple[int, str, Tail]] = []
        self._state = NodeState.IDLE
        self._beats: dict[int, str] = {}
        self._dumps: dict[int, str] = {}  # world rank -> the file its faulthandler writes to
        self._flight: dict[int, str] = {}  # world rank -> its NCCL Flight Recorder dump
        self._released = False  # this actor's hold on the process's rank fork server
        # A held poll's wake-up (``wake_poll``): a datagram to this socket, from the driver about to stop the ranks
        # after one failed. Through an actor call it ran only once the poll had answered: the actor dispatches a call
        # of any concurrency group from its main thread, which the held poll keeps (0.47 s of the 1.9 s from a rank
        # killed to training again in ``make bench-recovery``, the other node's poll answering at its hold's end).
        self._wake = _wake_socket(ray.util.get_node_ip_address())
        self._notes: list[str] = []  # said with the next poll, in its first rank's log
        self._stepped = False  # the ranks of this attempt logged a step (a held poll answers at the first)
        self._batcher: RowBatcher | None = None  # this attempt's metrics rows, rendered here for the driver
        # `raylaunch run` without an address: ranks start in the actor's folder (multiprocessing hands a child its
        # parent's), which is its raylet's; a node that `connect` added during its connection may have started in
        # the runner's folder. Every node's ranks start in the project's, as the head's do.
        project = os.environ.get(PROJECT_VAR)
        if project and os.path.isdir(project):
            os.chdir(project)
        # A warm rank host claimed now, or a server of this actor's own started now, so it has imported torch
        # and Accelerate before the first ranks start (the actor never imports torch: ``cluster.hosting.ranks``).
        FORK_SERVER.acquire(warm)

    def describe(self) -> NodeInfo:
        import psutil

        return NodeInfo(
            node_id=ray.get_runtime_context().get_node_id(),
            ip=ray.util.get_node_ip_address(),
            hostname=socket.gethostname(),
            pid=os.getpid(),
            gpu_ids=tuple(int(g) for g in ray.get_gpu_ids()),
            interfaces={name: tuple(a.address for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6))
                        for name, addrs in psutil.net_if_addrs().items()},
            socket_env={k: os.environ[k] for k in SOCKET_IFNAME_VARS if os.environ.get(k)},
            rank_host=self._host_note(),
            rank_host_pid=FORK_SERVER.host_pid,
            snapshot_root=snapshot_root(),
            wake_port=self._wake.getsockname()[1] if self._wake is not None else 0,
        )

    @staticmethod
    def _host_note() -> str:
        """Where the ranks fork from; a reused host's memory with it (held while it idles between jobs)."""
        pid = FORK_SERVER.host_pid
        size = rss_mb(pid) if pid else None
        return f"{FORK_SERVER.note}, {size:.0f} MB resident" if size and "reused" in FORK_SERVER.note else FORK_SERVER.note

    def host_store(self, ip: str, timeout_s: float, ports: tuple[int, int] | None = None) -> int:
        """Bind and hold the rendezvous store's socket on a free port; return the port. The store (torch's
        ``TCPStore``) serves it from ``start`` on, in a process forked from the rank server before the ranks.

        ``ports`` (low, high): the first port in the range that binds. Binding is the
        test, so two jobs starting together cannot both pick a port; the bound socket
        then holds it. None: a port the system picks.
        """
        self._close_store()  # a new store for every attempt: no stale rank can join
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
            self._listener, self._store_timeout_s = sock, timeout_s
            return sock.getsockname()[1]
        low, high = ports
        raise RendezvousError(
            f"no free port for the rendezvous store on node 0 ({ip}): all {high - low + 1} ports of "
            f"rendezvous.ports {low}-{high} are in use. Widen the range (--set rendezvous.ports=LOW-HIGH) "
            "or end what holds them."
        )

    def _serve_store(self) -> None:
        """Node 0, at the start of its ranks: the store serves the bound socket."""
        if self._listener is None:
            return
        listener, self._listener = self._listener, None
        with FORK_SERVER.starting():
            self._store = StoreProcess(listener, self._store_timeout_s)
        try:
            self._store.wait_ready(60.0)
        except OSError as exc:
            self._close_store()
            raise RendezvousError(f"node 0 could not serve the rendezvous store: {exc}") from None

    def _close_store(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._store is not None:
            self._store.close()
            self._store = None

    def prepare(self) -> None:
        """Before ``start``: wait until the server the ranks fork from has imported everything (a warm host still
        importing, or this actor's own server), so that a start takes a fork's time (the driver bounds it)."""
        note = FORK_SERVER.note
        FORK_SERVER.ready()
        if FORK_SERVER.note != note:  # the host could not be used after all: say why, with the ranks' output
            self._notes.append(f"raylaunch: node {self.node_rank}: {FORK_SERVER.note}")
        FORK_SERVER.preloaded()

    def start(self, payloads: list[WorkerPayload], envs: list[dict[str, str]], attempt: int) -> None:
        if self._pctx is not None:
            raise RuntimeError("this node's ranks are still running; stop them first")
        self.prepare()  # done already, unless a caller skipped it
        log_dir = os.path.join(self._tmp, attempt_dir(attempt))
        os.makedirs(log_dir, exist_ok=True)
        # torch's launcher's variables, which code may read (the restart count of this run)
        envs = [{**env, "TORCHELASTIC_RUN_ID": "raylaunch", "TORCHELASTIC_RESTART_COUNT": str(attempt)} for env in envs]
        if FORK_SERVER.host_pid is not None:  # the host's environment is not the job's: each rank gets the job's
            payloads = [dataclasses.replace(p, environ={**os.environ, **env}) for p, env in zip(payloads, envs)]
        self._ranks = [p.context.world_rank for p in payloads]
        # Node 0's store first, forked as the ranks are: a rank server that never answers hangs this start, which
        # the driver bounds (timeouts.rendezvous_s), and the host is replaced (``rankhost.starting``).
        self._serve_store()
        with FORK_SERVER.starting():
            self._pctx = LocalRanks(log_dir, payloads, envs, self._ranks)
        self._beats = {p.context.world_rank: heartbeat_file(p.events_path) for p in payloads}
        self._dumps = {p.context.world_rank: stack_dump_file(p.events_path) for p in payloads}
        self._flight = {p.context.world_rank: env["TORCH_FR_DUMP_TEMP_FILE"] + str(p.context.world_rank)
                        for p, env in zip(payloads, envs) if "TORCH_FR_DUMP_TEMP_FILE" in env}
        self._tails = []
        self._stepped = False
        self._batcher = RowBatcher(attempt, payloads[0].context.world_size if payloads else 0,
                                   {rank: self.node_rank for rank in self._ranks})
        for i, rank in enumerate(self._ranks):
            self._tails.append((rank, "stdout", Tail(self._pctx.files[i].stdout)))
            self._tails.append((rank, "stderr", Tail(self._pctx.files[i].stderr)))
            self._tails.append((rank, "event", Tail(payloads[i].events_path, max_line=None)))
        self._state = NodeState.RUNNING

    def pids(self) -> dict[int, int]:
        """World rank -> process id of the ranks running now."""
        return {} if self._pctx is None else self._pctx.pids()

    def stacks(self, timeout_s: float = SAMPLE_TIMEOUT_S) -> tuple[list[RankStack], dict[int, bytes]]:
        """Every local rank's stacks, read at once within about ``timeout_s``, without
        stopping them; and the NCCL Flight Recorder dumps the ranks wrote (GPU nodes)."""
        host = f"{socket.gethostname()} ({ray.util.get_node_ip_address()})"
        stacks = [dataclasses.replace(s, host=host)
                  for s in sample_processes(self.pids(), self.node_rank, self._dumps, timeout_s)]
        dumps = {}
        for rank, path in self._flight.items():
            if os.path.isfile(path):
                with open(path, "rb") as f:
                    dumps[rank] = f.read()
        return stacks, dumps

    # Each call costs the actor about 3 ms of a core in Ray's own task machinery (measured: its main thread spent
    # 0.0135 cores on 4 polls a second, of which reading the ranks' lines was under a tenth), and the driver about
    # 2 ms: so a poll is held here, reading the ranks' files every ``POLL_TICK_S``, and answers once something
    # needs the driver, or after ``hold_s`` (the node's heartbeat to the driver). Ray's task events for each call
    # (three, sent to the GCS) are off; a call's failure still reaches the driver as its error.
    @ray.method(enable_task_events=False)
    def poll(self, hold_s: float = 0.0, max_age_s: float | None = None) -> NodePoll:
        """What happened since the last poll; with ``hold_s``, gathered for up to that long: it answers at once when
        a rank ends (or fails) or says something other than its metrics (it joined, saved a checkpoint part, got
        a stop notice), and otherwise once the oldest metrics row it holds waited ``max_age_s`` (the hold when not
        given), or after ``hold_s``, with the metrics and log lines of that time."""
        out = NodePoll(state=self._state)
        max_age_s = hold_s if max_age_s is None else max_age_s
        deadline = time.monotonic() + hold_s
        while True:
            if self._gather(out):
                return self._rendered(out)
            # a rank that ends wakes the poll at once; files are read again after the tick, or when the oldest row
            # gathered is due
            pause = next_look(deadline - time.monotonic(), oldest_time(out.events), time.time(), max_age_s)
            if pause <= 0:
                return self._rendered(out)
            live = self._pctx.sentinels() if self._pctx is not None else []
            ready = wait([*live, *([self._wake] if self._wake is not None else [])], timeout=pause)
            if self._wake is not None and self._wake in ready:
                _drain_datagrams(self._wake)
                self._gather(out)
                return self._rendered(out)

    def _rendered(self, out: NodePoll) -> NodePoll:
        """``out`` with its metrics events as rows rendered here (``cluster.metric_rows``): the driver's work for
        each row is done by the node that read it."""
        if self._batcher is not None:
            out.events, batch = self._batcher.take(out.events)
            if batch:
                out.rows.append(batch)
        return out

    def _gather(self, out: NodePoll) -> bool:
        """Add what happened since the last look to ``out``; whether it needs the driver now."""
        if self._pctx is None:
            return True
        result = self._pctx.poll()
        seen = len(out.events)
        if result is not None:
            out.state = self._state = NodeState.FAILED if result.failures else NodeState.SUCCEEDED
            out.returns = result.returns
            out.failures = list(result.failures.values())
        self._drain(out, final=result is not None)
        if result is not None:
            self._pctx = None
            return True
        now = time.time()
        for rank, path in self._beats.items():
            try:
                out.beat_age_s[rank] = now - os.stat(path).st_mtime
            except FileNotFoundError:
                pass
        fresh = out.events[seen:]
        if needs_driver(fresh):
            return True
        if not self._stepped and any(e.get("kind") == EventKind.METRICS for e in fresh):
            self._stepped = True  # the attempt's first step: its progress line, at once
            return True
        return False

    def _drain(self, out: NodePoll, final: bool) -> None:
        if self._notes and self._ranks:
            out.logs.extend((self._ranks[0], "stderr", note) for note in self._notes)
            self._notes.clear()
        for rank, stream, tail in self._tails:
            for line in tail.read(final):
                if stream == "event":
                    if line.strip():
                        try:
                            event = json.loads(line)
                        except ValueError:  # a torn line (the rank was killed mid-write)
                            out.logs.append((rank, "stderr", f"raylaunch: an unreadable event line was skipped: "
                                                             f"{line[:200]!r}"))
                            continue
                        if type(event) is dict and event.get("kind") == METRICS_ROWS:  # a batch of metrics rows
                            out.events.extend(metrics_lines(event))
                        else:
                            out.events.append(event)
                else:
                    out.logs.append((rank, stream, line))

    def stop_notice(self) -> None:
        """SIGTERM to every local rank, as a spot node's preemption gives it: a function with snapshots (or one that
        asks ``session.preempted``) stops at a step every rank agrees on, with what it needs to resume from there."""
        import signal

        for pid in (self._pctx.pids() if self._pctx is not None else {}).values():
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def stop(self) -> NodePoll:
        """Stop every local rank (SIGKILL: a rank blocked in a collective would not
        answer SIGTERM, and SIGTERM means "preempted" to a cooperative function)."""
        out = NodePoll(state=self._state)
        if self._pctx is not None:
            self._pctx.close()
            self._pctx = None
            out.state = self._state = NodeState.STOPPED
            self._drain(out, final=True)
        self._close_store()
        return self._rendered(out)

    def shutdown(self) -> None:
        self.stop()
        if self._wake is not None:
            self._wake.close()
        shutil.rmtree(self._tmp, ignore_errors=True)
        if not self._released:
            self._released = True
            FORK_SERVER.release()

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

    # --- snapshots in memory (cluster/checkpoint/memory.py): the driver moves parts from node to node through these

    @ray.method(concurrency_group=SNAPSHOT_GROUP)
    def offer_snapshot_part(self, node_dir: str, step: int, rank: int,
                            background: bool = False) -> memory.PartOffer | None:
        """A rank's part held here, offered to one other node over TCP (``cluster.snapshots.offer_part``;
        ``background``: a copy to its peer, beside training)."""
        return memory.offer_part(node_dir, step, rank, ray.util.get_node_ip_address(), background)

    @ray.method(concurrency_group=SNAPSHOT_GROUP)
    def keep_peer_part(self, node_dir: str, step: int, rank: int, offer: memory.PartOffer | None,
                       memory_mb: float | None) -> bool:
        return offer is not None and memory.keep_peer_part(node_dir, step, rank, offer,
                                                            memory.node_budget_bytes(memory_mb, node_dir))

    @ray.method(concurrency_group=SNAPSHOT_GROUP)
    def snapshot_part_copied(self, node_dir: str, step: int, rank: int) -> None:
        memory.note_copied(node_dir, rank, step)

    @ray.method(concurrency_group=SNAPSHOT_GROUP)
    def assemble_snapshot(self, node_dir: str, step: int, world_size: int, attempt: int, ranks: list[int],
                          *parts: memory.PartOffer | None) -> str:
        """The snapshot of ``step`` whole in this node's ``restore-<step>``; ``parts``: those of ``ranks``, read from
        the nodes that hold them (their offers, resolved by Ray before this runs)."""
        if any(p is None for p in parts):
            for p in parts:
                memory.decline(p)
            raise FileNotFoundError(f"a part of the snapshot of step {step} was no longer held by its node")
        return memory.assemble(node_dir, step, world_size, attempt, dict(zip(ranks, parts)))

    @ray.method(concurrency_group=SNAPSHOT_GROUP)
    def snapshot_part_files(self, node_dir: str, step: int, rank: int) -> dict[str, dict] | None:
        return memory.part_files(node_dir, step, rank)

    @ray.method(concurrency_group=SNAPSHOT_GROUP)
    def store_snapshot_part(self, node_dir: str, step: int, rank: int, rels: list[str], target_uri: str,
                            until: float) -> dict[str, dict]:
        """A rank's part of ``step`` held here, written into a checkpoint's staging folder on storage before
        ``until`` (a stop notice's deadline: ``cluster.snapshots.store_part``)."""
        return memory.store_part(node_dir, step, rank, rels, target_uri, until)

    @ray.method(concurrency_group=SNAPSHOT_GROUP)
    def pin_snapshot(self, node_dir: str, step: int | None, writing: tuple[int, ...] = ()) -> None:
        memory.pin(node_dir, step, writing)

    @ray.method(concurrency_group=SNAPSHOT_GROUP)
    def drop_snapshots(self, run_dir: str) -> None:
        memory.drop_run(run_dir)


def _process_scratch() -> str:
    """This process's folder for its node actors' scratch folders (``raylaunch-node-<pid namespace>-<pid>``, in
    hex); the folders of processes that no longer run (an actor killed outright cannot remove its own) go now."""
    return process_folder(f"raylaunch-node-{pid_namespace()}-")
