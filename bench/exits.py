"""How often a script that finished is reported failed: the same plain Accelerate script (bench/exit_script.py,
world size 2, CPU, gloo) run again and again under `accelerate launch`, `torchrun` and `raylaunch launch` (on a
warm cluster), in turn. A run "finished" when both ranks wrote their file after the last collective; it is
"reported failed" when the launcher's exit code says otherwise. Under the peers a rank's interpreter finalization
aborts now and then (SIGABRT, "terminate called without an active exception": gloo's threads, pytorch/pytorch#179291);
a raylaunch rank ends as python would without that finalization (cluster/rank/exiting.py).

    EXITS_RUNS=30 .venv/bin/python -m bench.exits     # writes bench/results-exits.md
"""

from __future__ import annotations

import os
import platform
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.run import BIN, ROOT, start_head
from cluster.nodes.connect import stop_processes_under

RUNS = int(os.environ.get("EXITS_RUNS", "30"))
SCRIPT = "bench/exit_script.py"  # run from ROOT: raylaunch takes a script inside the working directory


def commands(port: int, storage: Path) -> dict[str, list[str]]:
    return {
        "accelerate_launch": [str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2",
                              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                              "--main_process_port", "0", SCRIPT],
        "torchrun": [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", SCRIPT],
        "raylaunch_warm": [str(BIN / "raylaunch"), "launch", "--address", f"127.0.0.1:{port}", "--storage",
                           str(storage), "--quiet", "--num_processes", "2", SCRIPT],
    }


def one(cmd: list[str], env: dict, out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    started = time.monotonic()
    if "raylaunch" not in cmd[0]:
        env = {**env, "TMPDIR": str(out)}  # torchrun's log folders (torchelastic_*) go with the run's
    proc = subprocess.run([*cmd, str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    finished = all((out / f"finished-rank{r}").exists() for r in (0, 1))
    return {"rc": proc.returncode, "finished": finished, "s": time.monotonic() - started,
            "aborted": "terminate called without an active exception" in proc.stderr + proc.stdout,
            "said": (proc.stderr or proc.stdout).strip().splitlines()[-3:]}


def main() -> int:
    tmp = Path(tempfile.mkdtemp(prefix="rlx-", dir="/tmp"))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true",
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16),
           "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    env.pop("RAY_ADDRESS", None)
    port = start_head(tmp, env, ["--num-cpus=2"])
    cmds = commands(port, tmp / "runs")
    rows: dict[str, list[dict]] = {name: [] for name in cmds}
    try:
        one(cmds["raylaunch_warm"], env, tmp / "out")  # the warm rank host's start, not counted
        for i in range(RUNS):
            for name, cmd in cmds.items():
                r = one(cmd, env, tmp / "out")
                rows[name].append(r)
                print(f"{i + 1}/{RUNS} {name:18s} rc {r['rc']} finished {r['finished']} {r['s']:5.1f} s"
                      + ("  (aborted at exit)" if r["aborted"] else "")
                      + ("" if r["finished"] else f"  said: {' | '.join(r['said'])}"), flush=True)
    finally:
        stop_processes_under(str(tmp))  # the warm cluster, by PID
    report(rows)
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


def report(rows: dict[str, list[dict]]) -> None:
    lines = [f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
             f"{RUNS} runs of each launcher in turn, world size 2, CPU, gloo (`EXITS_RUNS={RUNS} python -m "
             "bench.exits`, bench/exit_script.py).", "",
             "| launcher | runs | finished | finished, reported failed | of those, aborted at exit | median s a run |",
             "|---|---|---|---|---|---|"]
    for name, rs in rows.items():
        done = [r for r in rs if r["finished"]]
        wrong = [r for r in done if r["rc"] != 0]
        median = sorted(r["s"] for r in rs)[len(rs) // 2]
        lines.append(f"| {name} | {len(rs)} | {len(done)} | {len(wrong)} | {sum(r['aborted'] for r in wrong)} | "
                     f"{median:.1f} |")
    text = "\n".join(lines) + "\n"
    (ROOT / "bench" / "results-exits.md").write_text(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
