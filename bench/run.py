"""raylaunch against its peers, interleaved, on this machine: `make bench` (BENCH_FULL=1 for the full run).

Each repetition runs every launcher once, in turn (A B C D A B C D ...), with the same
training function (bench/fn.py), world size 2 on CPU with gloo. Every figure is reported as
a median with min and max, and as a ratio to torchrun (the floor) from the same repetition.
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
from cluster.local import stop_processes_under  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
FULL = os.environ.get("BENCH_FULL") == "1"
REPS = 5 if FULL else 2
STEPS = 200 if FULL else 60


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


def run(cmd: list[str], env: dict, config: dict, tmp: Path) -> dict:
    result_path = tmp / f"result-{secrets.token_hex(3)}.json"
    config = {**config, "result_path": str(result_path)}
    cmd = [c.replace("{config}", json.dumps(config)) for c in cmd]
    cmd = [c for c in cmd]
    if "{set_config}" in cmd:
        i = cmd.index("{set_config}")
        cmd[i:i + 1] = [x for k, v in config.items() for x in ("--set", f"config.{k}={json.dumps(v)}")]
    began = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak = PeakRSS(proc.pid)
    out, _ = proc.communicate(timeout=600)
    peak.stop()
    if proc.returncode != 0 or not result_path.exists():
        raise RuntimeError(f"{cmd[:4]} failed ({proc.returncode}):\n{out[-3000:]}")
    r = json.loads(result_path.read_text())
    r.update(first_step_s=r["first_step_at"] - began, total_s=time.time() - began,
             peak_tree_mb=peak.tree / 2**20, peak_actor_mb=peak.actor / 2**20, peak_driver_mb=peak.driver / 2**20)
    return r


def recovery(cmd: list[str], env: dict, config: dict, tmp: Path) -> float:
    """Seconds from SIGKILL of rank 1 to the restarted world's first step on rank 0."""
    pid_dir = tmp / f"pids-{secrets.token_hex(3)}"
    pid_dir.mkdir()
    config = {**config, "pid_dir": str(pid_dir)}
    cmd = [c.replace("{config}", json.dumps(config)) for c in cmd]
    if "{set_config}" in cmd:
        i = cmd.index("{set_config}")
        cmd[i:i + 1] = [x for k, v in config.items() for x in ("--set", f"config.{k}={json.dumps(v)}")]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = pid_dir / "first_steps.jsonl"

    def starts() -> list[dict]:
        return [json.loads(l) for l in log.read_text().splitlines()] if log.exists() else []

    deadline = time.time() + 300
    while time.time() < deadline and not {0, 1} <= {r["rank"] for r in starts()}:
        time.sleep(0.05)
    time.sleep(1.0)  # a few steady steps first
    victim = next(r["pid"] for r in starts() if r["rank"] == 1)
    killed_at = time.time()
    os.kill(victim, 9)
    while time.time() < deadline:
        again = [r for r in starts() if r["rank"] == 0 and r["first_step_at"] > killed_at]
        if again:
            out, _ = proc.communicate(timeout=300)
            if proc.returncode != 0:
                raise RuntimeError(f"{cmd[:4]} failed ({proc.returncode}) after the restart:\n{out[-3000:]}")
            return again[0]["first_step_at"] - killed_at
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"{cmd[:4]}: no restarted first step within 300 s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    tmp = Path(tempfile.mkdtemp(prefix="rlb-", dir="/tmp"))
    token = secrets.token_hex(16)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true",
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    env.pop("RAY_ADDRESS", None)
    port = free_port()
    # The warm cluster: started once, before the repetitions (its start is not counted).
    subprocess.run([str(BIN / "ray"), "start", "--head", f"--port={port}", "--num-cpus=2", f"--temp-dir={tmp}",
                    "--include-dashboard=false", "--disable-usage-stats"], env=env, check=True, capture_output=True)
    storage = str(tmp / "runs")
    base = {"steps": STEPS, "log_every": 1, "storage": storage}
    launchers = {
        "torchrun": [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", "bench/fn.py", "{config}"],
        "ray_train": [sys.executable, "bench/raytrain.py", "{config}"],
        "raylaunch_cold": [str(BIN / "raylaunch"), "run", "bench/bench.yaml", "--storage", storage, "--fresh",
                           "{set_config}"],
        "raylaunch_warm": [str(BIN / "raylaunch"), "run", "bench/bench.yaml", "--storage", storage, "--fresh",
                           "--address", f"127.0.0.1:{port}", "{set_config}"],
    }
    extra = {  # raylaunch only: the cost of metrics and of checkpoints
        "raylaunch_warm_nolog": (launchers["raylaunch_warm"], {"log_every": 0}),
        "raylaunch_warm_ckpt": (launchers["raylaunch_warm"], {"checkpoint_at": [STEPS // 3, STEPS // 2]}),
    }
    rows: dict[str, list[dict]] = {k: [] for k in [*launchers, *extra]}
    try:
        for rep in range(REPS):
            for name, cmd in launchers.items():
                rows[name].append(run(cmd, env, base, tmp))
                print(f"rep {rep + 1}/{REPS} {name:22s} first step {rows[name][-1]['first_step_s']:6.2f} s  "
                      f"steady {1000 * rows[name][-1]['steady_step_s']:6.1f} ms", flush=True)
            for name, (cmd, cfg) in extra.items():
                rows[name].append(run(cmd, env, {**base, **cfg}, tmp))
                print(f"rep {rep + 1}/{REPS} {name:22s} steady {1000 * rows[name][-1]['steady_step_s']:6.1f} ms",
                      flush=True)
        # Recovery: one rank killed mid-run; both restart it once (raylaunch: failure.max_restarts=1,
        # Ray Train: FailureConfig(max_failures=1)). Once per mode: each costs two start-ups.
        rec_cfg = {**base, "steps": 4 * STEPS, "max_failures": 1}
        recover_cmds = {
            "ray_train": launchers["ray_train"],
            "raylaunch_warm": [*launchers["raylaunch_warm"], "--set", "failure.max_restarts=1"],
        }
        for rep in range(REPS):
            for name, cmd in recover_cmds.items():
                cfg = {k: v for k, v in rec_cfg.items() if name == "ray_train" or k != "max_failures"}
                rows.setdefault(f"recovery_{name}", []).append({"s": recovery(cmd, env, cfg, tmp)})
                print(f"rep {rep + 1}/{REPS} recovery {name:15s} {rows[f'recovery_{name}'][-1]['s']:6.2f} s",
                      flush=True)
    finally:
        stop_processes_under(str(tmp))  # the warm cluster, by PID
    report(rows)
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def report(rows: dict[str, list[dict]]) -> None:
    floor = rows["torchrun"]
    figures: dict[str, dict] = {}
    for name in ["torchrun", "ray_train", "raylaunch_cold", "raylaunch_warm"]:
        rs = rows[name]
        figures[name] = {
            "first_step_s": summary([r["first_step_s"] for r in rs]),
            "first_step_ratio": summary([r["first_step_s"] / f["first_step_s"] for r, f in zip(rs, floor)]),
            "steady_step_ms": summary([1000 * r["steady_step_s"] for r in rs]),
            "steady_ratio": summary([r["steady_step_s"] / f["steady_step_s"] for r, f in zip(rs, floor)]),
            "peak_tree_mb": summary([r["peak_tree_mb"] for r in rs]),
        }
    warm, nolog, ckpt = rows["raylaunch_warm"], rows["raylaunch_warm_nolog"], rows["raylaunch_warm_ckpt"]
    figures["metrics_every_step_ratio"] = summary([a["steady_step_s"] / b["steady_step_s"] for a, b in zip(warm, nolog)])
    figures["checkpoint_stall_ratio"] = summary(
        [statistics.median(r["save_s"]) / statistics.median(r["local_save_s"]) for r in ckpt])
    figures["checkpoint_save_s"] = summary([statistics.median(r["save_s"]) for r in ckpt])
    figures["local_save_state_s"] = summary([statistics.median(r["local_save_s"]) for r in ckpt])
    for name in ("ray_train", "raylaunch_warm"):
        figures[f"recovery_{name}_s"] = summary([r["s"] for r in rows[f"recovery_{name}"]])
    figures["recovery_ratio_to_ray_train"] = summary(
        [a["s"] / b["s"] for a, b in zip(rows["recovery_raylaunch_warm"], rows["recovery_ray_train"])])
    figures["peak_actor_mb"] = summary([r["peak_actor_mb"] for r in warm])
    figures["peak_driver_mb"] = summary([r["peak_driver_mb"] for r in warm])
    machine = f"{platform.machine()}, {os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB, " \
              f"Python {platform.python_version()}"
    out = {"machine": machine, "mode": "full" if FULL else "quick", "reps": REPS, "steps": STEPS,
           "date": time.strftime("%Y-%m-%d"), "figures": figures}
    (ROOT / "bench" / "results.json").write_text(json.dumps(out, indent=2))

    def cell(s: dict, fmt: str) -> str:
        return f"{s['median']:{fmt}} ({s['min']:{fmt}}-{s['max']:{fmt}})"

    lines = [f"Machine: {machine}; {out['mode']} mode, {REPS} interleaved repetitions of {STEPS} steps, "
             f"world size 2, CPU, gloo, 2.1M-parameter MLP; median (min-max).", "",
             "| launcher | command -> first step | ratio to torchrun | steady step | ratio to torchrun | peak memory of the process tree |",
             "|---|---|---|---|---|---|"]
    for name in ["torchrun", "ray_train", "raylaunch_cold", "raylaunch_warm"]:
        f = figures[name]
        lines.append(f"| {name} | {cell(f['first_step_s'], '.1f')} s | {cell(f['first_step_ratio'], '.2f')} | "
                     f"{cell(f['steady_step_ms'], '.1f')} ms | {cell(f['steady_ratio'], '.3f')} | "
                     f"{f['peak_tree_mb']['median']:.0f} MB |")
    lines += ["",
              f"- metrics every step (`accelerator.log` + `session.log`) against never: "
              f"{cell(figures['metrics_every_step_ratio'], '.3f')} x step time",
              f"- checkpoint stall: `session.save` {cell(figures['checkpoint_save_s'], '.3f')} s against "
              f"Accelerate's `save_state` to local disk {cell(figures['local_save_state_s'], '.3f')} s: "
              f"{cell(figures['checkpoint_stall_ratio'], '.2f')} x",
              f"- recovery, SIGKILL of rank 1 to the restarted world's first step: raylaunch "
              f"{cell(figures['recovery_raylaunch_warm_s'], '.1f')} s, Ray Train (FailureConfig(max_failures=1)) "
              f"{cell(figures['recovery_ray_train_s'], '.1f')} s: {cell(figures['recovery_ratio_to_ray_train'], '.2f')} x",
              f"- raylaunch warm: peak RSS of a node actor {figures['peak_actor_mb']['median']:.0f} MB, "
              f"of the driver {figures['peak_driver_mb']['median']:.0f} MB",
              "- ray_train and raylaunch_warm's process trees do not include a warm cluster's own processes; "
              "raylaunch_cold and ray_train include the Ray cluster they start."]
    (ROOT / "bench" / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
