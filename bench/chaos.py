"""Chaos: training jobs run while a seeded schedule injects faults at random moments, including inside
recoveries and commits; then checks that nothing was lost, nothing is left running and the model is the one an
undisturbed run ends with (`make chaos`; `tests/test_chaos.py` runs a short fixed schedule of it).

One ``ray.cluster_utils.Cluster`` in this process (a head and one more node, 2 CPUs each; Ray's temporary folders
in a ``tempfile.mkdtemp()`` folder), the runs' storage on a small tmpfs this script mounts (when it may: root), or on
an S3-compatible object store (moto's server, a process of its own) reached through a TCP proxy this script controls;
every job's driver a ``python -m jobs.cli run SPEC --address ...`` subprocess. Rounds run, in turn (``JOBS``), the
digits example on the small disk (its final weights compared with an undisturbed run's), an elastic job
(``tests/fns.py`` ``elastic``, ``min_nodes: 1`` of 2: every sample of every epoch seen once, the global batch kept)
and the digits example on the object store (the same reference: where a run is kept does not change its model), each
meeting a few faults from the schedule, until ``CHAOS_S`` seconds (600 by default) less the namespace tier's share
have passed. Then, where it can run (root and iproute2), the namespace tier: two network namespaces on a bridge, a
Ray head (``ray start``) in one and a worker node in the other, as tests/nshosts.py makes them, and the digits example
driven from the first while its links go down. ``CHAOS_SEED`` seeds the schedule.

The faults (``KINDS``): a rank SIGKILLed or SIGSTOPped (its PID from its node actor, ``NodeActor.pids``); a node
actor killed (``ray.kill`` of the named actor); a node lost (``cluster.remove_node``, then ``add_node`` a few seconds
later); the driver SIGKILLed and the same command run again; the storage's disk full for a few seconds during a
save (a ballast file on the tmpfs); the object store stalling (the proxy holds every connection, moving no byte) or
refusing (open connections reset, new requests answered ``503 Slow Down``) for 3 to 12 s (``StoreProxy``); a
namespace host's network link down for 3 to 12 s (``ip link set <veth> down``, then ``up``; a worker node Ray gave
up on is started again, as a machine's supervisor would). Each lands at a moment (``MOMENTS``): while training,
inside the recovery from the previous fault (right after the driver noticed it), or inside a checkpoint save and
commit (right after a rank began staging one; a store fault there is armed in the proxy and starts at the next
upload into ``.staging/`` it forwards, holding or resetting that very request: mid-upload).

Writes bench/results-chaos.md (``--out``) with the faults by kind, the checks, restarts, steps redone and goodput.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
for _p in (str(ROOT), str(TESTS)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import psutil  # noqa: E402

KINDS = ("rank_kill", "rank_stop", "actor_kill", "node_lost", "driver_kill", "disk_full", "store_stall",
         "store_refuse", "link_down")
STORE_KINDS = ("store_stall", "store_refuse")  # only for a job whose storage is the object store
LINK_KINDS = ("link_down",)  # only on the namespace hosts
DISK_KINDS = ("disk_full",)  # only for a job whose storage is the small local disk
MOMENTS = ("training", "recovery", "commit")
ACTOR_NAMESPACE = "raylaunch"  # cluster.nodes.group.ACTOR_NAMESPACE, without importing Ray at module import

DIGITS = """
name: {name}
train_fn: train_fn.digits:train
config: {{epochs: {epochs}, lr: 2.0e-3, batch_size: 16, checkpoint_every: 15, throttle_s: 0.02, dropout: 0.1}}
scaling: {{num_nodes: 2, workers_per_node: 1}}
failure: {{max_restarts: 30, max_preemptions: 30}}
checkpoint: {{keep: 2}}
timeouts: {{heartbeat_s: 8, placement_s: 120, rendezvous_s: 60}}
storage: {storage}
"""

ELASTIC = """
name: {name}
train_fn: tests.fns:elastic
config: {{samples: 128, batch_size: 8, epochs: {epochs}, every: 3, step_s: {step_s}, pid_dir: {pid_dir}}}
scaling: {{num_nodes: 2, workers_per_node: 1, min_nodes: 1}}
failure: {{max_restarts: 30, max_preemptions: 30}}
checkpoint: {{keep: 2}}
timeouts: {{heartbeat_s: 8, placement_s: 120, rendezvous_s: 60, resize_s: 3}}
storage: {storage}
"""
ELASTIC_SAMPLES, ELASTIC_GLOBAL_BATCH = 128, 16  # 2 nodes x 1 worker x batch 8


@dataclass(frozen=True)
class Fault:
    kind: str
    moment: str
    jitter_s: float  # after the moment is reached
    hold_s: float  # how long a node stays away, or the disk full

    def describe(self) -> str:
        return f"{self.kind} at {self.moment} (+{self.jitter_s:.1f} s)"


def schedule(rng: random.Random, n: int, kinds: tuple[str, ...] = KINDS) -> list[Fault]:
    """``n`` faults drawn from ``rng``: a kind, a moment, a jitter and a hold. The first fault cannot be in a
    recovery (there is none yet)."""
    out = []
    for i in range(n):
        kind = rng.choice(kinds)
        moment = rng.choice(MOMENTS[::2] if i == 0 else MOMENTS)
        jitter = {"training": rng.uniform(0, 6.0), "recovery": rng.uniform(0, 3.0), "commit": rng.uniform(0, 0.4)}[moment]
        out.append(Fault(kind, moment, round(jitter, 2), round(rng.uniform(3, 12), 1)))
    return out


@dataclass
class Injected:
    fault: Fault
    at: float  # seconds since the job began
    detail: str
    skipped: str = ""  # why it could not be injected (no rank running when it was due, say)


@dataclass
class JobRun:
    """One job's driver, as a user runs it: ``python -m jobs.cli run SPEC --address ADDRESS`` (again after a kill)."""

    name: str
    kind: str  # digits or elastic
    spec_path: Path
    storage: str  # the run storage the job is given: a folder, or the object store's URI (through the proxy)
    address: str
    log: Path
    env: dict
    reads: str = ""  # where chaos reads the run back: the object store itself, not through the proxy ("": storage)
    prefix: tuple = ()  # what the command runs under (``ip netns exec HOST``: a driver on a namespace host)
    proc: subprocess.Popen | None = None
    launches: int = 0
    driver_pids: dict[int, float] = field(default_factory=dict)  # pid -> create time
    began: float = field(default_factory=time.monotonic)
    _reader: object = None

    @property
    def on_store(self) -> bool:
        return "://" in str(self.storage)

    @property
    def run_dir(self) -> Path:
        """The run's folder (a job on local storage)."""
        return Path(self.storage) / self.name

    @property
    def reader(self):
        """A ``jobs.run.storage.RunDir`` of the run, reading where ``reads`` says."""
        if self._reader is None:
            from jobs.run.storage import RunDir

            self._reader = RunDir(str(self.reads or self.storage), self.name)
        return self._reader

    def launch(self) -> None:
        self.launches += 1
        with open(self.log, "a") as out:
            out.write(f"\n=== launch {self.launches} ===\n")
            out.flush()
            self.proc = subprocess.Popen([*self.prefix, sys.executable, "-m", "jobs.cli", "run", str(self.spec_path),
                                          "--address", self.address], cwd=ROOT, env=self.env,
                                         stdout=out, stderr=subprocess.STDOUT)
        try:
            self.driver_pids[self.proc.pid] = psutil.Process(self.proc.pid).create_time()
        except psutil.Error:
            pass

    def events(self) -> list[dict]:
        try:
            return self.reader.read_events()
        except Exception:  # not written yet, or being replaced
            return []

    def noticed(self) -> int:
        """How many faults the driver has noticed so far: attempts ended, and commands run again."""
        return sum(1 for e in self.events() if e.get("kind") in ("attempt_ended", "session"))

    def training(self) -> bool:
        """The current attempt has taken its first step."""
        marks = [e["kind"] for e in self.events() if e.get("kind") in ("attempt", "first_step")]
        return bool(marks) and marks[-1] == "first_step"

    def staging_parts(self) -> set[str]:
        from pyarrow import fs as pafs

        run = self.reader
        try:
            infos = run.fs.get_file_info(pafs.FileSelector(f"{run.path}/.staging", recursive=True,
                                                           allow_not_found=True))
        except Exception:
            return set()
        out = set()
        for info in infos:
            parts = info.path[len(run.path) + len("/.staging/"):].split("/")
            if len(parts) >= 2 and parts[0].startswith("attempt-") and parts[1].startswith("checkpoint-"):
                out.add("/".join(parts[:2]))
        return out

    def done(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None


# --- the object store, and the proxy chaos puts between it and every process of a run -------------------------

BUCKET = "raylaunch-chaos"
_STAGING_PUT = re.compile(rb"(?:PUT|POST) (/[^ ]*/\.staging/[^ ?]*)")
_SLOW_DOWN = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>SlowDown</Code>"
              b"<Message>Please reduce your request rate.</Message></Error>")


def dummy_aws_credentials() -> None:
    """What moto accepts, in this process's environment: the raylets, node actors, ranks and drivers inherit it."""
    for key, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                       ("AWS_DEFAULT_REGION", "us-east-1"), ("AWS_EC2_METADATA_DISABLED", "true")):
        os.environ.setdefault(key, value)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ObjectStore:
    """An S3-compatible server (moto's, ``python -m moto.server``, a process of its own) and a bucket on it."""

    def __init__(self, log: Path) -> None:
        self.port = free_port()
        self._log = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=self._log, stderr=subprocess.STDOUT)
        from pyarrow import fs as pafs

        deadline = time.monotonic() + 60
        while True:
            try:
                pafs.FileSystem.from_uri(self.uri("", self.port) + "&allow_bucket_creation=true")[0].create_dir(BUCKET)
                break
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto's S3 server did not start: {log.read_text()[-1000:]}")
                time.sleep(0.3)

    @staticmethod
    def uri(prefix: str, port: int) -> str:
        return f"s3://{BUCKET}/{prefix}?endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


class StoreProxy:
    """A TCP proxy in front of the object store: every process of a run reaches the store through it, and chaos
    makes it stall or refuse for a few seconds.

    stall: no byte moves either way, on the connections open and on new ones (accepted, then left waiting): each
    request in flight, and each one made, hangs until the stall ends (or the client gives up on it).
    refuse: the connections open are reset (a request in flight fails there), and each new one is answered
    ``503 Slow Down`` (what S3 answers a client it throttles) and closed.
    ``arm`` starts either at the next upload into ``.staging/`` the proxy forwards (the request line of a PUT or a
    multipart POST), holding or resetting that very request: a fault landing mid-upload."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream = upstream_port
        self.server = socket.socket()
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(256)
        self.port = self.server.getsockname()[1]
        self.lock = threading.Lock()
        self.mode, self.until = "pass", 0.0
        self.armed: tuple[str, float] | None = None
        self.fired = threading.Event()
        self.fired_on = ""
        self.open: set[socket.socket] = set()
        self.counts: Counter = Counter()  # held, reset, answered 503: connections met by the faults
        self.closed = False
        threading.Thread(target=self._accept, daemon=True, name="chaos-proxy").start()

    def current(self) -> str:
        with self.lock:
            if self.mode != "pass" and time.monotonic() >= self.until:
                self.mode = "pass"
            return self.mode

    def start(self, mode: str, hold_s: float, on: str = "") -> None:
        with self.lock:
            self.mode, self.until, self.armed = mode, time.monotonic() + hold_s, None
            self.fired_on = on
            victims = list(self.open) if mode == "refuse" else []
        for sock in victims:
            self._reset(sock)
        self.fired.set()

    def arm(self, mode: str, hold_s: float) -> None:
        self.fired.clear()
        with self.lock:
            self.armed = (mode, hold_s)

    def disarm(self) -> None:
        with self.lock:
            self.armed = None

    def _reset(self, sock: socket.socket) -> None:
        self.counts["reset"] += 1
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        if self.current() == "stall":
            self.counts["held"] += 1
        while self.current() == "stall":
            time.sleep(0.05)
        if self.current() == "refuse":
            self._slow_down(client)
            return
        try:
            upstream = socket.create_connection(("127.0.0.1", self.upstream), timeout=10)
            upstream.settimeout(None)
        except OSError:
            client.close()
            return
        with self.lock:
            self.open.update((client, upstream))
        pumps = [threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True),
                 threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True)]
        for t in pumps:
            t.start()
        for t in pumps:
            t.join()
        with self.lock:
            self.open.difference_update((client, upstream))
        for sock in (client, upstream):
            sock.close()

    def _slow_down(self, client: socket.socket) -> None:
        self.counts["503"] += 1
        try:
            client.settimeout(2)
            head = b""
            while b"\r\n\r\n" not in head and len(head) < 65536:
                data = client.recv(65536)
                if not data:
                    break
                head += data
            client.sendall(b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(_SLOW_DOWN), _SLOW_DOWN))
        except OSError:
            pass
        finally:
            client.close()

    def _pump(self, src: socket.socket, dst: socket.socket, requests: bool) -> None:
        tail = b""
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if requests and self.armed is not None:
                    found = _STAGING_PUT.search(tail + data)
                    with self.lock:
                        armed, self.armed = (self.armed, None) if found else (self.armed, self.armed)
                    if found and armed is not None:
                        self.start(armed[0], armed[1], found.group(0).decode(errors="replace")[:200])
                    tail = data[-300:]
                mode = self.current()
                if mode == "stall":
                    self.counts["held"] += 1
                    while self.current() == "stall":
                        time.sleep(0.05)
                    mode = self.current()
                if mode == "refuse":
                    self._reset(src)
                    self._reset(dst)
                    break
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.closed = True
        self.server.close()
        with self.lock:
            socks = list(self.open)
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class Chaos:
    """The cluster, the storage and the injector; ``run_job`` runs one job under a list of faults."""

    def __init__(self, cluster, storage: Path, disk: Path | None, rng: random.Random, say=print,
                 proxy: StoreProxy | None = None) -> None:
        self.cluster = cluster
        self.proxy = proxy  # between the object store and the runs on it (None: no store faults)
        self.links: LinkChaos | None = None  # the namespace hosts, when the job runs there (``cluster`` is None)
        self.storage = storage
        self.disk = disk  # the tmpfs holding the storage (None: no disk-full faults)
        self.rng = rng
        self.say = say
        self.lock = threading.Lock()  # cluster changes: a node re-added by a timer
        self.returning: list[float] = []  # when each lost node comes back (time.monotonic())
        self.seen: dict[int, float] = {}  # pid -> create time: every rank and fork server seen
        self.stopped: list[int] = []  # PIDs this script SIGSTOPped
        self.last_pids: set[int] = set()  # the ranks running when the previous fault was injected

    # --- what is running ------------------------------------------------------------------

    def node_actors(self) -> list:
        if self.links is not None:
            return []
        import ray

        out = []
        for entry in ray.util.list_named_actors(all_namespaces=True):
            if entry.get("namespace") == ACTOR_NAMESPACE and entry["name"].startswith("raylaunch-"):
                try:
                    out.append((entry["name"], ray.get_actor(entry["name"], namespace=ACTOR_NAMESPACE)))
                except ValueError:
                    pass
        return out

    def rank_pids(self) -> dict[int, tuple[int, str]]:
        """rank -> (pid, node actor's name), for the ranks running now."""
        if self.links is not None:
            return self.links.rank_pids(self)
        import ray

        out = {}
        for name, actor in self.node_actors():
            try:
                pids = ray.get(actor.pids.remote(), timeout=3)
            except Exception:
                continue
            for rank, pid in pids.items():
                out[int(rank)] = (int(pid), name)
                self._note(int(pid))
        return out

    def _note(self, pid: int) -> None:
        """Remember a rank and its parent (the fork server), to check they end."""
        try:
            p = psutil.Process(pid)
            self.seen.setdefault(pid, p.create_time())
            parent = p.parent()
            if parent is not None and "forkserver" in " ".join(parent.cmdline()):
                self.seen.setdefault(parent.pid, parent.create_time())
        except psutil.Error:
            pass

    def left_running(self, pids: dict[int, float]) -> list[int]:
        out = []
        for pid, created in pids.items():
            try:
                p = psutil.Process(pid)
                if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(pid)
            except psutil.Error:
                pass
        return out

    # --- moments ---------------------------------------------------------------------------

    def reach(self, job: JobRun, fault: Fault, deadline: float) -> bool:
        """Wait for the fault's moment; False if the job ended or the deadline passed first.

        training: the current attempt has taken a step; recovery: right after the previous fault, before the run
        trains again (a fault that needs a rank waits for the next attempt's ranks: in their rendezvous or
        restore); commit: a rank has just begun staging a checkpoint."""
        staged = job.staging_parts()
        moment, jitter = fault.moment, fault.jitter_s
        if fault.kind in STORE_KINDS and moment == "commit":
            moment, jitter = "training", 0.0  # then armed: it starts at the next upload (``store_fault``)
        poll = 0.2 if job.on_store else 0.05
        if moment == "recovery":
            self.tick()
            time.sleep(jitter)
            if fault.kind not in ("rank_kill", "rank_stop"):
                return not job.done()
        while time.monotonic() < deadline and not job.done():
            self.tick()
            if moment == "training":
                if job.training() and self.rank_pids():
                    break
            elif moment == "recovery":
                if set(p for p, _ in self.rank_pids().values()) - self.last_pids:
                    return True
            elif moment == "commit":
                if job.staging_parts() - staged:
                    break
            time.sleep(poll)
        else:
            return False
        time.sleep(jitter)
        return not job.done()

    # --- the faults ------------------------------------------------------------------------

    def inject(self, job: JobRun, fault: Fault) -> str:
        """Do it; returns what was done, or raises LookupError when there was nothing to hit."""
        kind = fault.kind
        if kind in ("rank_kill", "rank_stop"):
            ranks = self.rank_pids()
            if not ranks:
                raise LookupError("no rank was running")
            rank = self.rng.choice(sorted(ranks))
            pid = ranks[rank][0]
            os.kill(pid, signal.SIGKILL if kind == "rank_kill" else signal.SIGSTOP)
            if kind == "rank_stop":
                self.stopped.append(pid)
            return f"rank {rank} (pid {pid})"
        if kind == "actor_kill":
            import ray

            actors = self.node_actors()
            if not actors:
                raise LookupError("no node actor was there")
            name, actor = self.rng.choice(actors)
            self.rank_pids()  # its ranks are noted before they go
            ray.kill(actor)
            return name
        if kind == "node_lost":
            return self.lose_node(fault.hold_s)
        if kind == "driver_kill":
            pid = job.proc.pid
            self.rank_pids()
            os.kill(pid, signal.SIGKILL)
            job.proc.wait(30)
            time.sleep(self.rng.uniform(0.5, 3))
            job.launch()
            return f"driver pid {pid}, then the same command again"
        if kind == "disk_full":
            if self.disk is None:
                raise LookupError("no small disk (a tmpfs needs root)")
            return self.fill_disk(fault.hold_s / 3)
        if kind in LINK_KINDS:
            if self.links is None:
                raise LookupError("the job does not run on the namespace hosts")
            return self.links.links.cut(self.rng, fault.hold_s)
        if kind in STORE_KINDS:
            if self.proxy is None or not job.on_store:
                raise LookupError("the job's storage is not the object store")
            return self.store_fault(job, kind, fault)
        raise ValueError(kind)

    def store_fault(self, job: JobRun, kind: str, fault: Fault) -> str:
        """The object store stalls or refuses for a few seconds; in a commit, from the next upload into staging
        (armed, up to 120 s). Returns once the fault is over."""
        mode, hold = ("stall" if kind == "store_stall" else "refuse"), fault.hold_s
        before = Counter(self.proxy.counts)
        began = time.monotonic()
        if fault.moment == "commit":
            self.proxy.arm(mode, hold)
            deadline = time.monotonic() + 120
            while not self.proxy.fired.wait(0.2):
                self.tick()
                if job.done() or time.monotonic() > deadline:
                    self.proxy.disarm()
                    raise LookupError("no upload into staging began within 120 s")
            began = time.monotonic()
            where = f"from {self.proxy.fired_on.split('/.staging/', 1)[-1]}"
        else:
            self.proxy.start(mode, hold)
            where = "at once"
        while self.proxy.current() != "pass":
            time.sleep(0.1)
        met = ", ".join(f"{n} {k}" for k, n in sorted((Counter(self.proxy.counts) - before).items())) or "nothing"
        return f"{mode} {where} for {hold:.1f} s (connections met: {met}; over after {time.monotonic() - began:.1f} s)"

    def lose_node(self, hold_s: float) -> str:
        with self.lock:
            workers = list(self.cluster.worker_nodes)
            if not workers:
                raise LookupError("no worker node to lose (the head stays: it holds the cluster's GCS)")
            self.rank_pids()
            victim = self.rng.choice(workers)
            self.cluster.remove_node(victim)
        # Added back from the main thread (``tick``): Ray's add_node installs signal handlers, which only it may.
        self.returning.append(time.monotonic() + hold_s)
        return f"node {victim.node_id[:12]}, back after {hold_s:.0f} s"

    def tick(self) -> None:
        """Add back the nodes whose time away is over (on the namespace hosts: start the worker node again if Ray
        ended it)."""
        if self.links is not None:
            if time.monotonic() - self.links.checked > 2:  # `ip netns pids`, and psutil on each: not at every poll
                self.links.checked = time.monotonic()
                self.links.links.revive()
            return
        due = [t for t in self.returning if t <= time.monotonic()]
        for t in due:
            self.returning.remove(t)
            from cluster.nodes.connect import embedded_node

            with self.lock:
                self.cluster.add_node(**embedded_node(**self.node_args))
            self.say("chaos: a node was added back")

    node_args: dict = {}

    def fill_disk(self, hold_s: float) -> str:
        ballast = self.disk / "ballast"
        free = shutil.disk_usage(self.disk).free
        try:
            # unbuffered: a write the run's own files cut short (they took some of ``free`` meanwhile) leaves nothing
            # in a buffer for the close to flush into a full disk (ENOSPC raised there: a fresh clone's make test)
            f = open(ballast, "wb", buffering=0)
        except OSError as exc:  # seen in CI: the run's own files had already filled it (no room for one more inode)
            if exc.errno != errno.ENOSPC:
                raise
            time.sleep(hold_s)
            return f"already full ({free} bytes free, no file could be made) for {hold_s:.1f} s"
        with f:
            try:
                f.write(b"\0" * free)
            except OSError:
                pass
        left = shutil.disk_usage(self.disk).free
        time.sleep(hold_s)
        ballast.unlink()
        return f"{free // 2**20} MiB filled ({left} bytes left) for {hold_s:.1f} s"

    def settle(self) -> None:
        """Every node taken away is back."""
        while self.returning:
            time.sleep(0.2)
            self.tick()

    # --- one job ---------------------------------------------------------------------------

    def run_job(self, job: JobRun, faults: list[Fault], timeout_s: float = 420) -> list[Injected]:
        injected: list[Injected] = []
        deadline = time.monotonic() + timeout_s
        job.launch()
        watcher = threading.Thread(target=self._watch, args=(job, deadline), daemon=True)
        watcher.start()
        try:
            self._inject_all(job, faults, deadline, injected)
        finally:  # an injection that raised: the job still ends here, so what it holds open (a mount) can go
            if not job.done():
                job.proc.kill()
                job.proc.wait(30)
            watcher.join(5)
            self.settle()
        return injected

    def _inject_all(self, job: JobRun, faults: list[Fault], deadline: float, injected: list[Injected]) -> None:
        for fault in faults:
            if not self.reach(job, fault, min(deadline, time.monotonic() + 180)):
                injected.append(Injected(fault, time.monotonic() - job.began, "", "the job ended (or the moment "
                                         "did not come within 180 s)"))
                self.say(f"chaos: {job.name}: {fault.describe()}: not injected: {injected[-1].skipped}")
                continue
            self.last_pids = {p for p, _ in self.rank_pids().values()}
            try:
                detail = self.inject(job, fault)
                injected.append(Injected(fault, time.monotonic() - job.began, detail))
                self.say(f"chaos: {job.name}: {fault.describe()}: {detail}")
            except LookupError as exc:
                injected.append(Injected(fault, time.monotonic() - job.began, "", str(exc)))
                self.say(f"chaos: {job.name}: {fault.describe()}: not injected: {exc}")
        while not job.done() and time.monotonic() < deadline:
            self.tick()
            time.sleep(0.2)

    def _watch(self, job: JobRun, deadline: float) -> None:
        while not job.done() and time.monotonic() < deadline:
            self.rank_pids()
            time.sleep(0.5)


# --- the namespace hosts, and a network link down --------------------------------------------------------------

LINK_TAG = f"rc{os.getpid() % 100000}"  # not the tests' "rl": their clear_abandoned removes what no pytest owns
LINK_NET = "10.78"  # tests/test_netns.py uses 10.77


def link_tier_why_not() -> str | None:
    """Why the namespace hosts cannot be made here (None: they can)."""
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "needs root to create network namespaces (ip netns add)"
    if shutil.which("ip") is None:
        return "needs iproute2 (the `ip` command)"
    return None


class LinkHosts:
    """Two hosts on one bridge, as tests/nshosts.py makes them (network namespaces, each with a veth pair and an
    address of its own): a Ray head (``ray start --head``) in the first, a worker node in the second; the jobs'
    drivers run in the first. ``cut`` takes one host's link down for some seconds, then up again."""

    def __init__(self, work: Path, say=print) -> None:
        import nshosts

        self.say = say
        self.temp = work / "ns"  # short: Ray's Unix sockets live under it
        self.hosts = {f"{LINK_TAG}-h{i}": (f"{LINK_NET}.0.{i}", f"{LINK_TAG}e{i}", f"{LINK_TAG}v{i}") for i in (1, 2)}
        self.head_ns, self.worker_ns = self.hosts
        self.bridge = f"{LINK_TAG}br"
        self.address = f"{LINK_NET}.0.1:6379"
        self.env = job_env()
        self.env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{self.env['PATH']}"
        self.env.pop("RAY_ADDRESS", None)
        self.restarts = 0  # worker nodes started again after Ray gave up on the one cut off
        try:
            nshosts.make_bridge(self.bridge)
            for ns, (addr, inside, outside) in self.hosts.items():
                nshosts.add_host(ns, addr, inside, outside, self.bridge)
            self._ray_start(self.head_ns, "--head", "--port=6379", "--include-dashboard=false")
            self._ray_start(self.worker_ns, f"--address={self.address}")
        except BaseException:
            self.close()
            raise

    def _ray_start(self, ns: str, *args: str) -> None:
        addr = self.hosts[ns][0]
        done = self.run_in(ns, [str(Path(sys.executable).parent / "ray"), "start", *args, f"--node-ip-address={addr}",
                                f"--temp-dir={self.temp / ns[-2:]}", "--num-cpus=2",
                                "--object-store-memory=200000000", "--disable-usage-stats"], timeout=180)
        if done.returncode != 0:
            raise RuntimeError(f"ray start in {ns}: {(done.stdout + done.stderr)[-1500:]}")

    def run_in(self, ns: str, cmd: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", ns, *cmd], env=self.env, cwd=ROOT, capture_output=True,
                              text=True, timeout=timeout)

    def pids(self) -> list[int]:
        """Every process in the hosts' namespaces."""
        import nshosts

        return [int(p) for ns in self.hosts for p in nshosts.ip("netns", "pids", ns, check=False).stdout.split()]

    def worker_raylet_alive(self) -> bool:
        import nshosts

        for pid in nshosts.ip("netns", "pids", self.worker_ns, check=False).stdout.split():
            try:
                if "raylet" in " ".join(psutil.Process(int(pid)).cmdline()[:1]):
                    return True
            except psutil.Error:
                pass
        return False

    def revive(self) -> None:
        """A worker node whose raylet Ray ended (it was cut off past the GCS's health checks) is started again, as a
        machine's supervisor would."""
        if not self.worker_raylet_alive():
            self.restarts += 1
            self._ray_start(self.worker_ns, f"--address={self.address}")
            self.say("chaos: the cut-off host's Ray node was started again")

    def cut(self, rng: random.Random, hold_s: float) -> str:
        import nshosts

        ns = rng.choice(list(self.hosts))
        outside = self.hosts[ns][2]
        nshosts.ip("link", "set", outside, "down")
        try:
            time.sleep(hold_s)
        finally:
            nshosts.ip("link", "set", outside, "up")
        return f"{'head' if ns == self.head_ns else 'worker'} host's link ({outside}) down for {hold_s:.1f} s"

    def close(self) -> list[str]:
        """Ray's processes ended by PID, then whatever is left in the namespaces, the namespaces and links removed;
        returns what could not be."""
        import nshosts
        from cluster.nodes.connect import stop_processes_under

        stop_processes_under(str(self.temp), timeout_s=5)
        for pid in self.pids():  # only ours can be in these namespaces
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for ns, (_, _, outside) in self.hosts.items():
            nshosts.remove_host(ns, outside)
        nshosts.ip("link", "del", self.bridge, check=False)
        return nshosts.left_behind(list(self.hosts), [self.bridge, *(o for _, _, o in self.hosts.values())])


class LinkChaos:
    """What ``Chaos`` needs to know of ranks, on the namespace hosts: the processes in the hosts' namespaces that a
    fork server (the node actor's, or a warm rank host's) started; the injector is ``Chaos``'s own."""

    def __init__(self, links: LinkHosts) -> None:
        self.links = links
        self.checked = 0.0  # when ``revive`` last looked

    def rank_pids(self, chaos: "Chaos") -> dict[int, tuple[int, str]]:
        out = {}
        for pid in self.links.pids():
            try:
                parent = psutil.Process(pid).parent()
                cmd = " ".join(parent.cmdline()) if parent is not None else ""
            except psutil.Error:
                continue
            if "forkserver" in cmd or "cluster.hosting.hostproc" in cmd:
                out[len(out)] = (pid, "namespace host")
                chaos._note(pid)
        return out


# --- checks ------------------------------------------------------------------------------------

def storage_checks(storage: Path | str, name: str) -> list[str]:
    """Every committed checkpoint verifies against its manifest, nothing is left in staging, result.json is final.
    ``storage``: a folder, or the object store's URI (read directly, not through the proxy)."""
    from pyarrow import fs as pafs

    from jobs.run.storage import RunDir

    problems = []
    run = RunDir(str(storage), name)
    committed = run.checkpoints.committed()
    for c in committed:
        try:
            run.checkpoints.verify(c)
        except Exception as exc:
            problems.append(f"committed {c.name} does not verify: {exc}")
    latest = run.checkpoints.latest() if committed else None
    if committed and (latest is None or latest.name != committed[-1].name):
        problems.append(f"latest.json names {latest and latest.name}, the newest committed is {committed[-1].name}")
    # Anything in a local .staging; a file in the store's (a folder there is only a key prefix, or its marker)
    left = [i.path for i in run.fs.get_file_info(pafs.FileSelector(f"{run.path}/.staging", recursive=True,
                                                                   allow_not_found=True))
            if "://" not in str(storage) or i.type == pafs.FileType.File]
    if left:
        problems.append(f"left in staging: {sorted(left)[:5]}")
    result = run.read_result() or {}
    if result.get("status") not in ("succeeded", "failed", "stopped"):
        problems.append(f"result.json status {result.get('status')!r}")
    return problems


def metric_rows(storage: Path | str, name: str) -> list[dict]:
    from jobs.run.storage import RunDir

    return RunDir(str(storage), name).read_metrics()


def steps_redone(rows: list[dict], key: str) -> int:
    """Optimizer steps rank 0 ran more than once (after a restart from an earlier checkpoint)."""
    steps = [r["step"] for r in rows if r.get("rank") == 0 and key in r and r.get("step") is not None]
    return len(steps) - len(set(steps))


def elastic_checks(rows: list[dict], epochs: int) -> list[str]:
    """Every optimizer step kept the global batch, and every sample of every epoch was used exactly once (the
    attempt that last ran each step is the one whose state the run kept), as tests/test_elastic.py checks."""
    last: dict[int, int] = {}
    for r in rows:
        if "ids" in r:
            last[r["step"]] = max(last.get(r["step"], 0), r["attempt"])
    got: dict[int, list[int]] = {}
    for r in rows:
        if "ids" in r and r["attempt"] == last[r["step"]]:
            got.setdefault(r["step"], []).extend(r["ids"])
    per_epoch = ELASTIC_SAMPLES // ELASTIC_GLOBAL_BATCH
    problems = []
    if sorted(got) != list(range(1, per_epoch * epochs + 1)):
        problems.append(f"steps {sorted(set(range(1, per_epoch * epochs + 1)) ^ set(got))[:10]} missing or extra")
    batches = {len(v) for v in got.values()}
    if batches != {ELASTIC_GLOBAL_BATCH}:
        short = sorted(s for s, v in got.items() if len(v) != ELASTIC_GLOBAL_BATCH)
        problems.append(f"global batches {sorted(batches)}, not {ELASTIC_GLOBAL_BATCH} at every step (steps "
                        f"{short[:10]}: " + "; ".join(f"{s}: rows of ranks {sorted(r['rank'] for r in rows if 'ids' in r and r['step'] == s and r['attempt'] == last[s])} in attempt {last[s]}" for s in short[:3]) + ")")
    for epoch in range(epochs):
        ids = sorted(i for s in range(epoch * per_epoch + 1, (epoch + 1) * per_epoch + 1) for i in got.get(s, []))
        if ids != list(range(ELASTIC_SAMPLES)):
            problems.append(f"epoch {epoch}: samples not each seen once ({len(ids)} seen, {len(set(ids))} distinct)")
    return problems


@dataclass
class Outcome:
    job: str
    kind: str
    injected: list[Injected]
    status: str
    restarts: int
    attempts: int
    launches: int
    redone: int
    goodput: float | None
    wall_s: float
    problems: list[str]

    @property
    def survived(self) -> bool:
        return self.status == "succeeded" and not self.problems


def check_job(chaos: Chaos, job: JobRun, injected: list[Injected], reference: dict | None, epochs: int,
              ranks_before: dict[int, float]) -> Outcome:
    """Everything issue 33 asks of a run that met faults."""
    result = job.reader.read_result() or {}
    problems = storage_checks(job.reads or job.storage, job.name)
    rows = metric_rows(job.reads or job.storage, job.name)
    if job.proc.returncode != 0:
        problems.append(f"the last driver exited {job.proc.returncode}: {str(result.get('error'))[:300]}")
    if job.kind == "digits":
        mine = (result.get("rank_results") or {}).get("0", {}).get("weights")
        if reference is not None and mine != reference.get("weights"):
            problems.append(f"final weights {mine} differ from the undisturbed run's {reference.get('weights')}")
        redone = steps_redone(rows, "loss")
    else:
        problems += elastic_checks(rows, epochs)
        redone = steps_redone(rows, "ids")
    # nothing of the run is left: every rank and fork server seen, every driver
    pids = {pid: t for pid, t in chaos.seen.items() if pid not in ranks_before}
    pids.update(job.driver_pids)
    deadline = time.monotonic() + 20
    while (left := chaos.left_running(pids)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if left:
        problems.append(f"processes left running: {left}")
        for pid in left:  # ours (a rank this script saw, or stopped): end it so the next job starts clean
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    goodput = (result.get("goodput") or {}).get("ratio")
    # Restarts over every command of the run: result.json counts those of the last command only; an attempt a
    # killed driver left open never ended, and the next command restarted it.
    restarts = sum(1 for e in job.events() if e.get("kind") == "attempt_ended"
                   and e.get("outcome") not in ("succeeded", "grow")) + job.launches - 1
    return Outcome(job.name, job.kind, injected, str(result.get("status")), restarts,
                   int(result.get("attempts") or 0), job.launches, redone, goodput,
                   float((result.get("goodput") or {}).get("wall_s") or 0), problems)


# --- the cluster and the storage -----------------------------------------------------------------

def mount_small_disk(path: Path, size: str = "96m") -> bool:
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    return done.returncode == 0


def unmount_small_disk(path: Path, wait_s: float = 30.0) -> None:
    """Unmount what ``mount_small_disk`` mounted: once the processes of a run that ended (a killed job's ranks
    take a few seconds to go) no longer hold files there, else lazily, so nothing is left mounted."""
    deadline = time.monotonic() + wait_s
    while subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
        if time.monotonic() > deadline:
            subprocess.run(["umount", "-l", str(path)], check=True)
            return
        time.sleep(0.5)


def job_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS), env.get("PYTHONPATH", "")])
    return env


def make_job(chaos_dir: Path, storage: Path | str, address: str, kind: str, name: str, epochs: int,
             step_s: float = 0.25, reads: str = "") -> JobRun:
    """A job of ``kind`` (digits or elastic) on ``storage`` (a folder, or an object store's URI; ``reads``: the
    URI chaos reads the run back from)."""
    text = (DIGITS if kind == "digits" else ELASTIC).format(name=name, epochs=epochs, storage=json.dumps(str(storage)),
                                                            step_s=step_s, pid_dir=chaos_dir / "pids" / name)
    spec = chaos_dir / f"{name}.yaml"
    spec.write_text(text)
    return JobRun(name, kind, spec, str(storage), address, chaos_dir / f"{name}.log", job_env(), reads=reads)


def reference_digits(chaos_dir: Path, address: str, epochs: int) -> dict:
    """The undisturbed digits run (on plain disk): rank 0's result."""
    store = chaos_dir / "reference"
    job = make_job(chaos_dir, store, address, "digits", "reference", epochs)
    job.launch()
    job.proc.wait(600)
    result = json.loads((store / "reference" / "result.json").read_text())
    assert result["status"] == "succeeded", result.get("error")
    return result["rank_results"]["0"]


def report(outcomes: list[Outcome], seed: int, budget_s: float, took_s: float, notes: list[str] = (),
           how: str = "") -> str:
    injected = Counter()
    survived = Counter()
    skipped = Counter()
    moments = Counter()
    for o in outcomes:
        for i in o.injected:
            if i.skipped:
                skipped[i.fault.kind] += 1
                continue
            injected[i.fault.kind] += 1
            moments[(i.fault.kind, i.fault.moment)] += 1
            if o.survived:
                survived[i.fault.kind] += 1
    lines = [f"### seed {seed}: {'every fault survived' if all(o.survived for o in outcomes) else 'NOT SURVIVED'}", "",
             f"CHAOS_SEED={seed}, CHAOS_S={budget_s:g}{how}; took {took_s:.0f} s; {len(outcomes)} jobs, "
             f"{sum(injected.values())} faults injected, {sum(survived.values())} survived.", "",
             *(f"- {n}" for n in notes), *([""] if notes else []),
             "| fault | injected | survived | in training / in a recovery / in a commit | not injected (its moment did not come, or nothing to hit) |",
             "|---|---|---|---|---|"]
    for kind in KINDS:
        lines.append(f"| {kind} | {injected[kind]} | {survived[kind]} | {moments[(kind, 'training')]} / "
                     f"{moments[(kind, 'recovery')]} / {moments[(kind, 'commit')]} | {skipped[kind]} |")
    lines += ["", "| job | faults (kind at moment) | status | attempts | restarts | driver runs | steps redone | "
              "goodput | checks |", "|---|---|---|---|---|---|---|---|---|"]
    for o in outcomes:
        faults = ", ".join(f"{i.fault.kind}@{i.fault.moment}" + (" (not injected)" if i.skipped else "")
                           for i in o.injected)
        gp = f"{o.goodput:.0%}" if o.goodput is not None else "-"
        checks = "all pass" if not o.problems else "; ".join(o.problems)[:400]
        lines.append(f"| {o.job} | {faults} | {o.status} | {o.attempts} | {o.restarts} | {o.launches} | {o.redone} | "
                     f"{gp} | {checks} |")
    return "\n".join(lines) + "\n"


JOBS = ("digits", "elastic", "digits-s3")  # a round: the digits example and the elastic job on the small disk, the
# digits example on the object store (behind the proxy); each meets ``--faults-per-job`` faults


def job_schedule(rng: random.Random, job_kind: str, n: int, kinds: tuple[str, ...]) -> list[Fault]:
    """The faults one job meets: those that can hit it (a store fault only on the object store, a full disk only on
    the small disk); a job on the store meets at least one store fault."""
    on_store = job_kind.endswith("-s3")
    fits = tuple(k for k in kinds if k not in LINK_KINDS and (k not in STORE_KINDS or on_store)
                 and (k not in DISK_KINDS or not on_store))
    faults = schedule(rng, n, fits)
    store = tuple(k for k in fits if k in STORE_KINDS)
    if store and not any(f.kind in STORE_KINDS for f in faults):
        i = rng.randrange(n)
        f = faults[i]
        faults[i] = Fault(rng.choice(store), f.moment, f.jitter_s, f.hold_s)
    return faults


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=float(os.environ.get("CHAOS_S", 600)))
    parser.add_argument("--seed", type=int, default=int(os.environ.get("CHAOS_SEED", 0) or 0) or None)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results-chaos.md"))
    parser.add_argument("--faults-per-job", type=int, default=3)
    parser.add_argument("--jobs", default=",".join(JOBS), help=f"the jobs of a round, in order (of {', '.join(JOBS)})")
    parser.add_argument("--kinds", default=",".join(KINDS), help="the faults to draw from")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1, 10**6)
    rng = random.Random(seed)
    began = time.monotonic()
    print(f"chaos: seed {seed}, about {args.seconds:g} s", flush=True)
    jobs = tuple(j for j in args.jobs.split(",") if j)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    if unknown := (set(jobs) - set(JOBS)) | (set(kinds) - set(KINDS)):
        parser.error(f"unknown: {sorted(unknown)}")
    notes: list[str] = []

    import ray
    from ray.cluster_utils import Cluster

    from cluster.nodes.connect import embedded_node

    work = Path(tempfile.mkdtemp(prefix="raylaunch-chaos-"))
    disk = work / "disk"
    mounted = mount_small_disk(disk)
    if not mounted:
        notes.append("disk_full: not injected: cannot mount a tmpfs (needs root)")
        print(f"chaos: {notes[-1]}", flush=True)
        kinds = tuple(k for k in kinds if k not in DISK_KINDS)
    dummy_aws_credentials()  # before the raylets start: they pass their environment on
    store = proxy = None
    if any(j.endswith("-s3") for j in jobs):
        store = ObjectStore(work / "moto.log")
        proxy = StoreProxy(store.port)
    links_why = link_tier_why_not() if "link_down" in kinds else "link_down is not among --kinds"
    link_s = LINK_S if links_why is None else 0  # the end of the bound is the namespace tier's
    node_args = {"num_cpus": 2, "temp_dir": str(work / "ray")}
    os.environ["PYTHONPATH"] = job_env()["PYTHONPATH"]  # the raylets pass it to the node actors and ranks
    cluster = Cluster(initialize_head=True, head_node_args=embedded_node(**node_args))
    outcomes: list[Outcome] = []
    job = ref = None
    try:
        cluster.add_node(**embedded_node(**node_args))
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        chaos = Chaos(cluster, disk, disk if mounted else None, rng, proxy=proxy)
        chaos.node_args = node_args
        digits_epochs, elastic_epochs = 3, 10
        if any(j.startswith("digits") for j in jobs) or link_s:
            # One reference for the digits job on either storage: where the run is kept does not change the model.
            ref = reference_digits(work, cluster.address, digits_epochs)
            print(f"chaos: the undisturbed digits run: weights {ref['weights']} ({time.monotonic() - began:.0f} s)",
                  flush=True)
        round_ = 0
        while jobs and time.monotonic() - began < args.seconds - 60 - link_s:
            round_ += 1
            for job_kind in jobs:
                if time.monotonic() - began > args.seconds - 60 - link_s:
                    break
                name = f"{job_kind}-{round_}"
                kind = job_kind.split("-")[0]
                epochs = digits_epochs if kind == "digits" else elastic_epochs
                if job_kind.endswith("-s3"):
                    job = make_job(work, ObjectStore.uri("runs", proxy.port), cluster.address, kind, name, epochs,
                                   reads=ObjectStore.uri("runs", store.port))
                else:
                    job = make_job(work, disk, cluster.address, kind, name, epochs)
                faults = job_schedule(rng, job_kind, args.faults_per_job, kinds)
                print(f"chaos: {name}: " + ", ".join(f.describe() for f in faults), flush=True)
                before = dict(chaos.seen)
                injected = chaos.run_job(job, faults)
                o = check_job(chaos, job, injected, ref, epochs, before)
                outcomes.append(o)
                print(f"chaos: {name}: {o.status}, attempts {o.attempts}, restarts {o.restarts}, "
                      f"{'checks pass' if not o.problems else o.problems}", flush=True)
                keep = None if o.survived else work.parent / f"raylaunch-chaos-failed-{seed}-{name}"
                clear_run(job, keep)
                if keep is not None:
                    shutil.copy(job.log, keep / "driver.log")
                    print(f"chaos: kept {keep}", flush=True)
    finally:
        if job is not None and job.proc is not None and job.proc.poll() is None:  # interrupted mid-job
            job.proc.kill()
            job.proc.wait(30)
        for stop in (ray.shutdown, cluster.shutdown) + ((proxy.close, store.stop) if store else ()):
            try:
                stop()
            except Exception as exc:  # the rest of the cleanup still runs
                print(f"chaos: {stop.__qualname__}: {exc}", flush=True)
        try:
            if links_why is None and ref is not None:  # after the local cluster: one Ray at a time on the cores
                outcomes += link_tier(work, rng, ref, args.faults_per_job, notes, began + args.seconds - 30)
            elif "link_down" in args.kinds.split(","):
                notes.append(f"link_down: not injected: the namespace tier cannot run here: {links_why}")
                print(f"chaos: {notes[-1]}", flush=True)
        finally:
            if mounted:
                unmount_small_disk(disk)
            shutil.rmtree(work, ignore_errors=True)
    how = "".join(f" {flag} {value!r}" for flag, value, default in (("--jobs", args.jobs, ",".join(JOBS)),
                                                                    ("--kinds", args.kinds, ",".join(KINDS)))
                  if value != default)
    text = report(outcomes, seed, args.seconds, time.monotonic() - began, notes, how)
    print(text)
    out = Path(args.out)
    head = out.read_text().split("## Runs", 1)[0] if out.exists() else "# Chaos\n\n"
    runs = out.read_text().split("## Runs\n", 1)[1] if out.exists() and "## Runs\n" in out.read_text() else ""
    out.write_text(head.rstrip() + "\n\n## Runs\n\n" + text + "\n" + runs.lstrip())
    return 0 if outcomes and all(o.survived for o in outcomes) else 1


LINK_S = 200  # the namespace tier's share of the bound: two `ray start`s, a digits job and its link faults


def link_tier(work: Path, rng: random.Random, ref: dict, n: int, notes: list[str], end: float) -> list[Outcome]:
    """The digits job on the namespace hosts, meeting ``n`` network links down; its checks are the digits job's."""
    began = time.monotonic()
    try:
        links = LinkHosts(work, say=print)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        notes.append(f"link_down: not injected: the namespace hosts could not be made here: {exc}"[:600])
        print(f"chaos: {notes[-1]}", flush=True)
        return []
    out = []
    try:
        print(f"chaos: namespace hosts up ({time.monotonic() - began:.0f} s): a head at {links.address}, a worker "
              f"node at {links.hosts[links.worker_ns][0]}", flush=True)
        chaos = Chaos(None, work / "links", None, rng)
        chaos.links = LinkChaos(links)
        storage = work / "links"
        storage.mkdir(exist_ok=True)
        job = make_job(work, storage, links.address, "digits", "links-1", 3)
        job.env, job.prefix = links.env, ("ip", "netns", "exec", links.head_ns)
        faults = [Fault("link_down", f.moment, f.jitter_s, f.hold_s) for f in schedule(rng, n, LINK_KINDS)]
        print("chaos: links-1: " + ", ".join(f.describe() for f in faults), flush=True)
        injected = chaos.run_job(job, faults, timeout_s=max(240.0, end - time.monotonic()))
        o = check_job(chaos, job, injected, ref, 3, {})
        out.append(o)
        print(f"chaos: links-1: {o.status}, attempts {o.attempts}, restarts {o.restarts}, worker nodes started "
              f"again {links.restarts}, {'checks pass' if not o.problems else o.problems}", flush=True)
        if not o.survived:
            keep = work.parent / f"raylaunch-chaos-failed-links-{job.name}"
            clear_run(job, keep)
            shutil.copy(job.log, keep / "driver.log")
            for node in links.temp.iterdir():  # the namespace hosts' Ray logs: why a node did not come back
                logs = node / "session_latest" / "logs"
                if logs.is_dir():
                    shutil.copytree(logs.resolve(), keep / "ray-logs" / node.name, dirs_exist_ok=True)
            print(f"chaos: kept {keep}", flush=True)
    finally:
        left = links.close()
        if left:
            notes.append(f"namespace hosts left behind: {left}")
    return out


def clear_run(job: JobRun, keep: Path | None) -> None:
    """Remove the run from its storage (the small disk holds the next runs), copying it to ``keep`` first."""
    run = job.reader
    from pyarrow import fs as pafs

    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        pafs.copy_files(run.path, str(keep), source_filesystem=run.fs, destination_filesystem=pafs.LocalFileSystem())
    try:
        run.fs.delete_dir(run.path)
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(main())
