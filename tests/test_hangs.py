"""Hangs on the shared multi-node Ray cluster: the error says where every rank was, the full
stacks land in the run directory, and `raylaunch stacks` reads a live run without stopping it."""

from __future__ import annotations

import subprocess
import sys
import time

from conftest import ROOT, cli_env, free_ports
from jobs.driver.driver import Driver
from jobs.spec import load_spec_text
from test_faults import start, wait_for


def test_a_rank_stuck_in_data_loading_is_named_while_the_other_waits_in_all_reduce(ray_cluster, tmp_path):
    spec = load_spec_text(f"name: hang\ntrain_fn: fns:hang_in_data\nscaling: {{num_nodes: 2}}\n"
                          f"failure: {{max_restarts: 0}}\ntimeouts: {{collective_s: 5}}\nstorage: {tmp_path}\n")
    began = time.monotonic()
    result = Driver(spec, can_grow=False).run()
    assert time.monotonic() - began < 90
    assert result.status == "failed"
    assert result.error.startswith("[rank 0] RuntimeError: ") and "Timed out waiting 5000ms" in result.error
    where = result.error.split("where each rank was (every thread: ", 1)[1]
    files = list((tmp_path / "hang" / "logs").glob("stacks-1-*.txt"))
    assert len(files) == 1 and where.startswith(f"{files[0]}):\n")
    lines = where.splitlines()[1:]
    # rank 0 failed in the collective (its traceback), rank 1 still sat in its dataset
    assert lines[0].startswith("  [rank 0] in all_reduce (fns.py:") and "<- accelerate " in lines[0]
    assert lines[0].endswith("[failed]")
    assert lines[1].startswith("  [rank 1] in _SlowOnRank1.__getitem__ (fns.py:") and len(lines) == 2
    full = files[0].read_text()
    assert "rank 1 (node 1, host " in full and "read by py-spy" in full and "thread raylaunch-heartbeat" in full
    assert "rank 0 (node 0, pid ?, failed, read by traceback)" in full


def test_raylaunch_stacks_reads_a_live_run_which_then_succeeds(ray_cluster, tmp_path):
    driver, thread, box = start(tmp_path, "live", steps=80, restarts=0)
    wait_for(lambda: (tmp_path / "runs" / "live" / "metrics.jsonl").exists(), 60, "the first step")
    out = subprocess.run([sys.executable, "-m", "jobs.cli", "stacks", "live", "--storage", str(tmp_path / "runs"),
                          "--full"], capture_output=True, text=True, env=cli_env(), cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "run live: attempt 1, 2 ranks"
    # every rank read, in the training function (its loop or a library call it made)
    named = [l for l in lines[1:] if l.startswith("[rank")]
    assert sum(len(l.split("]")[0].split(",")) for l in named) == 2 and all(" in " in l for l in named)
    assert "could not be read" not in out.stdout
    assert "rank 0 (node 0, host " in out.stdout and "rank 1 (node 1, host " in out.stdout
    assert "steady (" in out.stdout  # the training function's frame, in the full stacks
    # where each rank runs, to find the one to stop or inspect (#48): node, host and address, the rank's own pid
    import socket

    pids = {r: int((tmp_path / "pids" / f"rank-{r}.pid").read_text().split()[1]) for r in (0, 1)}
    where = out.stdout.split("where they run:\n", 1)[1].splitlines()[:2]
    host = socket.gethostname()
    assert [w.split(" (")[0] for w in where] == [f"  rank 0: node 0, host {host}", f"  rank 1: node 1, host {host}"]
    assert [w.split(", pid ")[1] for w in where] == [str(pids[0]), str(pids[1])], where
    # show --per-rank names them too, from the run directory alone
    show = subprocess.run([sys.executable, "-m", "jobs.cli", "show", "live", "--per-rank", "--storage",
                           str(tmp_path / "runs")], capture_output=True, text=True, env=cli_env(), cwd=ROOT,
                          timeout=60)
    assert "  ranks       attempt 1 (running):" in show.stdout, show.stdout
    assert f"    rank 1: node 1, host {host} (" in show.stdout and f"), pid {pids[1]}" in show.stdout
    thread.join(180)
    assert box["result"].status == "succeeded", box["result"].error
    done = subprocess.run([sys.executable, "-m", "jobs.cli", "stacks", "live", "--storage", str(tmp_path / "runs")],
                          capture_output=True, text=True, env=cli_env(), cwd=ROOT, timeout=60)
    assert done.returncode == 1
    assert "run 'live' is not running (status succeeded)" in done.stderr


def test_raylaunch_stacks_of_a_run_whose_cluster_is_gone_says_so_at_once(tmp_path):
    from jobs.run.storage import RunDir

    run = RunDir(str(tmp_path), "orphan")
    run.prepare({"name": "orphan"})
    # what a driver killed with SIGKILL leaves: status running, the address of a cluster now gone
    run.write_result({"status": "running", "attempts": 1, "live": {
        "ray_address": f"127.0.0.1:{free_ports(1)[0]}", "namespace": "raylaunch", "node_actors": ["x-node0"]}})
    began = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "jobs.cli", "stacks", "orphan", "--storage", str(tmp_path)],
                         capture_output=True, text=True, env=cli_env(), cwd=ROOT, timeout=60)
    assert out.returncode == 1 and time.monotonic() - began < 30
    assert "raylaunch: cannot reach the Ray cluster of run 'orphan' at 127.0.0.1:" in out.stderr
    assert "give its address with --address" in out.stderr


def test_raylaunch_stacks_names_the_rank_the_others_wait_for(ray_cluster, tmp_path):
    """In synchronous training all ranks log the same step rate; the straggler is the rank the
    others wait for in their collectives."""
    driver, thread, box = start(tmp_path, "straggle", steps=40, restarts=0,
                                overrides=["config.slow_rank=1", "config.slow_s=0.3", "config.every=1000"])
    wait_for(lambda: (tmp_path / "runs" / "straggle" / "metrics.jsonl").exists(), 60, "the first step")
    out = subprocess.run([sys.executable, "-m", "jobs.cli", "stacks", "straggle", "--storage", str(tmp_path / "runs"),
                          "--samples", "10"], capture_output=True, text=True, env=cli_env(), cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "\nstraggler: rank 1, which the others wait for (waited in a collective in 10 readings: rank 0 " \
        in out.stdout, out.stdout
    thread.join(180)
    assert box["result"].status == "succeeded", box["result"].error
