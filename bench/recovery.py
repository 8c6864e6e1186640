"""Lost work and recovery under a schedule of failures: raylaunch with snapshots in memory, raylaunch with storage
commits only, and Ray Train checkpointing to the same storage, in one run (`make bench-recovery`, issue #59).

One ``ray.cluster_utils.Cluster`` in this process: a head with no CPUs (the drivers run here) and RECOVERY_NODES
worker nodes (2; 4 optional) of 1 CPU each, one rank a node. Every arm runs the same function
(``bench.recovery_fn``: an MLP whose state is RECOVERY_STATE_MB MiB a rank, AdamW) and is measured from the same
record, the steps file its rank 0 writes (each step's start and end, each attempt's restored step), while the
bench injects failures, one every 2T/3 seconds of training (T = RECOVERY_T) in the order rank killed, rank killed,
node lost: a rank SIGKILLed every T and a node removed every 2T, on average. A failure waits until the job trains
again after the one before (each failure meets a job that has trained as long since). A rank is killed by its pid
(the pid file the function writes; rank 1, then rank 0, alternating); a node is lost by ``Cluster.remove_node`` of
the node that runs rank 1 (then rank 0), and a node is added back at once so the run can go on at its size.

Arms, interleaved (snapshots, commits, Ray Train; then again with RECOVERY_REPS > 1):

- **snapshots**: raylaunch with ``checkpoint.snapshots.every=auto`` (issue #59: each rank's state in its node's
  memory every k optimizer steps, copied to a peer node). Where the spec does not know that key (``load_spec_text``
  rejects it), the arm is skipped and the results say so.
- **commits**: raylaunch with storage commits only (``checkpoint.snapshots.every=0``).
- **raytrain**: Ray Train V2's ``TorchTrainer``, rank 0 saving the model, the optimizer and the step with
  ``torch.save`` and reporting them (``CheckpointUploadMode.ASYNC``: the upload beside training, its best).

Every arm commits at its best interval for this schedule, by the same rule in the function: Young and Daly's
``sqrt(2 x C x MTBF)``, C the mean hold of the arm's saves so far, the MTBF the schedule's 2T/3, rank 0 deciding.
RECOVERY_COMMIT=auto gives raylaunch's arms the spec's ``checkpoint.every: auto`` (with ``checkpoint.mtbf_s``)
instead: it sizes the interval from the latest save's hold alone, which with asynchronous saves of hundreds of MiB
on 2 cores swings between a save every second (a hold of milliseconds) and one that waits seconds for the previous
write.

Then a node drained (RECOVERY_DRAIN=0 leaves it out): ``ray drain-node`` with reason preemption and a 30-second deadline
(what ``ray.train.get_preemption_info`` reads), a replacement node added at the notice, the drained node removed at
the deadline; its failure is when training stopped (the node's end, or the run's own restart before it).

Then the bar's case (RECOVERY_TINY=0 skips it; RECOVERY_BIG=0 runs it alone and prints its rows): a few hundred KB
of state (RECOVERY_TINY_MB, 0.3), a function that commits every 20 steps, 0.05 s a step, RECOVERY_TINY_KILLS ranks
killed (no node lost), snapshots against commits.

Figures per arm: steps lost per failure (the last step logged before it, minus the step the next attempt resumed
at), seconds from the failure to training again (the failure to the first step of the next attempt), the wasted
seconds per failure (the work since the state it resumed from was taken, plus those), goodput (the bench's: the
final step's work at the median step time over the job's wall clock, the same for every arm; raylaunch's ledger
beside it), host memory (peak RSS of the ranks and of their children, the node actors', /dev/shm/raylaunch-snapshots
if present) and the step time (end to end of consecutive steps, saves included) with snapshots against without,
paired by repetition. Median and worst case; the ratio to Ray Train's wasted seconds per failure.

Defaults: RECOVERY_STATE_MB=576 (the issue's size), RECOVERY_T=30, RECOVERY_FAILURES=3, RECOVERY_REPS=1, the drain;
about 12 minutes on a loaded 2-core machine (RECOVERY_STATE_MB=144 and RECOVERY_DRAIN=0 for a quicker run).
Everything (Ray's temporary folders, the runs' storage) lives in one ``tempfile.mkdtemp()`` folder under /tmp,
removed at the end (RECOVERY_KEEP_LOGS=<dir> keeps the step records, the drivers' output and each run directory
but its checkpoints). Writes bench/results-recovery.md; with RECOVERY_IDLE_S=<s> (each big step also waits that long
with its CPU idle, as a GPU step's host does) bench/results-recovery-idle.md.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import subprocess
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench import elastic  # noqa: E402
from bench.elastic import _records, _wait_for  # noqa: E402

STATE_MB = float(os.environ.get("RECOVERY_STATE_MB", "576"))
T = float(os.environ.get("RECOVERY_T", "30"))
FAILURES = int(os.environ.get("RECOVERY_FAILURES", "3"))
NODES = int(os.environ.get("RECOVERY_NODES", "2"))
REPS = int(os.environ.get("RECOVERY_REPS", "1"))
TINY = os.environ.get("RECOVERY_TINY", "1") != "0"
BIG = os.environ.get("RECOVERY_BIG", "1") != "0"  # 0: the bar's case alone, printed (results-recovery.md is kept)
TINY_MB = float(os.environ.get("RECOVERY_TINY_MB", "0.3"))
TINY_KILLS = int(os.environ.get("RECOVERY_TINY_KILLS", "3"))
# The bar's case's kills 8.5 s of training apart: 170 steps, not a multiple of its 20 between commits, so each falls
# at another point of the commit interval (8.0 s, 160 steps, held them all at one point: 2-3 steps after a commit
# on 2026-12-06 13:51, where the commits arm lost 3, 2 and 2 steps; 1-3 before one in the run before: 19, 19, 17)
TINY_EVERY, TINY_STEP_S, TINY_GAP_S = 20, 0.05, 8.5
# RECOVERY_IDLE_S=<s>: each step of the big case also waits this long with its CPU idle, as a GPU step's host waits
# for its device: the snapshots' and commits' work then has the cores a GPU node leaves it (on this machine's CPU
# steps the ranks take them all). Writes bench/results-recovery-idle.md instead.
IDLE_S = float(os.environ.get("RECOVERY_IDLE_S", "0"))
DRAIN = os.environ.get("RECOVERY_DRAIN", "1") != "0"  # a node drained with a deadline after the schedule's failures
DRAIN_S = 30
COMMIT = os.environ.get("RECOVERY_COMMIT", "young-daly")  # "auto": raylaunch's checkpoint.every: auto instead
ARMS = ("snapshots", "commits", "raytrain")
# RECOVERY_ARMS=snapshots,commits: those arms alone, their rows printed (results-recovery.md is kept: its tables need
# every arm), for a look at one case (RECOVERY_FAILURES=0: the drain alone) with RECOVERY_KEEP_LOGS
ONLY = tuple(a for a in os.environ.get("RECOVERY_ARMS", ",".join(ARMS)).split(",") if a)
SETTLE_STEPS = 3  # steps of the next attempt before the next failure may come
MAX_STEPS = 10**6  # a bound; each job is stopped through its stop file long before
SNAPSHOTS_KEY = "checkpoint.snapshots.every"
SPEC = """
name: {name}
train_fn: bench.recovery_fn:train
config: {config}
scaling: {{num_nodes: {nodes}, workers_per_node: 1}}
checkpoint: {checkpoint}
failure: {{max_restarts: 100, max_infra_restarts: 100}}
timeouts: {{placement_s: 180}}
storage: {storage}
"""


def schedule(count: int) -> list[tuple[str, int]]:
    """The failures in order: (kind, the rank whose process or node goes).

    >>> schedule(6)
    [('rank', 1), ('rank', 0), ('node', 1), ('rank', 1), ('rank', 0), ('node', 0)]
    """
    out, kills, nodes = [], 0, 0
    for i in range(count):
        if i % 3 == 2:
            out.append(("node", 1 - nodes % 2))
            nodes += 1
        else:
            out.append(("rank", 1 - kills % 2))
            kills += 1
    return out


class Memory:
    """Peak resident memory, sampled every second while a job runs: the ranks (by their pid files), their children
    (a checkpoint writer), raylaunch's warm rank hosts (the ranks' parents), the node actors of this cluster, and
    the run's snapshots in memory (its folder under /dev/shm/raylaunch-snapshots), in all and on the fullest node."""

    def __init__(self, pid_dir: Path, cluster, run: str) -> None:
        from cluster.snapshots import snapshot_root

        self.pid_dir, self.cluster = pid_dir, cluster
        self.run = run
        self.root = Path(snapshot_root())
        self.shm_node_mb = 0.0
        self.rank_mb = self.children_mb = self.ranks_total_mb = self.hosts_mb = self.actors_mb = self.shm_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        import psutil

        total, hosts = 0.0, {}
        for f in self.pid_dir.glob("rank-*.pid"):
            try:
                p = psutil.Process(int(f.read_text()))
                rss = p.memory_info().rss / 2**20
                kids = sum(c.memory_info().rss for c in p.children(recursive=True)) / 2**20
                parent = p.parent()
                if parent is not None and "cluster.hosting.hostproc" in parent.cmdline():  # raylaunch's warm host
                    hosts[parent.pid] = parent.memory_info().rss / 2**20
            except (psutil.Error, ValueError, OSError):
                continue
            self.rank_mb, self.children_mb = max(self.rank_mb, rss), max(self.children_mb, kids)
            total += rss + kids
        self.ranks_total_mb = max(self.ranks_total_mb, total)
        self.hosts_mb = max(self.hosts_mb, sum(hosts.values()))
        actors = 0.0  # this cluster's only (its raylets' workers): other runs on the machine have node actors too
        for node in list(self.cluster.worker_nodes):
            try:
                for p in psutil.Process(node.all_processes["raylet"][0].process.pid).children():
                    if "NodeActor" in " ".join(p.cmdline()):
                        actors += p.memory_info().rss / 2**20
            except (psutil.Error, KeyError, IndexError):
                continue
        self.actors_mb = max(self.actors_mb, actors)
        # the run's snapshots: <root>/<run name>-<digest>/<node id>/ (cluster/snapshots.py), each node's and in all
        nodes = [self._mb(node) for run in self.root.glob(f"{self.run}-*") for node in run.iterdir() if node.is_dir()]
        self.shm_mb, self.shm_node_mb = max(self.shm_mb, sum(nodes)), max([self.shm_node_mb, *nodes])

    @staticmethod
    def _mb(root: Path) -> float:
        size = 0
        for folder, _, files in os.walk(root):
            for name in files:
                try:
                    size += os.stat(os.path.join(folder, name)).st_blocks * 512
                except OSError:
                    pass
        return size / 2**20

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self._sample()

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return {"rank_peak_mb": self.rank_mb, "children_peak_mb": self.children_mb,
                "ranks_total_peak_mb": self.ranks_total_mb, "hosts_peak_mb": self.hosts_mb,
                "actors_peak_mb": self.actors_mb, "shm_peak_mb": self.shm_mb,
                "shm_node_peak_mb": self.shm_node_mb}


class Job(elastic.Job):
    """One arm's run: its files, the thread that drives it (``start``, ``ended``, ``stop``: bench/elastic.py's),
    what it returned."""

    def __init__(self, case: str, arm: str, rep: int, work: Path, config: dict) -> None:
        super().__init__(f"recovery-{case}-{arm}", rep, work)
        self.case, self.arm, self.name = case, arm, self.dir.name
        self.pid_dir = self.dir / "pids"
        self.config = {**config, "steps_file": str(self.steps_file), "stop_file": str(self.stop_file),
                       "pid_dir": str(self.pid_dir), "max_steps": MAX_STEPS, "scratch": str(self.dir / "scratch")}
        self.out = elastic._Stamped()  # raylaunch's driver output, each line with its time
        self.driver = None  # raylaunch's Driver: which node holds which rank

    def records(self) -> list[dict]:
        return _records(self.steps_file)

    def pid(self, rank: int) -> int | None:
        try:
            return int((self.pid_dir / f"rank-{rank}.pid").read_text())
        except (OSError, ValueError):
            return None

    def training_again(self, after: float) -> dict | None:
        """The first step of an attempt that restored after ``after``, once that attempt has ``SETTLE_STEPS``
        steps (None before)."""
        records = self.records()
        restored = next((r for r in records if "restored" in r and r["at"] > after), None)
        if restored is None:
            return None
        steps = [r for r in records if "step" in r and r["pid"] == restored["pid"] and r["began"] >= restored["at"]]
        return {"restored": restored, "first": steps[0]} if len(steps) >= SETTLE_STEPS else None


def _node_of(cluster, job: Job, rank: int, pid: int):
    """The cluster node that runs ``rank``: for raylaunch the driver's placement says (one rank a node: the node
    rank is the world rank; its ranks are not children of the raylet); for Ray Train, the node whose raylet is an
    ancestor of ``pid`` (every node shares this machine)."""
    if job.driver is not None:
        node_id = job.driver.group.infos[rank].node_id
        return next(n for n in cluster.worker_nodes if n.node_id == node_id)
    return elastic._node_of(cluster, pid)


def snapshots_known(storage: str) -> str | None:
    """None when the spec knows ``checkpoint.snapshots.every``; otherwise what ``load_spec_text`` said."""
    from jobs.spec import load_spec_text

    try:
        load_spec_text(f"name: probe\ntrain_fn: bench.recovery_fn:train\nstorage: {storage}\n",
                       [f"{SNAPSHOTS_KEY}=auto"])
    except Exception as e:  # noqa: BLE001 - the SpecError's text is the note
        return str(e).replace("\n", " ")
    return None


def _raylaunch(job: Job, work: Path, checkpoint: str, overrides: list[str]) -> None:
    from jobs.driver.driver import Driver
    from jobs.spec import load_spec_text

    spec = load_spec_text(SPEC.format(name=job.name, config=json.dumps(job.config), nodes=NODES,
                                      checkpoint=checkpoint, storage=work / "runs"), overrides)
    driver = job.driver = Driver(spec, can_grow=True, out=job.out)

    def run():
        result = driver.run()
        if result.status != "succeeded":
            raise RuntimeError(f"raylaunch: {result.status}: {result.error}")
        return {"attempts": result.attempts, "infra_restarts": result.infra_restarts, "goodput": result.goodput}

    job.start(run)


def _raytrain_loop(config: dict) -> None:
    """Each Ray Train worker: the same function, with Ray Train's checkpoints: rank 0 saves the model, the optimizer
    and the step with ``torch.save`` into a folder of its own and every rank reports (the upload to the run's storage
    in the background, ``CheckpointUploadMode.ASYNC``); a restart loads the latest with
    ``torch.load(weights_only=True)``."""
    import ray.train
    from ray.train import CheckpointUploadMode

    from bench.recovery_fn import Hooks, recovery_train

    def save(accelerator, model, optimizer, step: int) -> None:
        checkpoint = elastic.raytrain_state(config["scratch"], accelerator, model, optimizer, step)
        ray.train.report({"step": step}, checkpoint=checkpoint, checkpoint_upload_mode=CheckpointUploadMode.ASYNC,
                         delete_local_checkpoint_after_upload=True)

    recovery_train(config, Hooks({}, due=lambda _accelerator, _step: False, save=save,
                                  restore=elastic.raytrain_restore))


def _raytrain(job: Job, work: Path) -> None:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(
        _raytrain_loop, train_loop_config=job.config,
        scaling_config=ScalingConfig(num_workers=NODES, use_gpu=False),
        run_config=RunConfig(storage_path=str(work / "raytrain"), name=job.name,
                             failure_config=FailureConfig(max_failures=100)))

    def run():
        result = trainer.fit()
        if result.error:
            raise RuntimeError(f"Ray Train: {result.error}")
        return {}

    job.start(run)


def _inject(job: Job, cluster, kind: str, rank: int, node_args: dict) -> tuple[float, float | None]:
    """The failure: (when it was made, when its notice came: a drain's only)."""
    from cluster.nodes.connect import embedded_node

    pid = _wait_for(lambda: job.pid(rank), 60, f"rank {rank}'s pid")
    if kind == "rank":
        at = time.time()
        os.kill(pid, signal.SIGKILL)
        return at, None
    victim = _node_of(cluster, job, rank, pid)
    notice = None
    if kind == "drain":  # a cloud preemption through Ray's autoscaler: a drain with a deadline, then the end
        subprocess.run([str(Path(sys.executable).parent / "ray"), "drain-node", "--address", cluster.address,
                        "--node-id", victim.node_id, "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message",
                        "the recovery bench: a preemption", "--deadline-remaining-seconds", str(DRAIN_S)],
                       check=True, capture_output=True)
        notice = time.time()
        cluster.add_node(**embedded_node(**node_args))  # the replacement, which an autoscaler starts on the notice
        time.sleep(max(0.0, notice + DRAIN_S - time.time()))
    at = time.time()
    cluster.remove_node(victim)
    _forget_memory(victim.node_id)
    if kind == "node":
        cluster.add_node(**embedded_node(**node_args))  # the run goes on at its size
    return at, notice


def _forget_memory(node_id: str) -> None:
    """What a node removed kept in memory goes with it, as a real node's does: its folders of the runs' snapshots
    (``cluster/snapshots.py``: <root>/<run key>/<node id>/). The simulated nodes share this machine's /dev/shm, whose
    use every node's bound counts (``checkpoint.snapshots.memory_mb``): left there, a lost node's snapshots took
    the room of the next ones (2026-12-07: a drain's copy of the stop's snapshot to the node left was declined, and
    the restart read the stop's commit from storage instead of memory)."""
    from cluster.snapshots import snapshot_root

    for folder in Path(snapshot_root()).glob(f"*/{node_id}"):
        shutil.rmtree(folder, ignore_errors=True)


def _failure(job: Job, kind: str, rank: int, at: float, notice: float | None = None) -> dict:
    """What one failure cost, from the steps file, once the next attempt trains again. A drain's failure is when
    training stopped: the node's end, or the end of the last step before the run restarted on its own."""
    again = _wait_for(lambda: job.training_again(notice or at), 600,
                      f"{job.arm}: training again after a {kind} failure", job.ended)
    records = job.records()
    cut = min(at, again["restored"]["at"])
    before = [r for r in records if "step" in r and r["ended"] <= cut]
    last = max(before, key=lambda r: r["ended"]) if before else None
    if kind == "drain" and last is not None:
        at = last["ended"]
    resumed = again["restored"]["restored"]
    # the work since the state it resumed from was taken: the end of that step, the last time it was done
    made = [r["ended"] for r in before if r["step"] == resumed]
    first_began = min((r["began"] for r in records if "step" in r), default=at)
    lost_s = at - (max(made) if made else first_began)
    out = {"kind": kind, "rank": rank, "at": at, "last_step": last["step"] if last else 0, "resumed": resumed,
           "steps_lost": (last["step"] if last else 0) - resumed, "lost_s": lost_s,
           "to_training_s": again["first"]["began"] - at, "to_step_s": again["first"]["ended"] - at,
           "wasted_s": lost_s + again["first"]["began"] - at}
    if notice is not None:
        out["stopped_after_notice_s"] = max(0.0, at - notice)  # no step ended after it: stopped at the notice
    return out


def _cycles(records: list[dict]) -> list[float]:
    """Seconds from one step's end to the next's, within each attempt, past its first ``SETTLE_STEPS`` (what a step
    costs with everything between steps: saves, snapshots, metrics)."""
    by_pid: dict[int, list[float]] = {}
    for r in records:
        if "step" in r:
            by_pid.setdefault(r["pid"], []).append(r["ended"])
    out = []
    for ends in by_pid.values():
        out += [b - a for a, b in zip(ends[SETTLE_STEPS:], ends[SETTLE_STEPS + 1:])]
    return out


def run_arm(case: str, arm: str, rep: int, cluster, work: Path, node_args: dict, failures: list[tuple[str, int]],
            gap_s: float, config: dict, checkpoint: str, overrides: list[str]) -> dict:
    """One arm under the schedule: start, a failure every ``gap_s`` of training, stop; its row."""
    job = Job(case, arm, rep, work, config)
    row: dict = {"case": case, "arm": arm, "rep": rep, "failures": []}
    memory = Memory(job.pid_dir, cluster, job.name)
    began = time.time()
    try:
        if arm == "raytrain":
            _raytrain(job, work)
        else:
            _raylaunch(job, work, checkpoint, overrides)
        since = _wait_for(lambda: job.training_again(0.0), 600, f"{arm}: its first steps", job.ended)["first"]["began"]
        row["start_s"] = since - began
        for kind, rank in failures:
            _wait_for(lambda: time.time() >= since + gap_s, gap_s + 5, "the next failure's time", job.ended)
            at, notice = _inject(job, cluster, kind, rank, node_args)
            f = _failure(job, kind, rank, at, notice)
            row["failures"].append(f)
            print(json.dumps({"arm": arm, "case": case, **{k: v for k, v in f.items() if k != "at"}}), flush=True)
            since = f["at"] + f["to_training_s"]
        time.sleep(min(gap_s, 10))  # steady steps after the last failure
        job.stop()
        if "error" in job.box:
            row["error"] = job.box["error"]
    except BaseException as e:
        row["error"] = f"{type(e).__name__}: {e}"
        if job.thread is not None and job.thread.is_alive():
            job.stop_file.touch()
            job.thread.join(120)
        if isinstance(e, KeyboardInterrupt):  # the job stopped; the bench stops too (its cluster in main's finally)
            memory.stop()
            raise
    row["wall_s"] = time.time() - began
    row["memory"] = memory.stop()
    records = job.records()
    steps = [r for r in records if "step" in r]
    row["cycles"] = _cycles(records)
    row["final_step"] = max((r["step"] for r in steps), default=0)
    row["saves"] = [r for r in records if "saved" in r]
    if row["cycles"]:
        median = statistics.median(row["cycles"])
        # the bench's goodput: the final model's steps at the median step time, over the job's wall clock
        row["goodput"] = row["final_step"] * median / row["wall_s"]
    result = job.box.get("result") or {}
    row["ledger"] = result.get("goodput")
    if arm != "raytrain":
        events = _records(work / "runs" / job.name / "events.jsonl")
        row["restored_events"] = [e.get("step") for e in events if e.get("kind") == "restored"]
        row["resume_steps"] = [e.get("resume_step") for e in events if e.get("kind") == "attempt"]
        row["resume_from"] = [e.get("resume_from") for e in events if e.get("kind") == "attempt"]
        # a restart from storage with snapshots on: why not from memory (jobs.run.events.MemoryMissed)
        row["memory_missed"] = [e.get("memory_missed") for e in events if e.get("kind") == "attempt"]
        book = getattr(job.driver, "snapshots", None)  # the driver's book of snapshots: each rank's interval and size
        row["k"] = max(book.every.values()) if book is not None and book.every else None
        row["snapshot_mb"] = max(book.nbytes.values()) / 2**20 if book is not None and book.nbytes else None
        (job.dir / "driver.log").write_text(job.out.getvalue())
    return row


def _fmt(values: list[float], digits: int = 1) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.{digits}f} (worst {max(values):.{digits}f})"


def _of(rows: list[dict], case: str, arm: str, key: str, kind: str | None = None) -> list[float]:
    return [f[key] for r in rows if r["case"] == case and r["arm"] == arm for f in r["failures"]
            if kind is None or f["kind"] == kind]


def _gap(saves: list[dict]) -> str:
    """The median time between two saves of the same attempt."""
    gaps = [b["at"] - a["at"] for a, b in zip(saves, saves[1:]) if a.get("pid") == b.get("pid")]
    return f"{statistics.median(gaps):.1f}" if gaps else "-"


def _met(ok: bool | None) -> str:
    return "not measured" if ok is None else "**met**" if ok else "**not met**"


def _from_storage(rows: list[dict]) -> str:
    """The big snapshots arm's restarts from storage, and why not from memory, as the runs' events say
    (``none_newer``: no snapshot newer than the commit had every rank's part: the commit was the newest whole state)."""
    why = [m for r in rows if r["case"] == "big" and r["arm"] == "snapshots" for m in (r.get("memory_missed") or [])
           if m]
    if not why:
        return ""
    counts = {m: why.count(m) for m in sorted(set(why))}
    return " (restarts from storage, why not from memory: " + ", ".join(f"{m} {n}" for m, n in counts.items()) + ")"


def report(rows: list[dict], meta: dict) -> str:
    arms = [a for a in ARMS if any(r["arm"] == a and r["case"] == "big" for r in rows)]
    lines = ["# Recovery: lost work and the time back to training under a schedule of failures (`make bench-recovery`)",
             "", f"{meta['date']}; Ray {meta['ray']}, torch {meta['torch']}, Accelerate {meta['accelerate']}, Python "
             f"{meta['python']}, {meta['machine']}; load average {meta['load_before']} before, {meta['load_after']} "
             f"after; {meta['wall_s']:.0f} s in all. {meta['note']}", "",
             f"{NODES} simulated nodes (`ray.cluster_utils.Cluster`, 1 CPU each), one rank a node, CPU, gloo; "
             f"{meta['state_mb']:.0f} MiB of state a rank ({meta['width']} x {meta['width']} x 6 layers, AdamW, fp32). "
             + (f"**Each step also waits {IDLE_S:g} s with its CPU idle** (RECOVERY_IDLE_S), as a GPU step's host "
                "waits for its device: the snapshots' and commits' work has the cores a GPU node leaves it. "
                if IDLE_S else "") +
             f"A failure every {2 * T / 3:.0f} s of training (T = {T:g} s: a rank SIGKILLed every T, a node removed "
             f"every 2T, on average), {FAILURES} an arm, in the order rank, rank, node"
             + (f", then a node drained with a {DRAIN_S} s deadline (a replacement added at the notice)" if DRAIN
                else "")
             + f"; {REPS} repetition(s), the arms "
             f"interleaved. Every arm commits at Young and Daly's interval for a failure every {2 * T / 3:.0f} s "
             + ("from the mean hold of its saves (the function's rule, the same for every arm)" if COMMIT != "auto"
                else "(raylaunch's arms: `checkpoint.every: auto`; Ray Train: the function's rule, from the mean hold "
                     "of its saves)") + ". Median (worst):", ""]
    for note in meta["skipped"]:
        lines += [f"- {note}"]
    if meta["skipped"]:
        lines.append("")
    lines += ["| | " + " | ".join(arms) + " |", "|---|" + "---|" * len(arms)]

    def row(label: str, values: Callable[[str], str]) -> None:
        lines.append(f"| {label} | " + " | ".join(values(a) for a in arms) + " |")

    row("steps lost per failure", lambda a: _fmt(_of(rows, "big", a, "steps_lost"), 0))
    row("... a rank killed", lambda a: _fmt(_of(rows, "big", a, "steps_lost", "rank"), 0))
    row("... a node lost", lambda a: _fmt(_of(rows, "big", a, "steps_lost", "node"), 0))
    if DRAIN:
        row(f"... a node drained ({DRAIN_S} s deadline)", lambda a: _fmt(_of(rows, "big", a, "steps_lost", "drain"), 0))
        row("... ... training stopped, seconds after the notice", lambda a: _fmt(
            _of(rows, "big", a, "stopped_after_notice_s", "drain")))
    row("failure -> training again (s)", lambda a: _fmt(_of(rows, "big", a, "to_training_s")))
    row("... a rank killed", lambda a: _fmt(_of(rows, "big", a, "to_training_s", "rank")))
    row("... a node lost", lambda a: _fmt(_of(rows, "big", a, "to_training_s", "node")))
    if DRAIN:
        row("... a node drained", lambda a: _fmt(_of(rows, "big", a, "to_training_s", "drain")))
    row("work lost per failure (s)", lambda a: _fmt(_of(rows, "big", a, "lost_s")))
    row("wasted per failure: lost work + back to training (s)", lambda a: _fmt(_of(rows, "big", a, "wasted_s")))

    def ratio(a: str) -> str:
        rt = _of(rows, "big", "raytrain", "wasted_s")
        mine = _of(rows, "big", a, "wasted_s")
        if not rt or not mine:
            return "-"
        return f"{statistics.median(mine) / statistics.median(rt):.2f} (worst {max(mine) / statistics.median(rt):.2f})"

    row("wasted per failure / Ray Train's (median)", ratio)

    def big(a: str) -> list[dict]:
        return [r for r in rows if r["case"] == "big" and r["arm"] == a]

    row("step, end to end (s)", lambda a: _fmt([c for r in big(a) for c in r["cycles"]], 3))
    row("step, mean (s)", lambda a: f"{statistics.mean(c):.3f}" if (c := [x for r in big(a) for x in r['cycles']])
        else "-")
    row("saves: count; seconds between two, median; hold, median (s)", lambda a: "; ".join(
        f"{len(r['saves'])}; {_gap(r['saves'])}; {statistics.median(s['held_s'] for s in r['saves']):.3f}"
        for r in big(a) if r["saves"]) or "-")
    row("goodput, the bench's (final steps x median step / wall)",
        lambda a: ", ".join(f"{r['goodput']:.0%}" for r in big(a) if r.get("goodput") is not None) or "-")
    row("goodput, raylaunch's ledger (result.json)", lambda a: ", ".join(
        f"{r['ledger']['ratio']:.0%}" for r in big(a) if r.get("ledger")) or "-")
    row("peak RSS of a rank (MiB)", lambda a: _fmt([r["memory"]["rank_peak_mb"] for r in big(a)], 0))
    row("... of a rank's children: its checkpoint writer (MiB)",
        lambda a: _fmt([r["memory"]["children_peak_mb"] for r in big(a)], 0))
    row("... every rank and child together (MiB)",
        lambda a: _fmt([r["memory"]["ranks_total_peak_mb"] for r in big(a)], 0))
    row("... raylaunch's warm rank hosts together (the ranks' parents, MiB)",
        lambda a: _fmt([r["memory"]["hosts_peak_mb"] for r in big(a)], 0))
    row("... the node actors together (MiB)", lambda a: _fmt([r["memory"]["actors_peak_mb"] for r in big(a)], 0))
    row("... the run's snapshots in memory, every node's together (MiB)",
        lambda a: _fmt([r["memory"]["shm_peak_mb"] for r in big(a)], 0))
    row("... ... on the fullest node: its ranks' and its peer's copies (MiB)",
        lambda a: _fmt([r["memory"]["shm_node_peak_mb"] for r in big(a)], 0))
    row("snapshots: every k optimizer steps (k at the end, per rank); a rank's part (MiB)", lambda a: "; ".join(
        f"{r['k']}; {r['snapshot_mb']:.0f}" for r in big(a) if r.get("k")) or "-")
    row("job start -> first step (s)", lambda a: _fmt([r["start_s"] for r in big(a) if "start_s" in r]))
    errors = [r for r in rows if r.get("error")]
    lines.append("")
    # step time, snapshots on against off, paired by repetition
    pairs = [(s, c) for s in big("snapshots") for c in big("commits") if s["rep"] == c["rep"] and s["cycles"]
             and c["cycles"]]
    step_ratio = [statistics.mean(s["cycles"]) / statistics.mean(c["cycles"]) for s, c in pairs]
    if step_ratio:
        lines.append(f"- Step time with snapshots against without (the same function and size, paired by repetition, "
                     f"mean of the steps end to end): {', '.join(f'{x:.3f}x' for x in step_ratio)}; medians: "
                     + ", ".join(f"{statistics.median(s['cycles']) / statistics.median(c['cycles']):.3f}x"
                                 for s, c in pairs) + ".")
    else:
        lines.append("- Step time with snapshots against without: not measured (no snapshots arm ran).")
    # the bar's case
    tiny = [r for r in rows if r["case"] == "tiny"]
    if tiny:
        lines += ["", f"The bar's case: {meta['tiny_kb']:.0f} KB of state a rank, a commit every {TINY_EVERY} steps, "
                  f"{TINY_STEP_S} s a step, {TINY_KILLS} ranks killed {TINY_GAP_S:g} s of training apart:", "",
                  "| | " + " | ".join(a for a in ARMS if any(r["arm"] == a for r in tiny)) + " |",
                  "|---|" + "---|" * len({r["arm"] for r in tiny})]
        tiny_arms = [a for a in ARMS if any(r["arm"] == a for r in tiny)]
        for label, key, d in (("steps lost per rank killed", "steps_lost", 0), ("killed -> training again (s)",
                                                                                 "to_training_s", 1),
                              ("wasted per failure (s)", "wasted_s", 1)):
            lines.append(f"| {label} | " + " | ".join(_fmt(_of(rows, "tiny", a, key), d) for a in tiny_arms) + " |")
        lines.append("| each failure: last step -> resumed at | " + " | ".join(
            ", ".join(f"{f['last_step']}->{f['resumed']}" for r in tiny if r["arm"] == a for f in r["failures"])
            for a in tiny_arms) + " |")
        # (what bounds the steps lost: `auto` keeps a snapshot's hold and charged CPU within 2% of a step)
        lines.append("| `auto`'s k at the end (optimizer steps from one snapshot to the next) | " + " | ".join(
            ", ".join(str(r["k"]) for r in tiny if r["arm"] == a and r.get("k")) or "-" for a in tiny_arms) + " |")
    # goals: the snapshots arm's figure; beside it, where that arm did not run, the commits arm's for reference
    def worst(case: str, arm: str, key: str) -> float | None:
        values = _of(rows, case, arm, key)
        return max(values) if values else None

    rt = _of(rows, "big", "raytrain", "wasted_s")

    def against_rt(arm: str) -> str | None:
        mine = _of(rows, "big", arm, "wasted_s")
        if not mine or not rt:
            return None
        return (f"{statistics.median(mine) / statistics.median(rt):.2f}x median, "
                f"{max(mine) / statistics.median(rt):.2f}x worst")

    def projected(arm: str) -> float | None:
        kills, cycles = _of(rows, "big", arm, "wasted_s", "rank"), [c for r in big(arm) for c in r["cycles"]]
        if not kills or not cycles:
            return None
        return statistics.median(cycles) / statistics.mean(cycles) * (1 - statistics.median(kills) / 120)

    def measured(text: Callable[[str], str | None]) -> str:
        mine = text("snapshots")
        if mine is not None:
            return mine
        other = text("commits")
        return "-" + (f" (commits only: {other})" if other is not None else "")

    k = meta.get("k")
    snap_lost, tiny_lost = worst("big", "snapshots", "steps_lost"), worst("tiny", "snapshots", "steps_lost")
    snap_vs_rt = _of(rows, "big", "snapshots", "wasted_s")
    snap_goodput = projected("snapshots")
    lines += ["", "Goals (issue #59), the snapshots arm (the commits arm's figure beside it where that arm did not "
              "run):",
              "", "| goal | measured | |", "|---|---|---|",
              "| snapshots at most 1.02x step time with `auto` (the mean step; with snapshots every k steps the "
              "median hides them) | "
              + (f"{', '.join(f'{x:.3f}x' for x in step_ratio)} (medians "
                 + ", ".join(f"{statistics.median(a['cycles']) / statistics.median(b['cycles']):.3f}x"
                             for a, b in pairs)
                 + f"; {len(pairs)} pair(s) of runs one after the other: on a shared machine a single pair is within "
                 "its noise, RECOVERY_REPS=3 for more)" if step_ratio else "-")
              + f" | {_met(all(x <= 1.02 for x in step_ratio) if step_ratio else None)} |",
              f"| work lost per rank death or node loss at most k steps (k, what `auto` chose: "
              f"{k if k else 'not said by the run'}) | "
              + measured(lambda a: None if worst("big", a, "steps_lost") is None else
                         f"{worst('big', a, 'steps_lost')} steps, worst")
              + _from_storage(rows)
              + f" | {_met(snap_lost <= k if k and snap_lost is not None else None)} |",
              f"| at most 2 steps lost where the state is tiny ({meta['tiny_kb']:.0f} KB) | "
              + measured(lambda a: None if worst("tiny", a, "steps_lost") is None else
                         f"{worst('tiny', a, 'steps_lost')} steps, worst")
              + f" | {_met(tiny_lost <= 2 if tiny_lost is not None else None)} |",
              "| wasted seconds per failure at most 0.1x Ray Train's | " + measured(against_rt)
              + f" | {_met(max(snap_vs_rt) / statistics.median(rt) <= 0.1 if snap_vs_rt and rt else None)} |",
              "| goodput at least 95% with a rank killed every 2 minutes (projected: the share of a step that "
              "trains, median over mean, x (1 - median wasted per rank killed / 120 s)) | "
              + measured(lambda a: None if projected(a) is None else f"{projected(a):.1%}")
              + f" | {_met(snap_goodput >= 0.95 if snap_goodput is not None else None)} |"]
    lines += ["", "Each failure (arm, kind, rank: last step before -> resumed at, steps lost; work lost, to training "
              "again, wasted, seconds):", ""]
    for r in rows:
        detail = "; ".join(f"{f['kind']} {f['rank']}: {f['last_step']}->{f['resumed']} ({f['steps_lost']}), "
                           f"{f['lost_s']:.1f} + {f['to_training_s']:.1f} = {f['wasted_s']:.1f}" for f in r["failures"])
        extra = ""
        if r.get("restored_events") is not None:
            extra = (f" (events.jsonl: restored {r['restored_events']}, attempts resumed from {r['resume_steps']}, "
                     f"from {r.get('resume_from')}"
                     + (f", not from memory because {r['memory_missed']}" if any(r.get("memory_missed") or ()) else "")
                     + ")")
        lines.append(f"- {r['case']} {r['arm']} rep {r['rep']}: {detail or 'none'}{extra}"
                     + (f". ERROR: {r['error']}" if r.get("error") else ""))
    lines += ["", *NOTES, ""]
    if errors:
        lines.append(f"{len(errors)} arm run(s) ended with an error (above).")
    return "\n".join(lines)


NOTES = [
    "How it is measured:", "",
    "- Every figure comes from the steps file rank 0 of the function writes, the same under every launcher: each "
    "step's start and end, and each attempt's restored step (`session.restore`'s answer; Ray Train: the step in "
    "its checkpoint). Steps lost: the last step that ended before the failure minus the step the next attempt "
    "restored. Training again: the failure to the start of the next attempt's first step. Work lost: the failure "
    "minus the end of the step it resumed from (its last run). Wasted: the two together.",
    "- Step time is end to end of consecutive steps of an attempt (past its first 3), so a save's hold, a snapshot "
    "and the metrics count in it; the snapshot's cost shows in the mean, as it comes every k steps.",
    "- Goodput, the bench's: the final step times the arm's median step over the job's wall clock (start to the end "
    "of the job, a start-up included), the same rule for every arm. raylaunch's ledger (`raylaunch show`, "
    "docs/goodput.md) counts its own categories. The 2-minute goal is projected from the snapshots arm: the share "
    "of a step that trains (median over mean) x (1 - median wasted per rank killed / 120 s).",
    "- raylaunch's arms run with `failure.max_restarts: 100` beside `max_infra_restarts: 100`: on 2026-12-05 a rank "
    "SIGKILLed with snapshots on left its peer failing inside raylaunch's own stop agreement (an all-reduce of "
    "`cluster/rank/session.py`), which the driver counted as a failure of the training code and, with "
    "`max_restarts: 0`, ended the run. The driver's output, kept with RECOVERY_KEEP_LOGS, says how each attempt "
    "failed.",
    "- Peak RSS is sampled every second (a rank's children: its checkpoint writer, a process of its own that maps the "
    "rank's memfd copies, so the total counts shared pages twice).",
]


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="recovery-bench-", dir="/tmp"))
    os.environ["RAY_TMPDIR"] = str(work)  # Ray's session folders and its address file, not /tmp/ray
    (work / "ray").mkdir()
    t0 = time.time()
    load_before = " ".join(f"{x:.1f}" for x in os.getloadavg())
    import accelerate
    import ray
    import torch
    from ray.cluster_utils import Cluster

    from bench.recovery_fn import shape
    from cluster.nodes.connect import embedded_node

    storage = str(work / "runs")
    unknown = snapshots_known(storage)
    skipped = []
    if unknown:
        skipped.append(f"**snapshots: skipped**: the spec does not know `{SNAPSHOTS_KEY}` yet ({unknown}); the "
                       "commits arm is the function committing on its own, with no snapshot key.")
    if set(ONLY) - set(ARMS):
        raise SystemExit(f"RECOVERY_ARMS: {', '.join(sorted(set(ONLY) - set(ARMS)))} is not an arm; the arms: "
                         + ", ".join(ARMS))
    arms = [a for a in ARMS if a in ONLY and not (a == "snapshots" and unknown)]
    mtbf_s = 2 * T / 3
    if COMMIT == "auto":  # raylaunch's own interval for its arms (Ray Train keeps the function's)
        big, every = {"state_mb": STATE_MB}, f"{{keep: 2, every: auto, mtbf_s: {mtbf_s:g}}}"
    else:
        big, every = {"state_mb": STATE_MB, "mtbf_s": mtbf_s}, "{keep: 2}"
    if IDLE_S:
        big["step_s"] = IDLE_S
    no_snapshots = [] if unknown else [f"{SNAPSHOTS_KEY}=0"]
    node_args = {"num_cpus": 1, "temp_dir": str(work / "ray")}
    cluster, rows = None, []
    try:
        cluster = Cluster(initialize_head=True, head_node_args=embedded_node(**{**node_args, "num_cpus": 0}))
        for _ in range(NODES):
            cluster.add_node(**embedded_node(**node_args))
        env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}
        ray.init(address=cluster.address, runtime_env={"env_vars": env}, log_to_driver=False, configure_logging=False)
        for rep in range(REPS if BIG else 0):
            for arm in arms:
                overrides = [f"{SNAPSHOTS_KEY}=auto"] if arm == "snapshots" else no_snapshots
                failures = schedule(FAILURES) + ([("drain", 1)] if DRAIN else [])
                config = {**big, "mtbf_s": mtbf_s} if arm == "raytrain" else big
                rows.append(run_arm("big", arm, rep, cluster, work, node_args, failures, mtbf_s, config, every,
                                    overrides))
                _check_nodes(ray)
        if TINY:
            tiny = {"state_mb": TINY_MB, "every": TINY_EVERY, "step_s": TINY_STEP_S}
            kills = [("rank", 1 - i % 2) for i in range(TINY_KILLS)]
            for arm in [a for a in arms if a != "raytrain"]:
                overrides = [f"{SNAPSHOTS_KEY}=auto"] if arm == "snapshots" else no_snapshots
                rows.append(run_arm("tiny", arm, 0, cluster, work, node_args, kills, TINY_GAP_S, tiny, "{keep: 2}",
                                    overrides))
                _check_nodes(ray)
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        if os.environ.get("RECOVERY_KEEP_LOGS"):
            keep = Path(os.environ["RECOVERY_KEEP_LOGS"])
            keep.mkdir(parents=True, exist_ok=True)
            for job in work.glob("recovery-*"):
                shutil.copytree(job, keep / job.name, ignore=shutil.ignore_patterns("scratch"), dirs_exist_ok=True)
                run = work / "runs" / job.name  # its run directory's records and the ranks' logs, not its checkpoints
                if run.is_dir():
                    shutil.copytree(run, keep / job.name / "run", dirs_exist_ok=True,
                                    ignore=shutil.ignore_patterns("checkpoints", "staging", "*.safetensors", "*.bin"))
            (keep / "rows.json").write_text(json.dumps(rows, indent=1))
        shutil.rmtree(work, ignore_errors=True)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "ray": ray.__version__,
            "torch": torch.__version__, "accelerate": accelerate.__version__, "python": platform.python_version(),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores", "load_before": load_before,
            "load_after": " ".join(f"{x:.1f}" for x in os.getloadavg()), "wall_s": time.time() - t0,
            "state_mb": STATE_MB, "width": shape(STATE_MB)[0], "tiny_kb": TINY_MB * 1024,
            "note": os.environ.get("RECOVERY_NOTE", ""), "skipped": skipped,
            "k": max((r["k"] for r in rows if r["arm"] == "snapshots" and r["case"] == "big" and r.get("k")),
                     default=None)}
    if not BIG or set(ONLY) != set(ARMS):  # rows of some arms or cases alone: the report's tables need them all
        for r in rows:
            print(json.dumps({k: v for k, v in r.items() if not isinstance(v, (list, dict))}))
        return 1 if any(r.get("error") for r in rows) else 0
    text = report(rows, meta)
    (ROOT / "bench" / ("results-recovery-idle.md" if IDLE_S else "results-recovery.md")).write_text(text)
    print(text)
    return 1 if any(r.get("error") for r in rows) else 0


def _check_nodes(ray) -> None:
    alive = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0]
    if len(alive) != NODES:
        raise RuntimeError(f"expected {NODES} worker nodes between arms, found {len(alive)}")


if __name__ == "__main__":
    sys.exit(main())
