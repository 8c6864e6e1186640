"""Faults injected from outside, on the shared multi-node Ray cluster: the run restarts from
the last committed checkpoint, within its restart budget, and leaves no process behind."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import psutil
import ray

from jobs.driver import Driver
from jobs.spec import load_spec_text

STEADY = """
name: {name}
train_fn: fns:steady
config: {{steps: {steps}, every: 10, step_s: 0.05, pid_dir: {pid_dir}}}
scaling: {{num_nodes: 2, workers_per_node: 1}}
failure: {{max_restarts: {restarts}}}
timeouts: {{heartbeat_s: 3, placement_s: 60}}
storage: {storage}
"""


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def start(tmp_path: Path, name: str, steps: int = 60, restarts: int = 1, can_grow: bool = False,
          overrides: list[str] | None = None):
    """The steady job, run by a driver in a thread, so the test can inject faults meanwhile."""
    spec = load_spec_text(STEADY.format(name=name, steps=steps, restarts=restarts,
                                        pid_dir=tmp_path / "pids", storage=tmp_path / "runs"), overrides)
    driver = Driver(spec, can_grow=can_grow)
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("result", driver.run()))
    thread.start()
    return driver, thread, box


def rank_pid(tmp_path: Path, rank: int, attempt: int = 1) -> int:
    def read():
        f = tmp_path / "pids" / f"rank-{rank}.pid"
        if f.exists():
            a, pid = f.read_text().split()
            return int(pid) if int(a) == attempt else None
    return wait_for(read, 60, f"rank {rank} of attempt {attempt} to start")


def committed(tmp_path: Path, name: str) -> int | None:
    latest = tmp_path / "runs" / name / "checkpoints" / "latest.json"
    return json.loads(latest.read_text())["step"] if latest.exists() else None


def rows(tmp_path: Path, name: str) -> list[dict]:
    return [json.loads(l) for l in (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()]


def assert_resumed(tmp_path: Path, name: str, result, killed_after: int) -> None:
    assert result.status == "succeeded", result.error
    assert result.attempts == 2 and result.restarts == 1
    assert result.rank_results["0"]["restored_step"] >= killed_after
    saved = json.loads((tmp_path / "runs" / name / "result.json").read_text())
    assert saved["status"] == "succeeded" and saved["attempts"] == 2 and saved["restarts"] == 1
    # metrics.jsonl continues from the checkpoint's step with the new attempt number
    second = [r["step"] for r in rows(tmp_path, name) if r["attempt"] == 2 and r["rank"] == 0 and "loss" in r]
    assert second[0] == result.rank_results["0"]["restored_step"] + 1 and second[-1] == 60


def test_a_killed_rank_restarts_the_world_from_the_last_checkpoint(ray_cluster, tmp_path, capsys):
    driver, thread, box = start(tmp_path, "kill")
    victim = rank_pid(tmp_path, 1)
    step = wait_for(lambda: committed(tmp_path, "kill"), 60, "a committed checkpoint")
    survivor = rank_pid(tmp_path, 0)
    os.kill(victim, signal.SIGKILL)
    thread.join(180)
    assert "[rank 1] killed by signal SIGKILL" in capsys.readouterr().err
    result = box["result"]
    assert_resumed(tmp_path, "kill", result, step)
    assert not psutil.pid_exists(survivor) and not psutil.pid_exists(victim)
    assert not psutil.pid_exists(rank_pid(tmp_path, 0, attempt=2))


def test_a_stopped_rank_is_detected_by_its_heartbeat(ray_cluster, tmp_path, capsys):
    driver, thread, box = start(tmp_path, "sigstop")
    victim = rank_pid(tmp_path, 1)
    step = wait_for(lambda: committed(tmp_path, "sigstop"), 60, "a committed checkpoint")
    os.kill(victim, signal.SIGSTOP)
    stopped_at = time.monotonic()
    wait_for(lambda: rank_pid(tmp_path, 1, attempt=2), 60, "the restarted world")
    assert time.monotonic() - stopped_at < 30  # heartbeat_s is 3: detected in seconds, not minutes
    thread.join(180)
    assert_resumed(tmp_path, "sigstop", box["result"], step)
    assert not psutil.pid_exists(victim)
    # where the ranks were when it was noticed: the stopped one is named as such
    err = capsys.readouterr().err
    assert "[rank 1] no heartbeat for " in err and "where each rank was (every thread: " in err
    assert [l for l in err.splitlines() if l.startswith("  [rank 1] ") and "stopped (SIGSTOP)" in l], err
    assert len(list((tmp_path / "runs" / "sigstop" / "logs").glob("stacks-1-*.txt"))) == 1


def test_a_deterministic_bug_fails_after_the_restart_budget(ray_cluster, tmp_path):
    spec = load_spec_text(f"name: bug\ntrain_fn: fns:fail_on_all_ranks\nscaling: {{num_nodes: 2}}\n"
                          f"failure: {{max_restarts: 2}}\nstorage: {tmp_path}\n")
    began = time.monotonic()
    result = Driver(spec, can_grow=False).run()
    assert time.monotonic() - began < 90
    assert result.status == "failed" and result.attempts == 3 and result.restarts == 2
    # once, grouped by the ranks that raised it, with one traceback
    assert result.error.startswith("[ranks 0, 1] ValueError: bad batch shape (3, 4)\nTraceback")
    assert result.error.count("[rank") == 1 and result.error.count("Traceback") == 1


def test_a_lost_node_moves_the_run_to_the_nodes_left(ray_cluster, tmp_path):
    ray_cluster.add_node(num_cpus=2)  # a spare: losing one node leaves two
    ray_cluster.wait_for_nodes()
    driver, thread, box = start(tmp_path, "lost", can_grow=True)
    rank_pid(tmp_path, 1)
    step = wait_for(lambda: committed(tmp_path, "lost"), 60, "a committed checkpoint")
    # lose a node that is not the head (the head also runs this test's driver)
    used = {info.node_id for info in driver.group.infos}
    victim = next(n for n in ray_cluster.worker_nodes if n.node_id in used)
    lost_id = victim.node_id
    ray_cluster.remove_node(victim)
    thread.join(240)
    result = box["result"]
    assert_resumed(tmp_path, "lost", result, step)
    assert lost_id not in {n["node_id"] for n in result.nodes}
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert {n["node_id"] for n in result.nodes} == alive and len(alive) == 2


def test_waiting_for_nodes_is_visible_and_bounded(ray_cluster, tmp_path, capsys):
    """On a cluster that may grow, too few nodes wait timeouts.placement_s, then fail with the numbers."""
    spec = load_spec_text(STEADY.format(name="wait", steps=10, restarts=0, pid_dir=tmp_path / "pids",
                                        storage=tmp_path / "runs"),
                          ["scaling.num_nodes=4", "timeouts.placement_s=12"])
    began = time.monotonic()
    result = Driver(spec, can_grow=True).run()
    assert 11 < time.monotonic() - began < 60
    assert result.status == "failed" and result.attempts == 0
    assert result.error.startswith("gave up after 12 s (timeouts.placement_s): the job needs 4 nodes with {CPU: 1}")
    assert "of the cluster's 2 alive nodes can hold that" in result.error
    assert "waiting for 4 nodes with {'CPU': 1.0}" in capsys.readouterr().out


def test_a_node_that_arrives_while_waiting_is_used(ray_cluster, tmp_path):
    """The autoscaler's part, played by the test: a third node joins while the driver waits."""
    driver, thread, box = start(tmp_path, "grow", steps=20, restarts=0, can_grow=True,
                                overrides=["scaling.num_nodes=3"])
    time.sleep(3)
    node = ray_cluster.add_node(num_cpus=2)
    try:
        thread.join(180)
        result = box["result"]
        assert result.status == "succeeded", result.error
        assert result.num_nodes == 3 and node.node_id in {n["node_id"] for n in result.nodes}
    finally:
        ray_cluster.remove_node(node)


def test_a_rank_that_never_joins_fails_the_attempt_naming_it(ray_cluster, tmp_path):
    spec = load_spec_text(f"name: nojoin\ntrain_fn: never_joins:train\nscaling: {{num_nodes: 2}}\n"
                          f"timeouts: {{rendezvous_s: 20}}\nstorage: {tmp_path}\n")
    began = time.monotonic()
    result = Driver(spec, can_grow=False).run()
    assert time.monotonic() - began < 60
    assert result.status == "failed" and result.attempts == 1
    assert result.error.startswith("ranks [1] on nodes [1] did not join the process group within 20 s "
                                   "(timeouts.rendezvous_s); no rank trained\nwhere each rank was (every thread: ")
    # rank 1 is still importing the training module; rank 0 waits in the rendezvous
    assert "  [rank 1] in <module> (never_joins.py:7)" in result.error.splitlines()
    assert [l for l in result.error.splitlines() if l.startswith("  [rank 0] in ") and "(worker.py:" in l]
    assert len(list((tmp_path / "nojoin" / "logs").glob("stacks-1-*.txt"))) == 1
    assert not list((tmp_path / "nojoin").glob("metrics.jsonl"))


def test_a_preempted_rank_restarts_without_using_the_restart_budget(ray_cluster, tmp_path):
    driver, thread, box = start(tmp_path, "preempt", restarts=0)
    victim = rank_pid(tmp_path, 1)
    step = wait_for(lambda: committed(tmp_path, "preempt"), 60, "a committed checkpoint")
    os.kill(victim, signal.SIGTERM)  # what a spot node's shutdown sends its processes
    thread.join(180)
    result = box["result"]
    assert result.status == "succeeded", result.error
    assert result.attempts == 2 and result.restarts == 0 and result.preemptions == 1
    assert result.rank_results["0"]["restored_step"] >= step
    saved = json.loads((tmp_path / "runs" / "preempt" / "result.json").read_text())
    assert saved["preemptions"] == 1 and saved["restarts"] == 0


def test_a_preempted_rank_checkpoints_within_the_grace_period(ray_cluster, tmp_path):
    driver, thread, box = start(tmp_path, "grace", steps=80, restarts=0,
                                overrides=["config.cooperative=true", "config.every=1000"])
    victim = rank_pid(tmp_path, 1)
    wait_for(lambda: any(r["step"] and r["step"] >= 15 for r in rows(tmp_path, "grace"))
             if (tmp_path / "runs" / "grace" / "metrics.jsonl").exists() else None, 60, "step 15")
    os.kill(victim, signal.SIGTERM)
    thread.join(180)
    result = box["result"]
    assert result.status == "succeeded", result.error
    assert result.attempts == 2 and result.restarts == 0 and result.preemptions == 1
    # no periodic checkpoint was due (every 1000 steps): the one it resumed from was the notice's
    restored = result.rank_results["0"]["restored_step"]
    assert restored is not None and restored >= 15
    assert not psutil.pid_exists(victim)
