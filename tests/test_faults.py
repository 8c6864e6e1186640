"""Faults injected from outside, on the shared multi-node Ray cluster: the run restarts from
the last committed checkpoint, within its restart budget, and leaves no process behind."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import tempfile
import threading
import time
from pathlib import Path

import psutil
import ray

from cluster.nodes.connect import embedded_node
from cluster.protocol import RankFailure
from conftest import wait_for
from jobs.driver.driver import Driver, group_failures
from jobs.spec import load_spec_text

STEADY = """
name: {name}
train_fn: fns:steady
config: {{steps: {steps}, every: 10, step_s: 0.05, pid_dir: {pid_dir}}}
scaling: {{num_nodes: 2, workers_per_node: 1}}
{failure}timeouts: {{heartbeat_s: 10, placement_s: 60}}
storage: {storage}
"""


def steady(name: str, tmp_path: Path, steps: int = 60, restarts: int | None = 1) -> str:
    """The steady job's spec; ``restarts`` None leaves ``failure`` to its defaults."""
    failure = "" if restarts is None else f"failure: {{max_restarts: {restarts}}}\n"
    return STEADY.format(name=name, steps=steps, failure=failure, pid_dir=tmp_path / "pids",
                         storage=tmp_path / "runs")


def start(tmp_path: Path, name: str, steps: int = 60, restarts: int | None = 1, can_grow: bool = False,
          overrides: list[str] | None = None, out: io.StringIO | None = None):
    """The steady job, run by a driver in a thread, so the test can inject faults meanwhile."""
    spec = load_spec_text(steady(name, tmp_path, steps, restarts), overrides)
    driver = Driver(spec, can_grow=can_grow, out=out)
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


def assert_resumed(tmp_path: Path, name: str, result, killed_after: int, steps: int = 60,
                   restarts: int = 1, preemptions: int = 0, infra: int = 0) -> None:
    """The second attempt went on from the checkpoint it restored: its first step is the one after
    it, it ran to the last step, and the restart (or preemption) was counted as such."""
    assert result.status == "succeeded", result.error
    assert result.attempts == 2 and result.restarts == restarts and result.preemptions == preemptions
    assert result.infra_restarts == infra
    restored = result.rank_results["0"]["restored_step"]
    assert restored is not None and restored >= killed_after
    assert result.rank_results["0"]["steps"] == steps
    saved = json.loads((tmp_path / "runs" / name / "result.json").read_text())
    assert saved["status"] == "succeeded" and saved["attempts"] == 2
    assert saved["restarts"] == restarts and saved["preemptions"] == preemptions and saved["infra_restarts"] == infra
    # metrics.jsonl continues from the checkpoint's step with the new attempt number
    for rank in (0, 1):
        second = [r["step"] for r in rows(tmp_path, name) if r["attempt"] == 2 and r["rank"] == rank
                  and "rank_loss" in r]
        assert second == list(range(restored + 1, steps + 1)), (rank, second)
    assert {r["attempt"] for r in rows(tmp_path, name)} == {1, 2}
    # events.jsonl says so where the attempt begins, as where its ranks restored it (#48: it said null)
    events = [json.loads(line) for line in (tmp_path / "runs" / name / "events.jsonl").read_text().splitlines()]
    assert [e["resume_step"] for e in events if e["kind"] == "attempt"] == [None, restored]
    assert [e["step"] for e in events if e["kind"] == "restored"] == [restored]


def test_a_killed_rank_restarts_the_world_from_the_last_checkpoint(ray_cluster, tmp_path, capsys):
    """With the spec's defaults (no failure key): a rank killed from outside (the OOM killer's SIGKILL) is not the
    code's fault, and restarts (#57); the kill is said first, its peer's lost connection in one line after it and
    without its traceback (#56), and the restart names the checkpoint it resumes from."""
    driver, thread, box = start(tmp_path, "kill", restarts=None)
    victim = rank_pid(tmp_path, 1)
    step = wait_for(lambda: committed(tmp_path, "kill"), 60, "a committed checkpoint")
    survivor = rank_pid(tmp_path, 0)
    os.kill(victim, signal.SIGKILL)
    thread.join(180)
    said = capsys.readouterr()
    failed = said.err.split("raylaunch: attempt 1 failed:\n", 1)[1].splitlines()
    assert failed[0] == "[rank 1] killed by signal SIGKILL", said.err
    assert all(line.startswith("[rank 0] failed after it: lost its peer (") for line in failed[1:]), said.err
    assert "Traceback" not in said.err
    result = box["result"]
    assert_resumed(tmp_path, "kill", result, step, infra=1)
    restored = result.rank_results["0"]["restored_step"]
    # from the checkpoint committed, or from a snapshot in memory taken past it (#59)
    began = [json.loads(line) for line in (tmp_path / "runs" / "kill" / "events.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "attempt"][-1]
    where = (f"the snapshot of step {restored} in memory" if began["resume_from"] == "memory" else
             f"checkpoint {restored}")
    assert (f"raylaunch: attempt 1 failed outside the training code; restarting from {where} (1 of 3 "
            "infrastructure restarts: failure.max_infra_restarts)") in said.out
    assert not psutil.pid_exists(survivor) and not psutil.pid_exists(victim)
    assert not psutil.pid_exists(rank_pid(tmp_path, 0, attempt=2))


def test_a_stopped_rank_is_detected_by_its_heartbeat(ray_cluster, tmp_path, capsys):
    driver, thread, box = start(tmp_path, "sigstop", restarts=None)  # the defaults restart a frozen rank
    victim = rank_pid(tmp_path, 1)
    step = wait_for(lambda: committed(tmp_path, "sigstop"), 60, "a committed checkpoint")
    os.kill(victim, signal.SIGSTOP)
    wait_for(lambda: rank_pid(tmp_path, 1, attempt=2), 90, "the restarted world")
    thread.join(180)
    err = capsys.readouterr().err
    # the heartbeat (10 s here, not the default 60) ended the attempt, not a peer's collective error
    failed = err.split("raylaunch: attempt 1 failed:\n", 1)[1]
    silent = re.match(r"\[rank 1\] no heartbeat for (\d+) s \(timeouts.heartbeat_s is 10\): "
                      r"the process is stopped or frozen", failed)
    assert silent and int(silent.group(1)) >= 10, failed
    assert_resumed(tmp_path, "sigstop", box["result"], step, infra=1)
    assert not psutil.pid_exists(victim)
    # where the ranks were when it was noticed: the stopped one is named as such
    assert "[rank 1] no heartbeat for " in err and "where each rank was (every thread: " in err
    assert [l for l in err.splitlines() if l.startswith("  [rank 1] ") and "stopped (SIGSTOP)" in l], err
    assert len(list((tmp_path / "runs" / "sigstop" / "logs").glob("stacks-1-*.txt"))) == 1


def test_a_deterministic_bug_fails_after_the_restart_budget(ray_cluster, tmp_path):
    spec = load_spec_text(f"name: bug\ntrain_fn: fns:fail_on_all_ranks\nscaling: {{num_nodes: 2}}\n"
                          f"failure: {{max_restarts: 2}}\nstorage: {tmp_path}\n")
    error_files = lambda: set(Path(tempfile.gettempdir()).glob("pytorch-errorfile-*"))  # noqa: E731
    before = error_files()
    began = time.monotonic()
    result = Driver(spec, can_grow=False).run()
    assert time.monotonic() - began < 90
    assert result.status == "failed" and result.attempts == 3 and result.restarts == 2
    assert not error_files() - before, "torch's per-rank exception files are removed with the node's scratch folder"
    # once, grouped by the ranks that raised it, with one traceback
    assert result.error.startswith("[ranks 0, 1] ValueError: bad batch shape (3, 4)\nTraceback")
    assert result.error.count("[rank") == 1 and result.error.count("Traceback") == 1


def test_distinct_errors_are_reported_once_each_with_their_ranks():
    failures = [RankFailure(rank=2, exitcode=1, message="ValueError: bad shape", traceback="tb of 2"),
                RankFailure(rank=0, exitcode=1, message="ValueError: bad shape", traceback="tb of 0"),
                RankFailure(rank=1, exitcode=-9, message="killed by signal SIGKILL", traceback="")]
    assert group_failures(failures) == "[ranks 0, 2] ValueError: bad shape\ntb of 2\n[rank 1] killed by signal SIGKILL"


def test_a_hung_collective_fails_after_collective_s(ray_cluster, tmp_path):
    spec = load_spec_text(f"name: hang\ntrain_fn: fns:hang_in_collective\nscaling: {{num_nodes: 2}}\n"
                          f"timeouts: {{collective_s: 5}}\nstorage: {tmp_path}\n")
    began = time.monotonic()
    result = Driver(spec, can_grow=False).run()
    took = time.monotonic() - began
    assert result.status == "failed" and result.attempts == 1
    # rank 0 waited in the all-reduce until the process group's timeout, not rank 1's 600 s sleep
    assert result.error.startswith("[rank 0] ") and "Timed out" in result.error.splitlines()[0], result.error
    assert took < 120, took


def test_storage_that_a_node_reads_differently_is_refused_before_any_rank_starts(ray_cluster, tmp_path):
    """A "shared" path that is local to each node: the nodes find another marker than the driver's."""
    spec = load_spec_text(steady("unshared", tmp_path, steps=10, restarts=0))
    driver = Driver(spec, can_grow=False)
    driver.preflight()  # the driver writes its marker
    marker = tmp_path / "runs" / "unshared" / ".marker"
    marker.write_text("what another machine's local folder holds")
    result = driver.run()
    assert result.status == "failed" and result.attempts == 0
    assert result.error == (f"nodes [0, 1] cannot read {marker}, which the driver wrote: the storage path is not "
                            "shared by every node. Use an NFS mount present on every node or an object store "
                            "(s3://...).")
    assert not (tmp_path / "pids").exists()  # no rank started


def test_a_lost_node_moves_the_run_to_the_nodes_left(ray_cluster, tmp_path):
    ray_cluster.add_node(num_cpus=2)  # a spare: losing one node leaves two
    ray_cluster.wait_for_nodes()
    driver, thread, box = start(tmp_path, "lost", can_grow=True)
    rank_pid(tmp_path, 1)
    step = wait_for(lambda: committed(tmp_path, "lost"), 60, "a committed checkpoint")
    # lose a node that is not the head (the head also runs this test's driver)
    used = [info.node_id for info in driver.group.infos]
    victim = next(n for n in ray_cluster.worker_nodes if n.node_id in used)
    lost_id = victim.node_id
    orphan = rank_pid(tmp_path, used.index(lost_id))  # one worker per node: node rank = world rank
    ray_cluster.remove_node(victim)
    # a rank whose actor died does not live on (it checks for its parent twice a second)
    wait_for(lambda: not psutil.pid_exists(orphan), 10, "the lost node's rank to exit")
    thread.join(240)
    result = box["result"]
    assert_resumed(tmp_path, "lost", result, step, infra=1)
    assert lost_id not in {n["node_id"] for n in result.nodes}
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert {n["node_id"] for n in result.nodes} == alive and len(alive) == 2


def test_waiting_for_nodes_is_visible_and_bounded(ray_cluster, tmp_path, capsys):
    """On a cluster that may grow, too few nodes wait timeouts.placement_s, then fail with the numbers."""
    spec = load_spec_text(steady("wait", tmp_path, steps=10, restarts=0), ["scaling.num_nodes=4", "timeouts.placement_s=12"])
    began = time.monotonic()
    result = Driver(spec, can_grow=True).run()
    assert 11 < time.monotonic() - began < 60
    assert result.status == "failed" and result.attempts == 0
    assert result.error.startswith("gave up after 12 s (timeouts.placement_s): the job needs 4 nodes with {CPU: 1}")
    assert "of the cluster's 2 alive nodes can hold that" in result.error
    assert "waiting for 4 nodes with {'CPU': 1.0}" in capsys.readouterr().out


def test_a_node_that_arrives_while_waiting_is_used(ray_cluster, tmp_path):
    """The autoscaler's part, played by the test: a third node joins while the driver waits."""
    out = io.StringIO()
    driver, thread, box = start(tmp_path, "grow", steps=20, restarts=0, can_grow=True,
                                overrides=["scaling.num_nodes=3"], out=out)
    # the node comes only once the driver says it waits for it (after its first 10 s of waiting)
    wait_for(lambda: "raylaunch: waiting for 3 nodes with {'CPU': 1.0}" in out.getvalue(), 60,
             "the driver to say it waits")
    node = ray_cluster.add_node(**embedded_node(num_cpus=2))
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
    assert_resumed(tmp_path, "preempt", box["result"], step, restarts=0, preemptions=1)


def test_preemptions_beyond_max_preemptions_fail_the_run(ray_cluster, tmp_path):
    driver, thread, box = start(tmp_path, "cap", restarts=0, overrides=["failure.max_preemptions=1"])
    os.kill(rank_pid(tmp_path, 1), signal.SIGTERM)  # the first preemption restarts the run
    os.kill(rank_pid(tmp_path, 1, attempt=2), signal.SIGTERM)  # the second is one too many
    thread.join(180)
    result = box["result"]
    assert result.status == "failed" and result.attempts == 2
    assert result.preemptions == 1 and result.restarts == 0
    # the function takes snapshots (#59): every rank stops at a step they agree on, its snapshot written
    assert re.match(r"preempted: ranks \[0, 1\] stopped at step \d+ on a stop notice", result.error), result.error


def test_a_preempted_rank_checkpoints_within_the_grace_period(ray_cluster, tmp_path):
    driver, thread, box = start(tmp_path, "grace", steps=80, restarts=0,
                                overrides=["config.cooperative=true", "config.every=1000"])
    victim = rank_pid(tmp_path, 1)
    wait_for(lambda: any(r["step"] and r["step"] >= 15 for r in rows(tmp_path, "grace"))
             if (tmp_path / "runs" / "grace" / "metrics.jsonl").exists() else None, 60, "step 15")
    os.kill(victim, signal.SIGTERM)
    thread.join(180)
    result = box["result"]
    # no periodic checkpoint was due (every 1000 steps): the one it resumed from was the notice's
    assert_resumed(tmp_path, "grace", result, 15, steps=80, restarts=0, preemptions=1)
    first = [r["step"] for r in rows(tmp_path, "grace") if r["attempt"] == 1 and r["rank"] == 0 and "rank_loss" in r]
    assert first[-1] == result.rank_results["0"]["restored_step"]  # saved at the step it stopped
    assert not psutil.pid_exists(victim)
