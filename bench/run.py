"""raylaunch against its peers, interleaved, on this machine: `make bench` (BENCH_FULL=1 for the full run).

Each repetition runs every launcher once, in turn (A B C D A B C D ...), with the same
training function (bench/fn.py), world size 2 on CPU with gloo: torchrun (the floor), Ray
Train's TorchTrainer, `raylaunch run` with an embedded cluster (cold) and `raylaunch run
--address` on a running cluster (warm), and warm again with snapshots in memory off (what the
launcher itself puts on the step, #59's snapshots apart). One run of a launcher yields every figure it is
compared on: time to the first step, steady step time, the cost of metrics (alternating
blocks of steps with and without logging), the checkpoint stall (`session.save` against
`save_state` to local disk, in alternating order) and, for Ray Train and raylaunch warm,
the recovery from a SIGKILLed rank. Quick mode (the default): 1 repetition of 60 steps,
under two minutes on 2 cores; BENCH_FULL=1: 3 repetitions of 240 steps, then the steady step of
the transformers example's model (digits BERT) under each launcher. Every figure is a
median with min and max, and a ratio to torchrun from the same repetition.
Writes bench/results.json and bench/results.md.
"""

from __future__ import annotations

import json
import os
import platform
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cluster.nodes.connect import stop_processes_under  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
FULL = os.environ.get("BENCH_FULL") == "1"
# BENCH_GPU=1: the same comparison on this machine's GPUs, one rank each, NCCL (under five minutes).
GPU = os.environ.get("BENCH_GPU") == "1"
REPS = int(os.environ.get("BENCH_REPS") or (3 if FULL else 2 if GPU else 1))
STEPS = 240 if FULL or GPU else 60


def world_size() -> int:
    if not GPU:
        return 2
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
        sys.exit("BENCH_GPU=1: this machine has no CUDA GPU that torch can use")
    return torch.cuda.device_count()


class PeakRSS:
    """Samples the resident memory of a process tree, and of the node actors, while a run lasts."""

    def __init__(self, pid: int) -> None:
        self.pid, self.tree, self.actor, self.driver = pid, 0, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                root = psutil.Process(self.pid)
                procs = [root, *root.children(recursive=True)]
                self.driver = max(self.driver, root.memory_info().rss)
                self.tree = max(self.tree, sum(p.memory_info().rss for p in procs if p.is_running()))
            except psutil.Error:
                pass
            for p in psutil.process_iter(["name", "cmdline"]):
                try:
                    if "NodeActor" in (p.info["name"] or "") + " ".join(p.info["cmdline"] or []):
                        self.actor = max(self.actor, p.memory_info().rss)
                except psutil.Error:
                    pass
            time.sleep(0.5)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _label(p: psutil.Process) -> str:
    """A process as a person would name it: Ray's workers by their title, Python by its script."""
    cmd = p.cmdline()
    if cmd and cmd[0].startswith("ray::"):
        return cmd[0].split()[0]
    if "cluster.hosting.hostproc" in cmd:
        return "raylaunch warm rank host"
    if cmd and "python" in os.path.basename(cmd[0]):
        args = [c for c in cmd[1:] if not c.startswith("-")]
        return os.path.basename(args[0]) if args else p.name()
    return os.path.basename(cmd[0]) if cmd else p.name()


def _bench_pids(launcher: int, tmp: Path) -> set[int]:
    """The processes this bench started: the launcher's tree (with a Ray cluster it starts itself) and the warm
    cluster (its daemons name ``tmp`` on their command line; its workers and actors are their children). Other
    work on a shared machine (another test run's Ray clusters, node actors, pip) is left out."""
    roots = []
    for p in psutil.process_iter(["cmdline"]):
        if p.pid == launcher or str(tmp) in " ".join(p.info["cmdline"] or []):
            roots.append(p)
    out = {os.getpid()}
    for p in roots:
        try:
            out |= {p.pid, *(c.pid for c in p.children(recursive=True))}
        except psutil.Error:
            pass
    out.discard(os.getpid())
    return out


def _cpu_snapshot(pids: set[int]) -> dict[tuple[int, float], tuple[str, float]]:
    out = {}
    for pid in pids:
        try:
            p = psutil.Process(pid)
            t = p.cpu_times()
            out[(p.pid, p.create_time())] = (_label(p), t.user + t.system)
        except psutil.Error:
            pass
    return out


class BackgroundCPU:
    """CPU that the bench's processes other than the ranks (and this harness) use during rank 0's
    steady steps, in cores (CPU seconds per second), by process label (``_bench_pids``).

    The ranks share the machine's cores with whatever the launcher keeps running
    beside them (a driver, Ray's raylet and GCS, actors): on 2 cores that time
    comes out of the steps.
    """

    def __init__(self, pid_dir: Path, launcher: int, tmp: Path) -> None:
        self.pid_dir, self.launcher, self.tmp, self.cores, self.by_label = pid_dir, launcher, tmp, None, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _phases(self) -> int:
        path = self.pid_dir / "steady.jsonl"
        return len(path.read_text().splitlines()) if path.exists() else 0

    def _run(self) -> None:
        while not self._stop.is_set() and self._phases() < 1:
            time.sleep(0.02)
        if self._stop.is_set():
            return
        pids = _bench_pids(self.launcher, self.tmp)
        # the ranks' parents too: raylaunch's warm rank host, a process of its own beside the cluster
        for line in (self.pid_dir / "first_steps.jsonl").read_text().splitlines():
            try:
                pids.add(psutil.Process(json.loads(line)["pid"]).ppid())
            except psutil.Error:
                pass
        began, t0 = _cpu_snapshot(pids), time.monotonic()
        while not self._stop.is_set() and self._phases() < 2:
            time.sleep(0.02)
        if self._stop.is_set():
            return
        ended, wall = _cpu_snapshot(pids), time.monotonic() - t0
        ranks = {json.loads(line)["pid"] for line in (self.pid_dir / "first_steps.jsonl").read_text().splitlines()}
        me = {os.getpid()}
        by_label: dict[str, float] = {}
        for key, (label, cpu) in ended.items():
            if key[0] in ranks or key[0] in me or key not in began:
                continue
            used = cpu - began[key][1]
            if used > 0:
                by_label[label] = by_label.get(label, 0.0) + used / wall
        self.cores = sum(by_label.values())
        self.by_label = dict(sorted(by_label.items(), key=lambda kv: -kv[1]))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _expand(cmd: list[str], config: dict) -> list[str]:
    cmd = [c.replace("{config}", json.dumps(config)) for c in cmd]
    if "{set_config}" in cmd:
        i = cmd.index("{set_config}")
        cmd[i:i + 1] = [x for k, v in config.items() for x in ("--set", f"config.{k}={json.dumps(v)}")]
    return cmd


def run(cmd: list[str], env: dict, config: dict, tmp: Path, kill: bool = False) -> dict:
    """One run of one launcher: first step, steady steps, saves; with ``kill``, the recovery too.

    With ``kill``, once both ranks finished their steps (and wait), rank 1 is
    SIGKILLed; the launcher must restart the world, whose first step ends
    the recovery time.
    """
    result_path = tmp / f"result-{secrets.token_hex(3)}.json"
    pid_dir = tmp / f"pids-{secrets.token_hex(3)}"
    pid_dir.mkdir()
    config = {**config, "result_path": str(result_path), "pid_dir": str(pid_dir), "wait_for_kill": kill}
    world = config["world_size"]
    log = pid_dir / "first_steps.jsonl"

    def starts() -> list[dict]:
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    began = time.time()
    proc = subprocess.Popen(_expand(cmd, config), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    peak = PeakRSS(proc.pid)
    background = BackgroundCPU(pid_dir, proc.pid, tmp)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)
    reader.start()
    recovery_s = None
    try:
        if kill:
            deadline = time.time() + 300
            while time.time() < deadline and proc.poll() is None and not (
                    result_path.exists() and set(range(world)) <= {r["rank"] for r in starts()}):
                time.sleep(0.05)
            victim = next((r["pid"] for r in starts() if r["rank"] == min(1, world - 1)), None)
            if victim is None or proc.poll() is not None:
                raise RuntimeError(f"{cmd[:4]}: never reached the kill point:\n{''.join(out)[-3000:]}")
            killed_at = time.time()
            os.kill(victim, 9)
            while time.time() < deadline and proc.poll() is None:
                again = [r for r in starts() if r["rank"] == 0 and r["restarted"]]
                if again:
                    recovery_s = again[0]["first_step_at"] - killed_at
                    break
                time.sleep(0.05)
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
        peak.stop()
        background.stop()
        reader.join(5)
    if proc.returncode != 0 or not result_path.exists() or (kill and recovery_s is None):
        log_path = tmp / f"failed-{secrets.token_hex(3)}.log"
        log_path.write_text("".join(out))
        raise RuntimeError(f"{cmd[:4]} failed ({proc.returncode}); its whole output: {log_path}\n"
                           f"{''.join(out)[-3000:]}")
    r = json.loads(result_path.read_text())
    r.update(first_step_s=r["first_step_at"] - began, total_s=time.time() - began, recovery_s=recovery_s,
             peak_tree_mb=peak.tree / 2**20, peak_actor_mb=peak.actor / 2**20, peak_driver_mb=peak.driver / 2**20,
             background_cores=background.cores, background_by_label=background.by_label)
    timeline = _timeline(config, "".join(out))
    if timeline:
        r["timeline"] = {k: v - began for k, v in timeline.items()}
    return r


def _timeline(config: dict, out: str) -> dict:
    """raylaunch's own start-up timeline (result.json), as absolute times."""
    for line in out.splitlines():
        if "run directory " in line and line.startswith("raylaunch: succeeded"):
            path = Path(line.rsplit("run directory ", 1)[1].strip()) / "result.json"
            if path.exists():
                return json.loads(path.read_text()).get("timeline") or {}
    return {}


def save_steps(steps: int, block: int) -> list[int]:
    """The four steps the bench's job saves at, where a save's wake (its write, its commit, the page cache) falls on
    each kind of block of ``bench/fn.py`` alike: at ``steps // 3``, ``steps // 2``, ``2 * steps // 3`` and
    ``5 * steps // 6``, each moved on by whole blocks of ``block`` steps (metrics blocks; pace blocks are twice that,
    ordered paced, unpaced, unpaced, paced) until the step after it is in a kind of block (logged or not, paced or
    not) no earlier save's is. All four once came before logged and paced blocks, putting the saves' wake on the
    logged and paced side of both ratios: single cold runs at a load of about 3 (2026-12-06) read metrics every step
    1.10x, 1.03x, 1.08x and 0.99x with the saves as they were, 1.01x, 0.99x, 1.02x and 1.00x with them spread; their
    pace ratios (1.02-1.07 both ways) did not tell the two apart.

    >>> save_steps(240, 10)
    [80, 120, 170, 210]
    """
    def kind(step: int) -> tuple[bool, bool]:  # (logged, paced) of the block the step after the save is in
        return ((step + 1) // block) % 2 == 0, ((step + 1) // (2 * block)) % 4 in (0, 3)

    out: list[int] = []
    for first in (steps // 3, steps // 2, 2 * steps // 3, 5 * steps // 6):
        step = max(first, out[-1] + 1 if out else 0)
        while kind(step) in {kind(s) for s in out} and step + block < steps:
            step += block
        out.append(step)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_head(tmp: Path, env: dict, resources: list[str]) -> int:
    """A bench's warm cluster: a Ray head on this machine (``ray start``, its temporary folder in ``tmp``, no
    dashboard), started once before the repetitions and ended with ``stop_processes_under(tmp)``; its port."""
    port = free_port()
    subprocess.run([str(BIN / "ray"), "start", "--head", f"--port={port}", *resources, f"--temp-dir={tmp}",
                    "--include-dashboard=false", "--disable-usage-stats"], env=env, check=True, capture_output=True)
    return port


def main() -> int:
    tmp = Path(tempfile.mkdtemp(prefix="rlb-", dir="/tmp"))
    token = secrets.token_hex(16)
    world = world_size()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    if not GPU:
        env["ACCELERATE_USE_CPU"] = "true"
    env.pop("RAY_ADDRESS", None)
    # The warm cluster: started once, before the repetitions (its start is not counted).
    port = start_head(tmp, env, [f"--num-cpus={2 * world}", f"--num-gpus={world}"] if GPU else ["--num-cpus=2"])
    storage = str(tmp / "runs")
    base = {"steps": STEPS, "log_block": 10, "storage": storage, "steps_after_restart": 5,
            "checkpoint_at": save_steps(STEPS, 10),
            "world_size": world, "use_gpu": GPU}
    # On GPUs raylaunch counts them itself (workers_per_node: auto); fn.py reports the world size it saw.
    scaling = ["--set", f"scaling.workers_per_node={'auto' if GPU else world}", "--set",
               f"scaling.use_gpu={str(GPU).lower()}"]
    # Ray Train and raylaunch warm restart the whole world once after a rank dies. torchrun
    # --max-restarts=1 is left out of that: on this machine (torch 2.13, gloo) its restarted
    # world failed every time, connecting to the previous round's gloo address.
    raylaunch = [str(BIN / "raylaunch"), "run", "bench/bench.yaml", "--storage", storage, "--fresh", "--quiet"]
    warm = ["--address", f"127.0.0.1:{port}"]
    launchers = {
        "torchrun": ([str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={world}", "bench/fn.py",
                      "{config}"], False),
        "ray_train": ([sys.executable, "bench/raytrain.py", "{config}"], True),
        "raylaunch_cold": ([*raylaunch, *scaling, "{set_config}"], False),
        "raylaunch_warm": ([*raylaunch, *warm, "--set", "failure.max_restarts=1", *scaling, "{set_config}"], True),
        # the same without snapshots in memory (#59's default): what the launcher itself puts on the step (#58)
        "raylaunch_warm_nosnap": ([*raylaunch, *warm, "--set", "checkpoint.snapshots.every=0", *scaling,
                                   "{set_config}"], False),
    }
    rows: dict[str, list[dict]] = {k: [] for k in launchers}
    first_job = None
    try:
        # A cluster that stays up keeps a warm rank host on each node (env.warm_host): its first raylaunch job
        # starts it, and every later one (the repetitions) forks its ranks from it. That first job runs here, apart.
        first_job = run(launchers["raylaunch_warm"][0], env, {**base, "checkpoint_at": []}, tmp)
        print(f"the first raylaunch job on the warm cluster (starts its warm rank host): first step "
              f"{first_job['first_step_s']:.2f} s", flush=True)
        for rep in range(REPS):
            for name, (cmd, kill) in launchers.items():
                cfg = {**base, "max_failures": 1} if name == "ray_train" else base
                if name.startswith("raylaunch"):  # the pace blocks' two objects swapped every other run (fn.py)
                    cfg = {**cfg, "pace_swap": sum(len(rows[k]) for k in rows if k.startswith("raylaunch")) % 2}
                r = run(cmd, env, cfg, tmp, kill=kill)
                rows[name].append(r)
                print(f"rep {rep + 1}/{REPS} {name:15s} first step {r['first_step_s']:6.2f} s  "
                      f"steady {1000 * r['steady_step_s']:6.1f} ms"
                      + (f"  recovery {r['recovery_s']:5.2f} s" if r["recovery_s"] is not None else "")
                      + (f"  beside the ranks {r['background_cores']:.3f} cores" if r["background_cores"] is not None
                         else ""), flush=True)
        models = []
        if GPU:  # a model whose step takes 20 ms or more on one GPU (GPT-2 small, bf16), metrics every other block
            models.append(("gpt", "GPT-2 small", {**base, "model": "gpt2_small", "steps": 120, "checkpoint_at": []}))
        # A model whose step takes 1-3 ms here (a GPU step's regime, where a launcher's fixed costs show): the time
        # raylaunch adds to a step, in microseconds (#58), metrics every other block as in the main model's runs
        models.append(("tiny", "tiny MLP", {**base, "model": "tiny_mlp", "steps": 1200 if FULL else 600,
                                            "checkpoint_at": []}))
        if FULL:  # the transformers example's model: steady steps only
            models.append(("bert", "digits BERT", {**base, "model": "digits_bert", "steps": 120, "checkpoint_at": [],
                                                   "log_block": 0}))
        for prefix, label, cfg in models:
            for rep in range(REPS):
                for name, (cmd, _) in launchers.items():
                    r = run(cmd, env, cfg, tmp)
                    rows.setdefault(f"{prefix}_{name}", []).append(r)
                    print(f"rep {rep + 1}/{REPS} {label} {name:15s} steady {1000 * r['steady_step_s']:6.1f} ms",
                          flush=True)
    finally:
        stop_processes_under(str(tmp))  # the warm cluster, by PID
    report(rows, first_job)
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def report(rows: dict[str, list[dict]], first_job: dict | None = None) -> None:
    floor = rows["torchrun"]
    figures: dict[str, dict] = {}
    bert = {k[len("bert_"):]: v for k, v in rows.items() if k.startswith("bert_")}
    gpt = {k[len("gpt_"):]: v for k, v in rows.items() if k.startswith("gpt_")}
    tiny = {k[len("tiny_"):]: v for k, v in rows.items() if k.startswith("tiny_")}
    rows = {k: v for k, v in rows.items() if not k.startswith(("bert_", "gpt_", "tiny_"))}
    for name, rs in tiny.items():
        base_rows = tiny["torchrun"]
        figures[f"tiny_mlp_{name}"] = {
            "steady_step_ms": summary([1000 * r["steady_step_s"] for r in rs]),
            "steady_ratio": summary([r["steady_step_s"] / f["steady_step_s"] for r, f in zip(rs, base_rows)]),
            # what the launcher adds to a step, against torchrun's of the same repetition
            "added_us": summary([1e6 * (r["steady_step_s"] - f["steady_step_s"]) for r, f in zip(rs, base_rows)]),
            "cpu_ratio": summary([r["steady_cpu_s"] / f["steady_cpu_s"] for r, f in zip(rs, base_rows)
                                  if r.get("steady_cpu_s") and f.get("steady_cpu_s")] or [float("nan")]),
            "paced_ratio": summary([r["steady_paced_s"] / r["steady_unpaced_s"] for r in rs
                                    if r.get("steady_paced_s") and r.get("steady_unpaced_s")] or [float("nan")]),
        }
    for name, rs in gpt.items():
        figures[f"gpt2_small_{name}"] = {
            "steady_step_ms": summary([1000 * r["steady_step_s"] for r in rs]),
            "steady_ratio": summary([r["steady_step_s"] / f["steady_step_s"] for r, f in zip(rs, gpt["torchrun"])]),
            "logged_ratio": summary([r["steady_logged_s"] / r["steady_quiet_s"] for r in rs
                                     if r.get("steady_logged_s") and r.get("steady_quiet_s")] or [float("nan")]),
            "paced_ratio": summary([r["steady_paced_s"] / r["steady_unpaced_s"] for r in rs
                                    if r.get("steady_paced_s") and r.get("steady_unpaced_s")] or [float("nan")]),
        }
    for name, rs in bert.items():
        figures[f"digits_bert_{name}"] = {
            "steady_step_ms": summary([1000 * r["steady_step_s"] for r in rs]),
            "steady_ratio": summary([r["steady_step_s"] / f["steady_step_s"] for r, f in zip(rs, bert["torchrun"])]),
        }
    for name, rs in rows.items():
        figures[name] = {
            "first_step_s": summary([r["first_step_s"] for r in rs]),
            "first_step_ratio": summary([r["first_step_s"] / f["first_step_s"] for r, f in zip(rs, floor)]),
            "steady_step_ms": summary([1000 * r["steady_step_s"] for r in rs]),
            "steady_ratio": summary([r["steady_step_s"] / f["steady_step_s"] for r, f in zip(rs, floor)]),
            "peak_tree_mb": summary([r["peak_tree_mb"] for r in rs]),
            # the rank's CPU seconds a step (every thread of it), which the machine's other load moves less
            "steady_cpu_ms": summary([1000 * r["steady_cpu_s"] for r in rs if r.get("steady_cpu_s")] or [float("nan")]),
            "cpu_ratio": summary([r["steady_cpu_s"] / f["steady_cpu_s"] for r, f in zip(rs, floor)
                                  if r.get("steady_cpu_s") and f.get("steady_cpu_s")] or [float("nan")]),
            # the steady window's time a step, the saves' holds and what follows them in it (fn.py)
            "window_ratio": summary([r["window_step_s"] / f["window_step_s"] for r, f in zip(rs, floor)
                                     if r.get("window_step_s") and f.get("window_step_s")] or [float("nan")]),
        }
        if rs[0]["recovery_s"] is not None:
            figures[name]["recovery_s"] = summary([r["recovery_s"] for r in rs])
        background = [r for r in rs if r.get("background_cores") is not None]
        if background:
            figures[name]["background_cores"] = summary([r["background_cores"] for r in background])
            labels = {k for r in background for k in r["background_by_label"]}
            top = {k: statistics.median([r["background_by_label"].get(k, 0.0) for r in background]) for k in labels}
            figures[name]["background_top"] = dict(sorted(top.items(), key=lambda kv: -kv[1])[:4])
    ours = rows["raylaunch_cold"] + rows["raylaunch_warm"]
    figures["metrics_every_step_ratio"] = summary([r["steady_logged_s"] / r["steady_quiet_s"] for r in ours])
    figures["pace_ratio"] = summary([r["steady_paced_s"] / r["steady_unpaced_s"] for r in ours])
    taken = [r for r in ours if r.get("snapshots") is not None]
    if taken:  # raylaunch's default snapshots in memory, on the steady step like every other default
        figures["snapshots_taken"] = summary([r["snapshots"] for r in taken])
        figures["snapshot_every"] = summary([r["snapshot_every"] for r in taken])
        figures["snapshots_beside"] = summary([r["snapshots_beside"] for r in taken])
    figures["checkpoint_stall_ratio"] = summary(
        [statistics.median(r["save_s"]) / statistics.median(r["local_save_s"]) for r in ours])
    figures["checkpoint_save_s"] = summary([statistics.median(r["save_s"]) for r in ours])
    figures["local_save_state_s"] = summary([statistics.median(r["local_save_s"]) for r in ours])
    figures["recovery_ratio_to_ray_train"] = summary(
        [a["recovery_s"] / b["recovery_s"] for a, b in zip(rows["raylaunch_warm"], rows["ray_train"])])
    figures["cold_first_step_ratio_to_ray_train"] = summary(
        [a["first_step_s"] / b["first_step_s"] for a, b in zip(rows["raylaunch_cold"], rows["ray_train"])])
    warm = rows["raylaunch_warm"]
    figures["peak_actor_mb"] = summary([r["peak_actor_mb"] for r in warm])
    figures["peak_driver_mb"] = summary([r["peak_driver_mb"] for r in warm])
    for name in ("raylaunch_cold", "raylaunch_warm"):
        phases = rows[name][0].get("timeline", {})
        figures[f"{name}_timeline_s"] = {k: summary([r["timeline"][k] for r in rows[name]]) for k in phases}
    machine = f"{platform.machine()}, {os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB, " \
              f"Python {platform.python_version()}"
    world = rows["torchrun"][0]["world_size"]
    backend = f"{world} GPU(s), NCCL" if GPU else "CPU, gloo"
    if first_job is not None:
        figures["raylaunch_first_job"] = {"first_step_s": first_job["first_step_s"], "timeline_s": first_job.get("timeline")}
    out = {"machine": machine, "mode": ("gpu " if GPU else "") + ("full" if FULL else "quick"), "reps": REPS,
           "steps": STEPS, "world_size": world, "backend": backend,
           "date": time.strftime("%Y-%m-%d"), "figures": figures}
    stem = "results-gpu" if GPU else "results"
    (ROOT / "bench" / f"{stem}.json").write_text(json.dumps(out, indent=2))

    def cell(s: dict, fmt: str) -> str:
        if s["min"] == s["max"]:
            return f"{s['median']:{fmt}}"
        return f"{s['median']:{fmt}} ({s['min']:{fmt}}-{s['max']:{fmt}})"

    lines = [f"Machine: {machine}; {out['mode']} mode, {REPS} interleaved repetition(s) of {STEPS} steps, "
             f"world size {world}, {backend}, 2.1M-parameter MLP; median (min-max) where there are several.", "",
             "| launcher | command -> first step | ratio to torchrun | steady step | ratio to torchrun "
             "(median, then the best and the worst repetition) | CPU of a rank a step | ratio to torchrun "
             "| rank killed -> restarted world's first step "
             "| peak memory of the process tree |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name in rows:
        f = figures[name]
        rec = f"{cell(f['recovery_s'], '.1f')} s" if "recovery_s" in f else "-"
        lines.append(f"| {name} | {cell(f['first_step_s'], '.1f')} s | {cell(f['first_step_ratio'], '.2f')} | "
                     f"{cell(f['steady_step_ms'], '.1f')} ms | {cell(f['steady_ratio'], '.3f')} | "
                     f"{cell(f['steady_cpu_ms'], '.1f')} ms | "
                     f"{cell(f['cpu_ratio'], '.3f')} | {rec} | {f['peak_tree_mb']['median']:.0f} MB |")
    lines += ["",
              "- the steady window's wall time a step, its 4 saves in it (raylaunch's `session.save` holds training for a "
              "copy and writes beside the next steps, and its snapshots in memory begin at the first save; under "
              "torchrun and Ray Train it is `save_state`, holding training for the write), ratio to torchrun: " + ", ".join(
                  f"{name} {cell(figures[name]['window_ratio'], '.3f')}" for name in rows if name != "torchrun"),
              f"- raylaunch cold start against Ray Train's: {cell(figures['cold_first_step_ratio_to_ray_train'], '.2f')} x; "
              f"recovery against Ray Train's: {cell(figures['recovery_ratio_to_ray_train'], '.2f')} x",
              f"- metrics every step (`accelerator.log` + `session.log`) against none, alternating blocks of 10 steps "
              f"within each raylaunch run: {cell(figures['metrics_every_step_ratio'], '.3f')} x step time",
              f"- measuring each rank's pace (`data_wait`, `sync_wait`) against not, alternating blocks of 20 "
              f"steps within each raylaunch run: {cell(figures['pace_ratio'], '.3f')} x step time",
              *([f"- snapshots in memory (raylaunch's default, `checkpoint.snapshots.every: auto`), on the steady step "
                 f"above: a rank took {cell(figures['snapshots_taken'], '.0f')} in a run of {STEPS} steps, "
                 f"every {cell(figures['snapshot_every'], '.0f')} optimizer steps (`auto`'s k at the end), and wrote "
                 f"{cell(figures['snapshots_beside'], '.0f')} beside its saves, from their capture "
                 "(the first save's is `auto`'s first measure)"]
                if "snapshots_taken" in figures else []),
              f"- checkpoint stall: `session.save` {cell(figures['checkpoint_save_s'], '.3f')} s against "
              f"Accelerate's `save_state` to local disk {cell(figures['local_save_state_s'], '.3f')} s, "
              f"in alternating order: {cell(figures['checkpoint_stall_ratio'], '.2f')} x",
              f"- raylaunch warm: peak RSS of a node actor {figures['peak_actor_mb']['median']:.0f} MB, "
              f"of the driver {figures['peak_driver_mb']['median']:.0f} MB"]
    if all("background_cores" in figures[name] for name in rows):
        lines.append("- CPU used beside the ranks during their steady steps, in cores (the machine has "
                     f"{os.cpu_count()}; the warm cluster idles through every launcher's runs; the bench's own "
                     "processes only): " + "; ".join(
                         f"{name} {cell(figures[name]['background_cores'], '.3f')} ("
                         + ", ".join(f"{k} {v:.3f}" for k, v in figures[name]["background_top"].items()) + ")"
                         for name in rows))
    for name in ("raylaunch_cold", "raylaunch_warm"):
        t = figures[f"{name}_timeline_s"]
        if t:
            lines.append(f"- {name} start-up, seconds from the command: "
                         + ", ".join(f"{k} {v['median']:.1f}" for k, v in t.items() if k != "process_start"))
    if gpt:
        lines.append("- GPT-2 small (124M parameters, bf16 autocast, 8 x 512 tokens), steady step (ratio to torchrun; "
                     "metrics every step against none; pace measured against not): " + ", ".join(
            f"{name} {cell(figures[f'gpt2_small_{name}']['steady_step_ms'], '.1f')} ms "
            f"({cell(figures[f'gpt2_small_{name}']['steady_ratio'], '.3f')}; metrics "
            f"{cell(figures[f'gpt2_small_{name}']['logged_ratio'], '.3f')}; pace "
            f"{cell(figures[f'gpt2_small_{name}']['paced_ratio'], '.3f')})" for name in gpt))
    if tiny:
        lines.append("- a tiny MLP (33k parameters, a step of a few ms: fixed costs show), steady step (ratio to torchrun, "
                     "worst repetition; time added to a step against torchrun's; the rank's CPU a step against "
                     "torchrun's): " + ", ".join(
            f"{name} {cell(figures[f'tiny_mlp_{name}']['steady_step_ms'], '.2f')} ms "
            f"({cell(figures[f'tiny_mlp_{name}']['steady_ratio'], '.3f')}, worst "
            f"{figures[f'tiny_mlp_{name}']['steady_ratio']['max']:.3f}; "
            f"{figures[f'tiny_mlp_{name}']['added_us']['median']:+.0f} us, worst "
            f"{figures[f'tiny_mlp_{name}']['added_us']['max']:+.0f} us; CPU "
            f"{cell(figures[f'tiny_mlp_{name}']['cpu_ratio'], '.3f')})" for name in tiny if name != "torchrun"))
    if bert:
        lines.append("- the transformers example's model (digits BERT, 78k parameters), steady step: " + ", ".join(
            f"{name} {cell(figures[f'digits_bert_{name}']['steady_step_ms'], '.1f')} ms "
            f"({cell(figures[f'digits_bert_{name}']['steady_ratio'], '.3f')})" for name in bert))
    if first_job is not None:
        lines.append(f"- the first raylaunch job on the warm cluster, before the repetitions (it starts the node's warm "
                     f"rank host, which the rows above reuse): first step {first_job['first_step_s']:.1f} s; start-up, "
                     "seconds from the command: " + ", ".join(f"{k} {v:.1f}" for k, v in
                                                          first_job.get("timeline", {}).items() if k != "process_start"))
    lines.append("- ray_train and raylaunch_warm's process trees do not include a warm cluster's own processes; "
                 "raylaunch_cold and ray_train include the Ray cluster they start.")
    (ROOT / "bench" / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
