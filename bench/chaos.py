"""Chaos: training jobs run while a seeded schedule injects faults at random moments, including inside
recoveries and commits; then checks that nothing was lost, nothing is left running and the model is the one an
undisturbed run ends with (`make chaos`; `tests/test_chaos.py` runs a short fixed schedule of it).

One ``ray.cluster_utils.Cluster`` in this process (a head and one more node, 2 CPUs each; Ray's temporary folders
in a ``tempfile.mkdtemp()`` folder), the runs' storage on a small tmpfs this script mounts (when it may: root),
every job's driver a ``python -m jobs.cli run SPEC --address ...`` subprocess. Rounds alternate a non-elastic job
(the digits example, its final weights compared with an undisturbed run's) and an elastic one (``tests/fns.py``
``elastic``, ``min_nodes: 1`` of 2: every sample of every epoch seen once, the global batch kept), each meeting a few
faults from the schedule, until ``CHAOS_S`` seconds (600 by default) have passed. ``CHAOS_SEED`` seeds the schedule.

The faults (``KINDS``): a rank SIGKILLed or SIGSTOPped (its PID from its node actor, ``NodeActor.pids``); a node
actor killed (``ray.kill`` of the named actor); a node lost (``cluster.remove_node``, then ``add_node`` a few seconds
later); the driver SIGKILLed and the same command run again; the storage's disk full for a few seconds during a
save (a ballast file on the tmpfs). Each lands at a moment (``MOMENTS``): while training, inside the recovery from
the previous fault (right after the driver noticed it), or inside a checkpoint save and commit (right after a rank
began staging one). Not injected: an object store refusing or stalling requests, and a network link down (the
namespace tier): see docs/faults.md#chaos.

Writes bench/results-chaos.md (``--out``) with the faults by kind, the checks, restarts, steps redone and goodput.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
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

KINDS = ("rank_kill", "rank_stop", "actor_kill", "node_lost", "driver_kill", "disk_full")
MOMENTS = ("training", "recovery", "commit")
ACTOR_NAMESPACE = "raylaunch"  # cluster.group.ACTOR_NAMESPACE, without importing Ray at module import

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
    storage: Path
    address: str
    log: Path
    env: dict
    proc: subprocess.Popen | None = None
    launches: int = 0
    driver_pids: dict[int, float] = field(default_factory=dict)  # pid -> create time
    began: float = field(default_factory=time.monotonic)

    @property
    def run_dir(self) -> Path:
        return self.storage / self.name

    def launch(self) -> None:
        self.launches += 1
        with open(self.log, "a") as out:
            out.write(f"\n=== launch {self.launches} ===\n")
            out.flush()
            self.proc = subprocess.Popen([sys.executable, "-m", "jobs.cli", "run", str(self.spec_path),
                                          "--address", self.address], cwd=ROOT, env=self.env,
                                         stdout=out, stderr=subprocess.STDOUT)
        try:
            self.driver_pids[self.proc.pid] = psutil.Process(self.proc.pid).create_time()
        except psutil.Error:
            pass

    def events(self) -> list[dict]:
        try:
            text = (self.run_dir / "events.jsonl").read_text()
        except OSError:
            return []
        out = []
        for line in text.splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
        return out

    def noticed(self) -> int:
        """How many faults the driver has noticed so far: attempts ended, and commands run again."""
        return sum(1 for e in self.events() if e.get("kind") in ("attempt_ended", "session"))

    def training(self) -> bool:
        """The current attempt has taken its first step."""
        marks = [e["kind"] for e in self.events() if e.get("kind") in ("attempt", "first_step")]
        return bool(marks) and marks[-1] == "first_step"

    def staging_parts(self) -> set[str]:
        staging = self.run_dir / ".staging"
        try:
            return {str(p) for p in staging.glob("attempt-*/checkpoint-*")}
        except OSError:
            return set()

    def done(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None


class Chaos:
    """The cluster, the storage and the injector; ``run_job`` runs one job under a list of faults."""

    def __init__(self, cluster, storage: Path, disk: Path | None, rng: random.Random, say=print) -> None:
        self.cluster = cluster
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
        if fault.moment == "recovery":
            self.tick()
            time.sleep(fault.jitter_s)
            if fault.kind not in ("rank_kill", "rank_stop"):
                return not job.done()
        while time.monotonic() < deadline and not job.done():
            self.tick()
            if fault.moment == "training":
                if job.training() and self.rank_pids():
                    break
            elif fault.moment == "recovery":
                if set(p for p, _ in self.rank_pids().values()) - self.last_pids:
                    return True
            elif fault.moment == "commit":
                if job.staging_parts() - staged:
                    break
            time.sleep(0.05)
        else:
            return False
        time.sleep(fault.jitter_s)
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
        raise ValueError(kind)

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
        """Add back the nodes whose time away is over."""
        due = [t for t in self.returning if t <= time.monotonic()]
        for t in due:
            self.returning.remove(t)
            with self.lock:
                self.cluster.add_node(**self.node_args)
            self.say("chaos: a node was added back")

    node_args: dict = {}

    def fill_disk(self, hold_s: float) -> str:
        ballast = self.disk / "ballast"
        free = shutil.disk_usage(self.disk).free
        with open(ballast, "wb") as f:
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
        if not job.done():
            job.proc.kill()
            job.proc.wait(30)
        watcher.join(5)
        self.settle()
        return injected

    def _watch(self, job: JobRun, deadline: float) -> None:
        while not job.done() and time.monotonic() < deadline:
            self.rank_pids()
            time.sleep(0.5)


# --- checks ------------------------------------------------------------------------------------

def storage_checks(storage: Path, name: str) -> list[str]:
    """Every committed checkpoint verifies against its manifest, nothing is left in staging, result.json is final."""
    from jobs.storage import RunDir

    problems = []
    run = RunDir(str(storage), name)
    committed = run.committed_checkpoints()
    for c in committed:
        try:
            run.verify(c)
        except Exception as exc:
            problems.append(f"committed {c.name} does not verify: {exc}")
    latest = run.latest_checkpoint() if committed else None
    if committed and (latest is None or latest.name != committed[-1].name):
        problems.append(f"latest.json names {latest and latest.name}, the newest committed is {committed[-1].name}")
    staging = storage / name / ".staging"
    if staging.exists() and any(staging.rglob("*")):
        problems.append(f"left in staging: {sorted(str(p) for p in staging.rglob('*'))[:5]}")
    result = run.read_result() or {}
    if result.get("status") not in ("succeeded", "failed", "stopped"):
        problems.append(f"result.json status {result.get('status')!r}")
    return problems


def metric_rows(storage: Path, name: str) -> list[dict]:
    path = storage / name / "metrics.jsonl"
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()] if path.exists() else []


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
        problems.append(f"global batches {sorted(batches)}, not {ELASTIC_GLOBAL_BATCH} at every step")
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
    result_path = job.run_dir / "result.json"
    result = json.loads(result_path.read_text()) if result_path.exists() else {}
    problems = storage_checks(job.storage, job.name)
    rows = metric_rows(job.storage, job.name)
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


def job_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS), env.get("PYTHONPATH", "")])
    return env


def make_job(chaos_dir: Path, storage: Path, address: str, kind: str, name: str, epochs: int,
             step_s: float = 0.25) -> JobRun:
    text = (DIGITS if kind == "digits" else ELASTIC).format(name=name, epochs=epochs, storage=storage, step_s=step_s,
                                                            pid_dir=chaos_dir / "pids" / name)
    spec = chaos_dir / f"{name}.yaml"
    spec.write_text(text)
    return JobRun(name, kind, spec, storage, address, chaos_dir / f"{name}.log", job_env())


def reference_digits(chaos_dir: Path, address: str, epochs: int) -> dict:
    """The undisturbed digits run (on plain disk): rank 0's result."""
    store = chaos_dir / "reference"
    job = make_job(chaos_dir, store, address, "digits", "reference", epochs)
    job.launch()
    job.proc.wait(600)
    result = json.loads((store / "reference" / "result.json").read_text())
    assert result["status"] == "succeeded", result.get("error")
    return result["rank_results"]["0"]


def report(outcomes: list[Outcome], seed: int, budget_s: float, took_s: float) -> str:
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
             f"CHAOS_SEED={seed}, CHAOS_S={budget_s:g}; took {took_s:.0f} s; {len(outcomes)} jobs, "
             f"{sum(injected.values())} faults injected, {sum(survived.values())} survived.", "",
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=float(os.environ.get("CHAOS_S", 600)))
    parser.add_argument("--seed", type=int, default=int(os.environ.get("CHAOS_SEED", 0) or 0) or None)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results-chaos.md"))
    parser.add_argument("--faults-per-job", type=int, default=3)
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1, 10**6)
    rng = random.Random(seed)
    began = time.monotonic()
    print(f"chaos: seed {seed}, about {args.seconds:g} s", flush=True)

    import ray
    from ray.cluster_utils import Cluster

    from cluster.connect import EMBEDDED_NODE

    work = Path(tempfile.mkdtemp(prefix="raylaunch-chaos-"))
    disk = work / "disk"
    mounted = mount_small_disk(disk)
    if not mounted:
        print("chaos: cannot mount a tmpfs (needs root): no disk-full faults", flush=True)
    kinds = KINDS if mounted else tuple(k for k in KINDS if k != "disk_full")
    node_args = {"num_cpus": 2, "temp_dir": str(work / "ray"), **EMBEDDED_NODE}
    os.environ["PYTHONPATH"] = job_env()["PYTHONPATH"]  # the raylets pass it to the node actors and ranks
    cluster = Cluster(initialize_head=True, head_node_args=node_args)
    outcomes: list[Outcome] = []
    job = None
    try:
        cluster.add_node(**node_args)
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        chaos = Chaos(cluster, disk, disk if mounted else None, rng)
        chaos.node_args = node_args
        digits_epochs, elastic_epochs = 3, 10
        ref = reference_digits(work, cluster.address, digits_epochs)
        print(f"chaos: the undisturbed digits run: weights {ref['weights']} ({time.monotonic() - began:.0f} s)",
              flush=True)
        round_ = 0
        while time.monotonic() - began < args.seconds - 60:
            round_ += 1
            for kind in ("digits", "elastic"):
                if time.monotonic() - began > args.seconds - 60:
                    break
                name = f"{kind}-{round_}"
                epochs = digits_epochs if kind == "digits" else elastic_epochs
                job = make_job(work, disk, cluster.address, kind, name, epochs)
                faults = schedule(rng, args.faults_per_job, kinds)
                print(f"chaos: {name}: " + ", ".join(f.describe() for f in faults), flush=True)
                before = dict(chaos.seen)
                injected = chaos.run_job(job, faults)
                o = check_job(chaos, job, injected, ref, epochs, before)
                outcomes.append(o)
                print(f"chaos: {name}: {o.status}, attempts {o.attempts}, restarts {o.restarts}, "
                      f"{'checks pass' if not o.problems else o.problems}", flush=True)
                if o.survived:
                    shutil.rmtree(disk / name, ignore_errors=True)  # the small disk holds the next runs
                else:
                    keep = work.parent / f"raylaunch-chaos-failed-{seed}-{name}"
                    shutil.copytree(disk / name, keep, dirs_exist_ok=True)
                    shutil.copy(job.log, keep / "driver.log")
                    print(f"chaos: kept {keep}", flush=True)
    finally:
        if job is not None and job.proc is not None and job.proc.poll() is None:  # interrupted mid-job
            job.proc.kill()
            job.proc.wait(30)
        for stop in (ray.shutdown, cluster.shutdown):
            try:
                stop()
            except Exception as exc:  # the rest of the cleanup still runs
                print(f"chaos: {stop.__qualname__}: {exc}", flush=True)
        if mounted:
            subprocess.run(["umount", str(disk)])
        shutil.rmtree(work, ignore_errors=True)
    text = report(outcomes, seed, args.seconds, time.monotonic() - began)
    print(text)
    out = Path(args.out)
    head = out.read_text().split("## Runs", 1)[0] if out.exists() else "# Chaos\n\n"
    runs = out.read_text().split("## Runs\n", 1)[1] if out.exists() and "## Runs\n" in out.read_text() else ""
    out.write_text(head.rstrip() + "\n\n## Runs\n\n" + text + "\n" + runs.lstrip())
    return 0 if outcomes and all(o.survived for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
