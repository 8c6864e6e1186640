"""Node lost -> training again on fewer nodes: raylaunch's elastic run against Ray Train V2's
elastic ``ScalingConfig(num_workers=(min, max))``, in the same run (`make bench-elastic`).

One ``ray.cluster_utils.Cluster`` in this process: a head with no CPUs (both launchers' drivers
run here, in this process) and two worker nodes of 1 CPU each, so a job of world size 2 (one rank
a node) holds both. Repetitions alternate raylaunch, Ray Train, raylaunch, ... (BENCH_REPS each,
default 2). Each one starts the job, waits for a checkpoint and steady steps at world size 2,
removes the node of rank 1 (``cluster.remove_node``) and measures the time to the first optimizer
step at world size 1 that began after the loss; then adds a node (``cluster.add_node``) and, with
BENCH_GROW=1 (the default), measures the time to the first step at world size 2 again (bounded by
BENCH_GROW_S, default 45 s), then stops the job through its stop file and waits for it to end.

Both sides run ``bench.elastic_fn.elastic_train`` (the same model, 0.1 s per step, a checkpoint
every 5 steps) and are measured from the same record: the steps file its rank 0 writes.
raylaunch: the real driver in this process (``jobs.driver.driver.Driver``, as ``raylaunch run`` runs it),
``min_nodes: 1``, ``timeouts.resize_s: 1``. Ray Train: ``TorchTrainer`` with
``num_workers=(1, 2)``, checkpoints through ``ray.train.report``.

Everything (Ray's temporary folders, the runs' storage) lives in one ``tempfile.mkdtemp()``
folder, removed at the end. Writes bench/results-elastic.md.
"""

from __future__ import annotations

import io
import json
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

STEP_S = 0.1
EVERY = 5  # optimizer steps between checkpoints
RESIZE_S = 1.0  # raylaunch's timeouts.resize_s here (its default: 30 s)
MONITOR_S = 5.0  # Ray Train's elastic_resize_monitor_interval_s here (its default: 60 s)
SETTLE_S = 3.0  # seconds between the first checkpoint and the loss
MAX_STEPS = 5000  # a bound; the bench stops each job through its stop file long before
SPEC = """
name: {name}
train_fn: bench.elastic_fn:train
config: {config}
scaling: {{num_nodes: 2, workers_per_node: 1, min_nodes: 1}}
failure: {{max_restarts: 3}}
timeouts: {{resize_s: {resize_s}, placement_s: 120}}
storage: {storage}
"""


def _wait_for(condition: Callable, timeout_s: float, what: str, failed: Callable[[], str | None] = lambda: None):
    """``condition()``'s first truthy value, checked every 0.05 s; raises after ``timeout_s``, or at
    once when ``failed()`` says why the job cannot get there."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        why = failed()
        if why:
            raise RuntimeError(f"waiting for {what}: {why}")
        time.sleep(0.05)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


class _Stamped(io.StringIO):
    """The driver's output, each line prefixed with the time it was written (for the timeline)."""

    at_line_start = True

    def write(self, text: str) -> int:
        for part in text.splitlines(keepends=True):
            super().write((f"{time.time():.3f} " if self.at_line_start else "") + part)
            self.at_line_start = part.endswith("\n")
        return len(text)


class Job:
    """One repetition's files, the job's thread and its result."""

    def __init__(self, side: str, rep: int, work: Path) -> None:
        self.side, self.rep = side, rep
        self.dir = work / f"{side}-{rep}"
        self.dir.mkdir(parents=True)
        self.steps_file, self.ranks_file = self.dir / "steps.jsonl", self.dir / "ranks.jsonl"
        self.stop_file = self.dir / "stop"
        self.config = {"steps_file": str(self.steps_file), "ranks_file": str(self.ranks_file),
                       "stop_file": str(self.stop_file), "step_s": STEP_S, "every": EVERY, "max_steps": MAX_STEPS,
                       "scratch": str(self.dir / "scratch")}
        self.box: dict = {}
        self.out: _Stamped | None = None  # raylaunch's driver output
        self.thread: threading.Thread | None = None

    def start(self, run: Callable[[], object]) -> None:
        def body():
            try:
                self.box["result"] = run()
            except BaseException as e:  # noqa: BLE001 - reported by the bench, not raised in a thread
                self.box["error"] = f"{type(e).__name__}: {e}"

        self.thread = threading.Thread(target=body, name=f"{self.side}-{self.rep}", daemon=True)
        self.thread.start()

    def ended(self) -> str | None:
        if self.thread is not None and not self.thread.is_alive():
            return f"the {self.side} job ended: {self.box.get('error') or self.box.get('result')}"
        return None

    def steps(self) -> list[dict]:
        return [r for r in _records(self.steps_file) if "step" in r]

    def steady_at_two(self) -> bool:
        """Steps at world size 2 that began ``SETTLE_S`` after its first checkpoint at world size 2 was
        saved: the launcher has it by then (Ray Train's controller learns of a report when it next
        polls the workers; a loss 0.3 s after the first report restarted Ray Train from step 0)."""
        saved = [r["at"] for r in _records(self.steps_file) if "checkpoint" in r and r["world_size"] == 2]
        return bool(saved) and any(r["began"] >= saved[0] + SETTLE_S for r in self.steps() if r["world_size"] == 2)

    def first_step(self, world: int, after: float) -> dict | None:
        return next((r for r in self.steps() if r["world_size"] == world and r["began"] > after), None)

    def started(self, world: int, after: float) -> float | None:
        """When the first rank of a world of this size entered the function after ``after``."""
        return min((r["at"] for r in _records(self.ranks_file) if r["world_size"] == world and r["at"] > after),
                   default=None)

    def rank_pid(self, rank: int, world: int) -> int:
        return [r["pid"] for r in _records(self.ranks_file) if r["rank"] == rank and r["world_size"] == world][-1]

    def stop(self, timeout_s: float = 120) -> None:
        self.stop_file.touch()
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            raise TimeoutError(f"the {self.side} job did not end within {timeout_s:.0f} s of its stop file")


def _node_of(cluster, pid: int):
    """The cluster node whose raylet is an ancestor of ``pid`` (every node shares this machine)."""
    import psutil

    raylets = {n.all_processes["raylet"][0].process.pid: n for n in cluster.worker_nodes}
    proc = psutil.Process(pid)
    while proc is not None:
        if proc.pid in raylets:
            return raylets[proc.pid]
        proc = proc.parent()
    raise RuntimeError(f"process {pid} runs on none of the worker nodes")


def _raylaunch(job: Job, work: Path) -> None:
    from jobs.driver.driver import Driver
    from jobs.spec import load_spec_text

    spec = load_spec_text(SPEC.format(name=f"elastic-{job.rep}", config=json.dumps(job.config), resize_s=RESIZE_S,
                                      storage=work / "runs"))
    job.out = _Stamped()
    driver = Driver(spec, can_grow=True, out=job.out)

    def run():
        result = driver.run()
        if result.status != "succeeded":
            raise RuntimeError(f"raylaunch: {result.status}: {result.error}")
        return {"world_size": result.world_size, "attempts": result.attempts,
                "resizes": [(z["old_world_size"], z["new_world_size"]) for z in result.resizes]}

    job.start(run)


def raytrain_state(scratch: str, accelerator, model, optimizer, step: int):
    """A Ray Train worker's save (here and in bench/recovery.py): on rank 0, the model, the optimizer and the step in
    ``state.pt`` (``torch.save``) of a folder of its own under ``scratch``, as the ``Checkpoint`` to report; None on
    the other ranks."""
    import torch
    from ray.train import Checkpoint

    if not accelerator.is_main_process:
        return None
    os.makedirs(scratch, exist_ok=True)
    folder = tempfile.mkdtemp(dir=scratch)
    torch.save({"model": accelerator.unwrap_model(model).state_dict(), "optimizer": optimizer.state_dict(),
                "step": step}, os.path.join(folder, "state.pt"))
    return Checkpoint.from_directory(folder)


def raytrain_restore(accelerator, model, optimizer) -> int | None:
    """A Ray Train worker's restart (here and in bench/recovery.py): what ``raytrain_state`` saved, from the latest
    checkpoint Ray Train hands back, loaded with ``torch.load(weights_only=True)``; its step, or None when there is
    none."""
    import ray.train
    import torch

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as folder:
        state = torch.load(os.path.join(folder, "state.pt"), weights_only=True)
    accelerator.unwrap_model(model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])


def _raytrain_loop(config: dict) -> None:
    """Each Ray Train worker: the same function, with Ray Train's checkpoints: rank 0 saves the model,
    the optimizer and the step with ``torch.save`` and reports them; a restart loads them with
    ``torch.load(weights_only=True)`` (no unpickling: Accelerate's ``load_state`` is kept for the
    runner's checksummed checkpoints, see tests/test_checkpoints.py)."""
    import ray.train

    from bench.elastic_fn import Hooks, elastic_train

    def save(accelerator, model, optimizer, step: int) -> None:
        # every rank reports; rank 0's checkpoint is copied to the run's storage, then its folder removed
        ray.train.report({"step": step}, checkpoint=raytrain_state(config["scratch"], accelerator, model, optimizer,
                                                                   step), delete_local_checkpoint_after_upload=True)

    elastic_train(config, Hooks({}, save, raytrain_restore))


def _raytrain(job: Job, work: Path) -> None:
    from ray.train import FailureConfig, RunConfig
    from ray.train.torch import TorchTrainer
    from ray.train.v2.api.config import ScalingConfig

    trainer = TorchTrainer(
        _raytrain_loop, train_loop_config=job.config,
        scaling_config=ScalingConfig(num_workers=(1, 2), use_gpu=False, elastic_resize_monitor_interval_s=MONITOR_S),
        run_config=RunConfig(storage_path=str(work / "raytrain"), name=f"elastic-{job.rep}",
                             failure_config=FailureConfig(max_failures=3)))

    def run():
        result = trainer.fit()
        return {"error": str(result.error) if result.error else None}

    job.start(run)


def _repetition(side: str, rep: int, cluster, work: Path, node_args: dict, grow_s: float | None) -> dict:
    """Start, lose rank 1's node, measure, add a node, optionally measure growing back, stop."""
    from cluster.nodes.connect import embedded_node

    job = Job(side, rep, work)
    began = time.time()
    (_raylaunch if side == "raylaunch" else _raytrain)(job, work)
    row: dict = {"side": side, "rep": rep}
    try:
        _wait_for(job.steady_at_two, 180, f"{side}: a checkpoint and steady steps at world size 2", job.ended)
        row["start_s"] = job.steps()[0]["ended"] - began
        victim = _node_of(cluster, job.rank_pid(1, 2))
        lost_at = time.time()
        cluster.remove_node(victim)
        row["remove_node_s"] = time.time() - lost_at
        last_before = max(r["step"] for r in job.steps() if r["began"] < lost_at)
        first = _wait_for(lambda: job.first_step(1, lost_at), 240, f"{side}: a step at world size 1", job.ended)
        row["lost_at"], row["shrink_s"] = lost_at, first["ended"] - lost_at
        row["shrink_started_s"] = (job.started(1, lost_at) or first["began"]) - lost_at
        row["steps_redone"] = last_before - (first["step"] - 1)
        cluster.add_node(**embedded_node(**node_args))
        added_at = time.time()
        if grow_s:
            try:
                again = _wait_for(lambda: job.first_step(2, added_at), grow_s, f"{side}: a step at world size 2 again",
                                  job.ended)
                row["grow_s"] = again["ended"] - added_at
            except TimeoutError as e:
                row["grow_s"] = None
                row["grow_note"] = str(e)
        job.stop()
        if "error" in job.box:
            row["error"] = job.box["error"]
    except BaseException as e:
        row["error"] = f"{type(e).__name__}: {e}"
        if job.thread is not None and job.thread.is_alive():
            job.stop_file.touch()
            job.thread.join(60)
    if job.out is not None:
        (job.dir / "driver.log").write_text(job.out.getvalue())
    row["result"] = job.box.get("result")
    return row


# What each side says when it notices the loss and when its smaller world is placed: (noticed, placed).
_MARKS = {"raylaunch": (re.compile(r"raylaunch: attempt \d+ failed"), re.compile(r"attempt \d+: world size 2 -> 1")),
          "raytrain": (re.compile(r"\[FailurePolicy\] RETRY"), re.compile(r"Started training worker group of size 1"))}


def _said(side: str, job_dir: Path, work: Path) -> list[tuple[float, str]]:
    """(time, line) of what the side's driver or controller logged."""
    if side == "raylaunch":
        log = job_dir / "driver.log"
        return [(float(t), rest) for t, _, rest in (l.partition(" ") for l in log.read_text().splitlines())
                if t.replace(".", "").isdigit()] if log.exists() else []
    out = []
    for log in work.glob("ray/session_*/logs/train/ray-train-app-controller-*.log"):
        for line in log.read_text().splitlines():
            try:
                record = json.loads(line)
                at = time.mktime(time.strptime(record["asctime"].split(",")[0], "%Y-%m-%d %H:%M:%S"))
                out.append((at + int(record["asctime"].split(",")[1]) / 1000, str(record.get("message", ""))))
            except (ValueError, KeyError, IndexError):
                continue
    return sorted(out)


def _timeline(row: dict, work: Path) -> None:
    """Seconds from the loss to the side noticing it and to its smaller world being placed."""
    if "lost_at" not in row:
        return
    said = _said(row["side"], work / f"{row['side']}-{row['rep']}", work)
    end = row["lost_at"] + row["shrink_s"]
    for key, mark in zip(("noticed_s", "placed_s"), _MARKS[row["side"]]):
        at = next((t for t, line in said if row["lost_at"] <= t <= end and mark.search(line)), None)
        row[key] = None if at is None else at - row["lost_at"]
    # The world size of the first restart tried after the loss (Ray Train sizes it from its
    # AutoscalingCoordinator's view of the nodes, which it refreshes every 20 s).
    tried = next((m for t, line in said if row["lost_at"] <= t <= end
                  for m in [re.search(r"ready resources for (\d+) workers|world size 2 -> (\d+)", line)] if m), None)
    row["first_try"] = None if tried is None else int(tried.group(1) or tried.group(2))


def _keep_logs(work: Path, to: Path) -> None:
    to.mkdir(parents=True, exist_ok=True)
    for job in work.glob("ray*-*"):
        shutil.copytree(job, to / job.name, ignore=shutil.ignore_patterns("scratch"), dirs_exist_ok=True)
    for train_logs in work.glob("ray/session_*/logs/train"):
        shutil.copytree(train_logs, to / "ray-train-logs", dirs_exist_ok=True)


def _fmt(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def _summary(rows: list[dict]) -> dict:
    def of(side: str, key: str) -> list[float]:
        return [r[key] for r in rows if r["side"] == side and r.get(key) is not None]

    out = {}
    for key in ("shrink_s", "noticed_s", "placed_s", "shrink_started_s", "grow_s", "start_s", "steps_redone",
                "remove_node_s"):
        out[key] = {side: of(side, key) for side in ("raylaunch", "raytrain")}
    pairs = list(zip(of("raylaunch", "shrink_s"), of("raytrain", "shrink_s")))
    out["ratios"] = [a / b for a, b in pairs]
    return out


def _markdown(rows: list[dict], summary: dict, meta: dict) -> str:
    labels = {"shrink_s": "node lost -> first step at world size 1",
              "noticed_s": "... of which: node lost -> the loss noticed (a failed attempt)",
              "placed_s": "... node lost -> a world of size 1 placed and started",
              "shrink_started_s": "... node lost -> the function running at world size 1",
              "steps_redone": "optimizer steps redone (after the last checkpoint)",
              "grow_s": f"node added -> first step at world size 2 again (bounded at {meta['grow_s']} s)",
              "start_s": "job started -> first step (world size 2)",
              "remove_node_s": "`cluster.remove_node` took"}
    lines = ["# Elastic: node lost -> training again on fewer nodes (`make bench-elastic`)", "",
             f"Ray {meta['ray']} (Ray Train V2: {meta['v2']}), torch {meta['torch']}, Accelerate {meta['accelerate']}, "
             f"Python {meta['python']}, {meta['machine']}; load average {meta['load_before']} before, "
             f"{meta['load_after']} after. {meta['reps']} repetitions each, interleaved; {meta['wall_s']:.0f} s in all.",
             "", "World size 2 (2 nodes x 1 rank, CPU, gloo) shrinking to 1 when rank 1's node is removed; "
             f"{STEP_S} s per optimizer step, a checkpoint every {EVERY} steps. raylaunch: `min_nodes: 1`, "
             f"`timeouts.resize_s: {RESIZE_S:g}` (its default is 30 s); Ray Train: `num_workers=(1, 2)`, "
             f"`elastic_resize_monitor_interval_s={MONITOR_S:g}` (its default is 60 s), worker group start timeout "
             f"{meta['start_timeout']} s. Seconds, median (min-max):", "",
             "| measure | raylaunch | Ray Train V2 |", "|---|---|---|"]
    for key, label in labels.items():
        v = summary[key]
        if key == "steps_redone":
            lines.append(f"| {label} | {', '.join(str(x) for x in v['raylaunch']) or '-'} | "
                         f"{', '.join(str(x) for x in v['raytrain']) or '-'} |")
        else:
            lines.append(f"| {label} | {_fmt(v['raylaunch'])} | {_fmt(v['raytrain'])} |")
    ratios = ", ".join(f"{r:.2f}" for r in summary["ratios"]) or "-"
    lines += ["", f"raylaunch / Ray Train, node lost -> first step at world size 1, per repetition: {ratios}", "",
              "| side | rep | start | lost -> noticed | first restart tried at world size | -> placed | -> function | "
              "-> step | steps redone | added -> step | result / error |", "|---|---|---|---|---|---|---|---|---|---|---|"]

    def s(v):
        return "-" if v is None else f"{v:.1f}"

    for r in rows:
        what = r.get("error") or json.dumps(r.get("result"))
        lines.append(f"| {r['side']} | {r['rep']} | {s(r.get('start_s'))} | {s(r.get('noticed_s'))} | "
                     f"{r.get('first_try') or '-'} | {s(r.get('placed_s'))} | {s(r.get('shrink_started_s'))} | "
                     f"{s(r.get('shrink_s'))} | {r.get('steps_redone', '-')} | {s(r.get('grow_s'))} "
                     f"{r.get('grow_note', '')} | {what} |")
    lines += ["", *meta["notes"], ""]
    return "\n".join(lines)


def main() -> None:
    reps = int(os.environ.get("BENCH_REPS", "2"))
    start_timeout = os.environ.get("BENCH_RT_START_TIMEOUT_S")  # Ray Train's worker group start timeout (60 s)
    if start_timeout:
        os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = start_timeout  # the controller gets it from here
    grow_s = float(os.environ.get("BENCH_GROW_S", "45")) if os.environ.get("BENCH_GROW", "1") != "0" else None
    work = Path(tempfile.mkdtemp(prefix="rl-elastic-"))
    os.environ["RAY_TMPDIR"] = str(work)  # Ray's session folders and its address file, not /tmp/ray
    (work / "ray").mkdir()
    t0 = time.time()
    load_before = " ".join(f"{x:.1f}" for x in os.getloadavg())
    import accelerate
    import ray
    import torch
    from ray.cluster_utils import Cluster
    from ray.train.v2._internal.constants import is_v2_enabled

    from cluster.nodes.connect import embedded_node

    node_args = {"num_cpus": 1, "temp_dir": str(work / "ray")}
    cluster, rows = None, []
    try:
        cluster = Cluster(initialize_head=True, head_node_args=embedded_node(**{**node_args, "num_cpus": 0}))
        for _ in range(2):
            cluster.add_node(**embedded_node(**node_args))
        env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}
        ray.init(address=cluster.address, runtime_env={"env_vars": env}, log_to_driver=False, configure_logging=False)
        for rep in range(reps):
            for side in ("raylaunch", "raytrain"):
                row = _repetition(side, rep, cluster, work, node_args, grow_s)
                rows.append(row)
                print(json.dumps(row), flush=True)
                alive = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0]
                if len(alive) != 2:
                    raise RuntimeError(f"expected 2 worker nodes between repetitions, found {len(alive)}")
        for row in rows:
            _timeline(row, work)
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        if os.environ.get("BENCH_KEEP_LOGS"):  # a folder for the step records, the drivers' output, Ray Train's logs
            _keep_logs(work, Path(os.environ["BENCH_KEEP_LOGS"]))
        shutil.rmtree(work, ignore_errors=True)

    summary = _summary(rows)
    meta = {"ray": ray.__version__, "v2": "the default" if is_v2_enabled() else "off", "torch": torch.__version__,
            "accelerate": accelerate.__version__, "python": platform.python_version(),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores", "load_before": load_before,
            "load_after": " ".join(f"{x:.1f}" for x in os.getloadavg()), "reps": reps, "wall_s": time.time() - t0,
            "grow_s": grow_s, "notes": NOTES,
            "start_timeout": start_timeout or "60 (its default)"}
    text = _markdown(rows, summary, meta)
    (ROOT / "bench" / "results-elastic.md").write_text(text)
    print(text)


NOTES = [
    "What each side does between the loss and its first step at world size 1:", "",
    "- **raylaunch**: the rank on the node that is left fails at its next collective (gloo: connection closed by "
    "peer); the attempt ends and counts as a restart (a lost node: `failure.max_infra_restarts`). The driver waits up to "
    "`timeouts.resize_s` for 2 nodes (1 s here; with the default of 30 s this figure is about 29 s longer, by "
    "design: a lost spot node rarely comes back within seconds), places the one node there is, starts a fresh node "
    "actor and rank there, and the rank restores the last committed checkpoint with gradient accumulation 2 (the "
    "global batch kept).",
    "- **Ray Train V2** (the default in this Ray; no `RAY_TRAIN_V2_ENABLED` needed): the controller's poll sees "
    "the worker error and retries (`FailureConfig.max_failures`). `ElasticScalingPolicy` sizes the new worker "
    "group from the `AutoscalingCoordinator`'s reservation, which is computed from the totals of the nodes "
    "`ray.nodes()` listed at the coordinator's last tick (every 20 s, `TICK_INTERVAL_S`). When no tick fell "
    "between the loss and the restart decision, it still counts the lost node, asks for 2 workers, waits the "
    "worker group start timeout (`RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S`, 60 s by default) for a placement "
    "that cannot happen, retries that controller error (without limit), asks for 2 again until a tick has "
    "dropped the lost node, and only then starts 1 worker: the long repetitions (\"first restart tried at "
    "world size 2\"). When a tick did fall in between, it starts 1 worker at once. It "
    "resumes from the latest checkpoint its controller has registered, with the same per-worker batch (the "
    "global batch halves; the function would have to change it).",
    "- It works on a static `ray.cluster_utils.Cluster` (no autoscaler): the coordinator's resource requests go "
    "nowhere, its reservations come from the nodes' totals. On this cluster every node has the same IP, and Ray "
    "Train reported both workers as `node_rank=0` with local ranks 0 and 1 (presumably it groups workers by IP).",
    "- Growing back: raylaunch restarts at its next checkpoint committed after the node arrived; Ray Train after "
    "the coordinator's next tick and its `elastic_resize_monitor_interval_s` (5 s here; 60 s by default).",
    "- Each job is stopped through a stop file its function reads (rank 0 looks, then broadcasts), so both end "
    "cleanly at a step; the loss is `cluster.remove_node` of the node that runs rank 1 (found from its pid's "
    "ancestry: the node's raylet), taken once a checkpoint is at least "
    f"{SETTLE_S:g} s old (a loss 0.3 s after Ray Train's first report restarted it from step 0: its controller "
    "had not registered the checkpoint yet).",
]

if __name__ == "__main__":
    main()
