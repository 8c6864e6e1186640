"""How long a checkpoint holds training: ``session.save`` against Accelerate's own ``save_state`` to local disk,
in the same ranks, alternating (`make bench-checkpoint`, and the last part of `make bench`).

A model with about 600 MB of state a rank (50M parameters and AdamW's two moments, fp32), world size 2 on two
simulated nodes of one ``ray.cluster_utils.Cluster`` (1 CPU each), the real driver in this process
(``jobs.driver.driver.Driver``). Each repetition saves once each way, the order alternating (BENCH_CKPT_REPS,
default 3).
Figures: the seconds the call held training (median and range, and the ratio of the medians), the seconds
from ``session.save`` to its commit (the manifests' ``timing``), the step time while a background write runs
against the steps before any save, the host memory an in-flight save holds, and with ``checkpoint.async:
false`` (BENCH_CKPT_SYNC=0 to skip) the same run as before this bench's issue. Storage: a local folder, or
BENCH_CKPT_STORAGE (an s3:// URI, e.g. the tests' moto server). Writes its storage's section of
bench/results-checkpoints.md (a local folder's or an object store's; BENCH_CKPT_NOTE adds a sentence to it).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

REPS = int(os.environ.get("BENCH_CKPT_REPS", "3"))
SPEC = """
name: {name}
train_fn: bench.checkpoint_fn:train
config: {{reps: {reps}}}
scaling: {{num_nodes: 2, workers_per_node: 1}}
checkpoint: {{keep: 2, async: {background}}}
timeouts: {{collective_s: 1200}}
storage: {storage}
"""


def _summary(values: list[float]) -> str:
    if not values:
        return "-"
    digits = 3 if max(values) < 0.1 else 2
    return (f"{statistics.median(values):.{digits}f} s ({min(values):.{digits}f}-{max(values):.{digits}f}, "
            f"n={len(values)})")


def _one(background: bool, storage: str) -> dict:
    from jobs.driver.driver import Driver
    from jobs.run.storage import RunDir
    from jobs.spec import load_spec_text

    name = f"ckpt-{'async' if background else 'sync'}-{int(time.time())}"
    spec = load_spec_text(SPEC.format(name=name, reps=REPS, background=str(background).lower(), storage=storage))
    result = Driver(spec, can_grow=False).run()
    if result.status != "succeeded":
        raise RuntimeError(f"the checkpoint bench's run failed: {result.error}")
    run = RunDir(storage, name)
    commits = [run.checkpoints.manifest(c).get("timing", {}) for c in run.checkpoints.committed()]
    rows = run.read_metrics()
    host = [r["checkpoint_host_mb"] for r in rows if r.get("checkpoint_host_mb")]
    out = dict(result.rank_results["0"])
    out["to_commit_s"] = [t["to_commit_s"] for t in commits if "to_commit_s" in t]
    out["host_mb"] = max(host, default=0.0)
    return out


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="raylaunch-bench-ckpt-"))
    os.environ["RAY_TMPDIR"] = str(work)
    import ray
    from ray.cluster_utils import Cluster

    from cluster.nodes.connect import embedded_node

    storage = os.environ.get("BENCH_CKPT_STORAGE") or str(work / "runs")
    node_args = {"num_cpus": 1, "temp_dir": str(work / "ray")}
    (work / "ray").mkdir()
    load_before = " ".join(f"{x:.1f}" for x in os.getloadavg())
    cluster = Cluster(initialize_head=True, head_node_args=embedded_node(**{**node_args, "num_cpus": 0}))
    results = {}
    try:
        for _ in range(2):
            cluster.add_node(**embedded_node(**node_args))
        env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        ray.init(address=cluster.address, runtime_env={"env_vars": env}, log_to_driver=False, configure_logging=False)
        results["async"] = _one(True, storage)
        print(json.dumps({"async": results["async"]}), flush=True)
        if os.environ.get("BENCH_CKPT_SYNC", "1") != "0":
            results["sync"] = _one(False, storage)
            print(json.dumps({"sync": results["sync"]}), flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    report(results, storage, load_before)
    return 0


def report(results: dict, storage: str, load_before: str) -> None:
    """This storage's section of bench/results-checkpoints.md (a local folder's, an object store's); the other
    storage's section is kept as it was."""
    import torch

    a = results["async"]
    ratio = statistics.median(a["session_save_s"]) / statistics.median(a["save_state_s"])
    before = statistics.median(a["steps_before_s"])
    quiet = statistics.median(a["steps_quiet_s"]) if a.get("steps_quiet_s") else float("nan")
    during = statistics.median(a["steps_during_write_s"]) if a["steps_during_write_s"] else float("nan")
    kind = "an object store" if "://" in storage else "a local folder"
    note = os.environ.get("BENCH_CKPT_NOTE", "")
    lines = [
        f"## Storage: {kind}",
        "",
        f"Machine: {os.cpu_count()} cores, {platform.machine()}, {platform.system()} {platform.release()}; "
        f"torch {torch.__version__}; load average before: {load_before}.{' ' + note if note else ''} "
        f"Storage: {storage.split('?')[0] if '://' in storage else 'a local folder'}. World size 2 on 2 simulated nodes; "
        f"{a['state_mb']:.0f} MiB of state a rank (50M parameters and AdamW's moments, fp32); "
        f"{REPS} saves each way, alternating.",
        "",
        "| | held training (median, range) |",
        "|---|---|",
        f"| Accelerate `save_state` to local disk | {_summary(a['save_state_s'])} |",
        f"| raylaunch `session.save` (`checkpoint.async: true`) | {_summary(a['session_save_s'])} |",
    ]
    if a.get("session_call_s"):
        lines.append(f"| of which the call itself (the rest: the next step's wait for its copies) | "
                     f"{_summary(a['session_call_s'])} |")
    if "sync" in results:
        s = results["sync"]
        lines.append(f"| raylaunch `session.save` (`checkpoint.async: false`) | {_summary(s['session_save_s'])} |")
    lines += [
        "",
        f"- **`session.save` / `save_state`: {ratio:.2f}x** (medians, the same ranks, the same run); **the first "
        f"save held {a['session_save_s'][0]:.3f} s, the longest {max(a['session_save_s']):.3f} s = "
        f"{max(a['session_save_s']) / statistics.median(a['save_state_s']):.2f}x** `save_state`'s median (goal: "
        "every save, the first included, <= 0.1x).",
        f"- From `session.save` to its commit: {_summary(a['to_commit_s'])}.",
        f"- **Step time while a background write runs: {during / quiet:.2f}x** the steps just before each "
        f"`session.save` ({during:.3f} s against {quiet:.3f} s, medians; {len(a['steps_during_write_s'])} steps "
        f"during writes, {len(a.get('steps_quiet_s', []))} before them, no write of any rank in flight); "
        f"{during / before:.2f}x the steps before the first save ({before:.3f} s).",
        f"- Host memory an in-flight save holds: {a['host_mb']:.0f} MiB on rank 0 (one copy of its state); the "
        f"rank's peak resident memory grew {a['peak_rss_extra_mb']:.0f} MiB over the saves"
        + (f"; its checkpoint writer process holds {a['writer_uss_mb']:.0f} MiB of its own (a Python with torch)."
           if a.get("writer_uss_mb") else "."),
    ]
    if "sync" in results and results["sync"].get("to_commit_s"):
        lines.append(f"- With `checkpoint.async: false`, from `session.save` to its commit: "
                     f"{_summary(results['sync']['to_commit_s'])}.")
    path = ROOT / "bench" / "results-checkpoints.md"
    sections = {}
    if path.exists():
        for part in path.read_text().split("\n## Storage: ")[1:]:
            sections[part.split("\n", 1)[0]] = "## Storage: " + part.strip() + "\n"
    sections[kind] = "\n".join(lines) + "\n"
    text = "\n".join(["# Checkpoint bench: how long a save holds training", "",
                      *[sections[k] for k in ("a local folder", "an object store") if k in sections]])
    path.write_text(text)
    print(sections[kind])


if __name__ == "__main__":
    sys.exit(main())
