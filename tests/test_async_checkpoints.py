"""Checkpoints that do not stop training: a save holds a rank only while its state is copied into memory; the
write runs beside training, and the commit follows it. On the shared two-node cluster, with storage made slow
(every file a checkpoint's background thread writes waits first) so that a write is seen running."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import threading
from pathlib import Path

import psutil

from conftest import committed_step, wait_for
from jobs.driver.driver import Driver
from jobs.run.storage import RunDir
from jobs.runs import format_show
from jobs.spec import load_spec_text

DIGITS = """
name: {name}
train_fn: {fn}
config: {{epochs: 2, train_samples: 256, batch_size: 16, dropout: 0.0, checkpoint_every: 4{extra}}}
scaling: {{num_nodes: 2, workers_per_node: 1}}
failure: {{max_restarts: 1}}
checkpoint: {{keep: 4}}
storage: {storage}
"""


def digits(tmp_path: Path, name: str, slow: bool, out: io.StringIO | None = None) -> Driver:
    extra = f", write_delay_s: 1.0, marks: {tmp_path / name / 'marks'}" if slow else ""
    fn = "fns:digits_slow_writes" if slow else "train_fn.digits:train"
    return Driver(load_spec_text(DIGITS.format(name=name, fn=fn, extra=extra, storage=tmp_path / "runs")),
                  can_grow=False, out=out)


def _is_writer(pid: int) -> bool:
    try:
        return "raylaunch_ckptwriter" in " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return False


def test_a_rank_killed_during_its_background_write_leaves_that_checkpoint_uncommitted(ray_cluster, tmp_path):
    out = io.StringIO()
    driver = digits(tmp_path, "killed", slow=True, out=out)
    box: dict = {}
    thread = threading.Thread(target=lambda: box.setdefault("result", driver.run()))
    thread.start()
    marks = tmp_path / "killed" / "marks"
    run_dir = tmp_path / "runs" / "killed"
    try:
        # Rank 0's save of step 8 has returned (training goes on) while its files are still being written.
        mark = wait_for(lambda: (marks / "returned-a1-r0-s8").exists() and marks / "returned-a1-r0-s8", 180,
                        "rank 0's save of step 8 to return")
        said = json.loads(mark.read_text())
        assert said["written"] is False  # save returned before this rank's files were on storage
        # A process of the rank's own writes them, at the lowest CPU priority (the training thread's Python is never
        # held by a serialisation).
        assert said["writer"] and said["writer"] != said["pid"] and said["writer_nice"] == 19

        # Its save of step 8 waited for its write of step 4, whose commit follows within a poll or two,
        # while step 8's own write (a second a file) goes on.
        wait_for(lambda: committed_step(run_dir) is not None, 30, "the commit of step 4")
        assert committed_step(run_dir) == 4  # step 8 not committed: its write still runs
        os.kill(said["pid"], signal.SIGKILL)
        # The uninterrupted run, the reference for the weights, runs beside the second attempt (the shared
        # cluster holds both: each takes one CPU a node), whose saves mostly wait on the slow storage; after
        # the kill, so that nothing else competes with the first attempt while the test times it.
        reference = digits(tmp_path, "straight", slow=False).run()
    finally:
        thread.join(300)
    assert reference.status == "succeeded", reference.error
    result = box["result"]
    assert result.status == "succeeded", result.error
    assert result.attempts == 2 and result.restarts == 1
    log = out.getvalue()
    # step 4's commit, or its snapshot in memory (the same state, read at once: ``Driver._snapshot_plan``)
    assert re.search(r"attempt 2: resuming from (\S+checkpoint-00000004 \(step 4\)|the snapshot of step 4 in memory)",
                     log), log[-2000:]
    assert result.rank_results["0"]["restored_step"] == 4  # the half-written step 8 was never loaded
    assert not _is_writer(said["writer"])  # the killed rank's writer went with it
    assert result.rank_results["0"]["weights"] == reference.rank_results["0"]["weights"]  # bitwise
    # every checkpoint says how long it held training and how long until it was committed
    shown = format_show(str(tmp_path / "runs"), "killed")
    assert "step 16" in shown and "held " in shown and "committed after" in shown
    rows = [json.loads(l) for l in (tmp_path / "runs" / "killed" / "metrics.jsonl").read_text().splitlines()]
    blocked = [r for r in rows if "checkpoint_blocked_s" in r]
    assert {(r["rank"], r["step"]) for r in blocked if r["attempt"] == 2} == {(0, 8), (1, 8), (0, 12), (1, 12),
                                                                             (0, 16), (1, 16)}
    assert all(r["checkpoint_host_mb"] > 0 for r in blocked)


def test_a_save_asked_for_while_one_is_in_flight_waits_for_it(ray_cluster, tmp_path):
    spec = load_spec_text(f"name: quick\ntrain_fn: fns:two_quick_saves\nscaling: {{num_nodes: 2}}\n"
                          f"config: {{write_delay_s: 1.5, marks: {tmp_path / 'marks'}}}\nstorage: {tmp_path}\n")
    result = Driver(spec, can_grow=False).run()
    assert result.status == "succeeded", result.error
    assert len(result.rank_results) == 2
    for rank, r in result.rank_results.items():
        first, second = r["held_s"]
        assert second >= 1.4 > first, (rank, r)  # the second waited for the first's write: one in flight
        assert json.loads((tmp_path / "marks" / f"returned-a1-r{rank}-s1").read_text())["written"] is False
    run = RunDir(str(tmp_path), "quick")
    assert [c.step for c in run.checkpoints.committed()] == [1, 2]
    rows = [json.loads(l) for l in (tmp_path / "quick" / "metrics.jsonl").read_text().splitlines()]
    host = {(r["rank"], r["step"]): r["checkpoint_host_mb"] for r in rows if "checkpoint_host_mb" in r}
    assert sorted(host) == [(0, 1), (0, 2), (1, 1), (1, 2)]
    # one copy of the state at a time: the same size for both saves, never the sum of two
    assert host[(0, 1)] == host[(0, 2)] > 0


def test_async_false_writes_before_the_save_returns(ray_cluster, tmp_path):
    spec = load_spec_text(f"name: sync\ntrain_fn: fns:two_quick_saves\nscaling: {{num_nodes: 2}}\n"
                          f"config: {{write_delay_s: 0.0, marks: {tmp_path / 'marks'}}}\ncheckpoint: {{async: false}}\n"
                          f"storage: {tmp_path}\n")
    result = Driver(spec, can_grow=False).run()
    assert result.status == "succeeded", result.error
    for rank in (0, 1):
        assert json.loads((tmp_path / "marks" / f"returned-a1-r{rank}-s1").read_text())["written"] is True
    assert [c.step for c in RunDir(str(tmp_path), "sync").checkpoints.committed()] == [1, 2]


def test_a_symlinked_checkpoint_or_an_empty_manifest_is_never_counted(tmp_path, capsys):
    run = RunDir(str(tmp_path), "odd")
    run.prepare({"name": "odd"})
    checkpoints = tmp_path / "odd" / "checkpoints"
    staged = Path(run.staging_uri(1)) / "checkpoint-00000002"
    staged.mkdir(parents=True)
    (staged / "random_states_0.pkl").write_bytes(b"x")
    run.checkpoints.commit(str(staged), 2, 1, 1, keep=5)  # a real commit
    elsewhere = tmp_path / "elsewhere" / "checkpoint-00000009"
    elsewhere.mkdir(parents=True)
    (elsewhere / "manifest.json").write_text(json.dumps({"step": 9, "files": {"x": {"size": 1, "sha256": "0"}}}))
    (checkpoints / "checkpoint-00000009").symlink_to(elsewhere)
    empty = checkpoints / "checkpoint-00000007"
    empty.mkdir()
    (empty / "manifest.json").write_text(json.dumps({"step": 7, "files": {}}))
    assert [c.step for c in run.checkpoints.committed()] == [2]
    err = capsys.readouterr().err
    assert "checkpoint-00000009 is a symbolic link, not a folder this run committed; that checkpoint is ignored" in err
    assert "checkpoint-00000007/manifest.json lists no files; that checkpoint is ignored" in err
    assert run.checkpoints.loadable().step == 2
    shown = format_show(str(tmp_path), "odd")
    assert "checkpoints (1 committed)" in shown and "step 2" in shown
    staged3 = Path(run.staging_uri(1)) / "checkpoint-00000003"
    staged3.mkdir(parents=True)
    (staged3 / "random_states_0.pkl").write_bytes(b"y")
    run.checkpoints.commit(str(staged3), 3, 1, 1, keep=1)  # keep 1: prunes what it committed, nothing else
    assert [c.step for c in run.checkpoints.committed()] == [3]
    assert elsewhere.is_dir() and empty.is_dir()


def test_a_checkpoint_of_a_lower_step_committed_last_is_the_latest_and_never_pruned(tmp_path):
    """A script may save step_10 after a step 20 was committed (its folder names count something else)."""
    run = RunDir(str(tmp_path), "lower")
    run.prepare({"name": "lower"})
    for step in (10, 20, 5):
        staged = Path(run.staging_uri(1)) / f"checkpoint-{step:08d}"
        staged.mkdir(parents=True)
        (staged / "random_states_0.pkl").write_bytes(str(step).encode())
        run.checkpoints.commit(str(staged), step, 1, 1, keep=2)
    assert run.checkpoints.latest().step == 5
    assert [c.step for c in run.checkpoints.committed()] == [5, 20]  # keep 2: the latest and the newest other
    assert run.checkpoints.loadable().step == 5


def test_dcp_files_captured_in_memory_are_the_bytes_dcp_writes_and_load_back(tmp_path):
    """FSDP's sharded state: DCP's save (its collectives) runs in the capture, its files only in memory; written
    later, each rank's shard file equals a direct save's and the checkpoint loads the state as it was saved."""
    import torch.multiprocessing as mp

    from conftest import free_ports
    from fns import dcp_captured

    mp.spawn(dcp_captured, args=(2, free_ports(1)[0], str(tmp_path)), nprocs=2)
    assert sorted(p.name for p in (tmp_path / "held").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]


def test_a_rank_whose_background_write_fails_removes_only_its_own_files_from_shared_staging(tmp_path):
    """On a shared path every rank writes into one staging folder: a rank whose write fails removes the files it
    wrote, never the folder (another rank, still writing or hashing there, would fail on a file gone from under
    it, and its error would hide the first)."""
    import pytest
    import torch

    from cluster.checkpoint.snapshot import capture
    from cluster.checkpoint.staged import CheckpointSaveError, _Write

    folder = tmp_path / "staging" / "checkpoint-00000004"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"rank 0's weights")  # another rank's part, already written
    (folder / "blocked").write_text("")  # where this rank needs a folder: its second file cannot be written

    def save() -> None:
        torch.save({"rng": torch.arange(4)}, folder / "random_states_1.pkl")
        torch.save({"state": torch.ones(3)}, folder / "blocked" / "optimizer_1.bin")

    reported = []
    write = _Write(capture(save), str(folder), None, 4, mirror=None, on_done=reported.append)
    with pytest.raises(CheckpointSaveError, match="checkpoint of step 4"):
        write.wait()
    assert reported == []  # never reported: the driver does not commit it
    assert sorted(p.name for p in folder.iterdir()) == ["blocked", "model.safetensors"]
    assert (folder / "model.safetensors").read_bytes() == b"rank 0's weights"
