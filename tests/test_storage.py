"""The run directory's commit protocol, on a real local filesystem (no processes)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from jobs.run.storage import CheckpointError, RunDir, StorageError


def stage(run: RunDir, attempt: int, step: int, ranks: list[int]) -> str:
    path = Path(run.staging_uri(attempt)) / f"checkpoint-{step:08d}"
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"weights %d" % step)
    for r in ranks:
        (path / f"random_states_{r}.pkl").write_bytes(b"rng %d" % r)
    return str(path)


def test_commit_writes_manifest_moves_in_then_points_latest(tmp_path):
    run = RunDir(str(tmp_path), "r")
    run.prepare({"name": "r"})
    c = run.checkpoints.commit(stage(run, 1, 5, [0, 1]), 5, 1, world_size=2, keep=2)
    manifest = json.loads((Path(c.uri) / "manifest.json").read_text())
    assert manifest["step"] == 5 and manifest["files"]["model.safetensors"]["size"] == len(b"weights 5")
    assert len(manifest["files"]["random_states_1.pkl"]["sha256"]) == 64
    assert run.checkpoints.latest().step == 5


def test_a_missing_rank_part_is_never_committed(tmp_path):
    run = RunDir(str(tmp_path), "r")
    run.prepare({"name": "r"})
    run.checkpoints.commit(stage(run, 1, 5, [0, 1]), 5, 1, world_size=2, keep=2)
    with pytest.raises(CheckpointError, match=r"lacks the part of ranks \[1\]"):
        run.checkpoints.commit(stage(run, 1, 10, [0]), 10, 1, world_size=2, keep=2)
    assert [c.step for c in run.checkpoints.committed()] == [5]
    assert run.checkpoints.latest().step == 5
    # the next start clears the staging folder a crash left behind
    run.prepare({"name": "r"})
    assert not list((tmp_path / "r" / ".staging").iterdir())


def test_keep_one_always_leaves_the_latest(tmp_path):
    run = RunDir(str(tmp_path), "r")
    run.prepare({"name": "r"})
    for step in (1, 2, 3):
        run.checkpoints.commit(stage(run, 1, step, [0]), step, 1, world_size=1, keep=1)
        assert [c.step for c in run.checkpoints.committed()] == [step]
        assert run.checkpoints.latest().step == step


@pytest.mark.parametrize("older", [True, False])
def test_a_driver_killed_while_it_commits_a_step_again_leaves_a_run_that_resumes(tmp_path, monkeypatch, older):
    """A later attempt commits step 10 again (its own state of that step): the old folder goes before the new one
    moves in. A driver killed between the two (writing the new manifest, here) leaves latest.json naming a checkpoint that is
    there (the one before, or none), never the folder just deleted."""
    run = RunDir(str(tmp_path), "r")
    run.prepare({"name": "r"})
    if older:
        run.checkpoints.commit(stage(run, 1, 5, [0]), 5, 1, world_size=1, keep=3)
    run.checkpoints.commit(stage(run, 1, 10, [0]), 10, 1, world_size=1, keep=3)

    write = run.files.write

    def killed(path: str, data: bytes) -> None:  # the new checkpoint's manifest: after the old folder went
        if path.endswith("manifest.json"):
            raise KeyboardInterrupt("the driver was killed here")
        write(path, data)

    monkeypatch.setattr(run.files, "write", killed)
    with pytest.raises(KeyboardInterrupt):
        run.checkpoints.commit(stage(run, 2, 10, [0]), 10, 2, world_size=1, keep=3)
    monkeypatch.undo()
    again = RunDir(str(tmp_path), "r")  # the rerun
    assert again.checkpoints.loadable() == (again.checkpoints.committed()[-1] if older else None)
    assert [c.step for c in again.checkpoints.committed()] == ([5] if older else [])
    again.checkpoints.commit(stage(again, 3, 10, [0]), 10, 3, world_size=1, keep=3)
    assert again.checkpoints.loadable().step == 10


def test_a_latest_pointer_to_a_missing_checkpoint_is_an_error(tmp_path):
    run = RunDir(str(tmp_path), "r")
    run.prepare({"name": "r"})
    c = run.checkpoints.commit(stage(run, 1, 7, [0]), 7, 1, world_size=1, keep=2)
    shutil.rmtree(c.uri)
    with pytest.raises(CheckpointError, match="names checkpoint-00000007, which is not a committed checkpoint.*--fresh"):
        run.checkpoints.latest()


def test_unwritable_storage_says_what_to_set(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(StorageError, match=r"cannot write the run directory .*Set `storage`"):
        RunDir(str(tmp_path / "file"), "r").prepare({})


def test_a_tampered_or_truncated_file_is_refused_and_the_previous_checkpoint_used(tmp_path):
    run = RunDir(str(tmp_path), "r")
    run.prepare({"name": "r"})
    run.checkpoints.commit(stage(run, 1, 5, [0]), 5, 1, world_size=1, keep=3)
    newest = run.checkpoints.commit(stage(run, 1, 10, [0]), 10, 1, world_size=1, keep=3)
    (Path(newest.uri) / "model.safetensors").write_bytes(b"weights 99")  # same size, other bytes
    said = []
    run = RunDir(str(tmp_path), "r")  # the next run's driver: it reads every file it did not commit itself
    assert run.checkpoints.loadable(warn=said.append).step == 5
    assert "model.safetensors does not match the checksum in its manifest" in said[0]
    (Path(newest.uri) / "model.safetensors").write_bytes(b"weights 10")  # restored
    (Path(newest.uri) / "random_states_0.pkl").write_bytes(b"rn")  # truncated
    with pytest.raises(CheckpointError, match="random_states_0.pkl has 2 bytes; its manifest says 5"):
        run.checkpoints.verify(newest)


def two_checkpoints(tmp_path):
    run = RunDir(str(tmp_path), "r")
    run.prepare({"name": "r"})
    run.checkpoints.commit(stage(run, 1, 5, [0]), 5, 1, world_size=1, keep=3)
    return run, run.checkpoints.commit(stage(run, 1, 10, [0]), 10, 1, world_size=1, keep=3)


@pytest.mark.parametrize("damage, said", [
    (lambda c: (c / "extra.pkl").write_bytes(b"unpickle me"), "extra.pkl is not listed in its manifest"),
    (lambda c: (c / "optimizer.bin").symlink_to("/etc/hostname"), "optimizer.bin is a symbolic link"),
    (lambda c: ((c / "model.safetensors").unlink(), (c / "model.safetensors").symlink_to(c.parent / "elsewhere")),
     "model.safetensors is a symbolic link"),
    (lambda c: (c / "manifest.json").write_text(json.dumps(
        {**json.loads((c / "manifest.json").read_text()), "files": {"../../spec.yaml": {"size": 1, "sha256": "0"}}})),
     "lists '../../spec.yaml', a path leading out of the checkpoint"),
    (lambda c: (c / "manifest.json").write_text(json.dumps({"step": 10, "files": ["model.safetensors"]})),
     "manifest.json is malformed"),
])
def test_a_checkpoint_holds_exactly_its_manifest_files(tmp_path, damage, said):
    run, newest = two_checkpoints(tmp_path)
    (Path(newest.uri).parent / "elsewhere").write_bytes(b"weights 10")
    damage(Path(newest.uri))
    warned = []
    assert run.checkpoints.loadable(warn=warned.append).step == 5  # the previous one, with the reason
    assert said in warned[0], warned


def test_the_checkpoint_folder_itself_may_not_be_a_link(tmp_path):
    run, newest = two_checkpoints(tmp_path)
    real = tmp_path / "real-10"
    shutil.move(newest.uri, real)
    Path(newest.uri).symlink_to(real)
    with pytest.raises(CheckpointError, match="checkpoint-00000010 is a symbolic link"):
        run.checkpoints.verify(newest)


def test_corrupted_manifest_latest_and_metrics_lines_fall_back_with_a_warning(tmp_path, capsys):
    run, newest = two_checkpoints(tmp_path)
    (Path(newest.uri) / "manifest.json").write_text('{"step": 10, "fil')  # torn
    assert [c.step for c in run.checkpoints.committed()] == [5]
    assert "checkpoint-00000010/manifest.json cannot be read; that checkpoint is skipped" in capsys.readouterr().err
    (tmp_path / "r" / "checkpoints" / "latest.json").write_text("\x00garbage")
    assert run.checkpoints.latest().step == 5
    assert "latest.json cannot be read" in capsys.readouterr().err
    (tmp_path / "r" / "metrics.jsonl").write_text('{"step": 1, "rank": 0, "loss": 1.0}\n{"step": 2, "ra\n[1, 2]\n'
                                                  '{"step": 3, "rank": 0, "loss": 0.5}\n')
    assert [r["step"] for r in run.read_metrics()] == [1, 3]
    assert "2 line(s) of" in capsys.readouterr().err
    (tmp_path / "r" / "result.json").write_text("{not json")
    assert run.read_result() is None


@pytest.fixture
def tiny_disk(tmp_path):
    """A 1 MiB tmpfs (root only), filled to the last page by ``fill``; unmounted after."""
    from bench.chaos import mount_small_disk

    disk = tmp_path / "disk"
    if not mount_small_disk(disk, "1m"):
        pytest.skip("cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN)")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)  # lazily: a failed test may hold a file open


def _fill(disk: Path, leave: int = 0) -> Path:
    """Fill ``disk`` until a write fails, then free ``leave`` bytes."""
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
        except OSError:
            pass
    if leave:
        with open(filler, "r+b") as f:
            f.truncate(max(0, filler.stat().st_size - leave))
    return filler


def test_metrics_a_full_disk_refused_are_written_once_there_is_space(tiny_disk, capsys):
    """Found by `make chaos` (seed 3): an append cut short by a full disk left half a row, and the first row
    written once there was space again was glued to it: both lost. Then CI (a rank killed, then the disk full
    during the recovery): the refused row itself was lost, one rank's samples of a step missing from the run's
    record. Now the refused rows wait for space, and no half row is left behind."""
    run = RunDir(str(tiny_disk), "r")
    run.prepare({"name": "r"})
    run.append_metrics([{"step": 1, "loss": 1.0}])
    filler = _fill(tiny_disk, leave=4096)
    with pytest.raises(OSError):
        run.append_metrics([{"step": 2, "text": "x" * 20_000}])  # part of it fits: cut back, held
    with pytest.raises(OSError):
        run.append_metrics([{"step": 3, "loss": 0.75}])  # still full: held behind step 2
    filler.unlink()
    run.append_metrics([{"step": 4, "loss": 0.5}])
    run.close()
    assert [r["step"] for r in RunDir(str(tiny_disk), "r").read_metrics()] == [1, 2, 3, 4]
    assert "cannot be read" not in capsys.readouterr().err


def test_rows_held_for_a_full_disk_are_bounded_and_the_loss_is_said(tiny_disk, monkeypatch, capsys):
    """A disk full for hours must not grow the driver's memory without end: past the bound the oldest held
    rows go, whole, and the run's output says how many."""
    monkeypatch.setattr("jobs.run.appendlog.BACKLOG_BYTES", 1000)
    run = RunDir(str(tiny_disk), "r")
    run.prepare({"name": "r"})
    filler = _fill(tiny_disk)
    for step in range(1, 101):  # 100 rows of about 40 bytes: about 25 of them fit the bound
        with pytest.raises(OSError):
            run.append_metrics([{"step": step, "loss": 0.123456}])
    filler.unlink()
    run.append_metrics([{"step": 101, "loss": 0.1}])
    run.close()
    steps = [r["step"] for r in RunDir(str(tiny_disk), "r").read_metrics()]
    assert steps == list(range(steps[0], 102)) and 10 < len(steps) < 40, steps
    said = capsys.readouterr().err
    assert f"raylaunch: {steps[0] - 1} line(s) of" in said and "were lost while the disk was full" in said, said


def test_more_rank_logs_than_files_held_open_lose_no_line(tmp_path, monkeypatch):
    """A driver of thousands of ranks keeps at most half of its open-file limit open: the least recently written
    log is closed for room and opened again when its rank next prints; every line lands, in order."""
    import os

    monkeypatch.setattr("jobs.run.appendlog._open_files_cap", lambda: 3)
    run = RunDir(str(tmp_path), "r")
    run.prepare({"name": "r"})
    for line in range(4):
        for rank in range(6):
            run.append_log(rank, [f"rank {rank} line {line}"])
        run.append_metrics([{"step": line, "loss": 1.0}])
        assert len(run._logs._streams) <= 3
    run.close()
    logs = sorted(os.listdir(tmp_path / "r" / "logs"))
    assert len(logs) == 6
    for rank in range(6):
        text = (tmp_path / "r" / "logs" / f"rank-{rank}.log").read_text()
        assert text.splitlines() == [f"rank {rank} line {line}" for line in range(4)]
    assert [r["step"] for r in RunDir(str(tmp_path), "r").read_metrics()] == [0, 1, 2, 3]


def test_tensorboard_files_that_cannot_be_written_never_fail_the_run(tiny_disk, capsys):
    """Found by `make chaos` (seed 3): the driver's TensorBoard flush raised ENOSPC, failed the run, and its close
    then kept the final result.json from being written."""
    from cluster.metric_rows import RowBatch
    from jobs.run.board import Board

    run = RunDir(str(tiny_disk), "r")
    run.prepare({"name": "r"})
    board = Board(run)
    board.start_attempt(None)
    filler = _fill(tiny_disk)
    for step in range(1, 200):
        board.add(RowBatch.of([{"step": step, "rank": 0, "time": float(step), "loss": 1.0 / step, "text": "y" * 100}]))
    board.flush()
    board.goodput({"ratio": 0.5, "seconds": {"training": 1.0}}, 199)
    board.close()  # none of these raises
    filler.unlink()
    run.write_result({"status": "failed"})  # and the result is written once there is space
    assert json.loads((tiny_disk / "r" / "result.json").read_text()) == {"status": "failed"}
    said = capsys.readouterr().err
    assert said.count("raylaunch: TensorBoard files could not be written") == 1, said


def test_a_commit_meeting_a_full_disk_is_tried_again_until_there_is_space(tiny_disk, monkeypatch, capsys):
    """Found by `make chaos` (seed 7, the elastic job: the disk full for some seconds during a commit): the driver's
    commit met ENOSPC writing the manifest and ended the run failed, a run of hours lost to seconds of a full disk.
    A commit meeting a full disk is tried again for up to a minute (said once), commits once there is space, and
    leaves no half-written file; a disk that stays full fails it naming what to do."""
    import threading
    import time

    run = RunDir(str(tiny_disk), "r")
    run.prepare({"name": "r"})
    run.checkpoints.commit(stage(run, 1, 5, [0, 1]), 5, 1, world_size=2, keep=2)
    uri = stage(run, 1, 10, [0, 1])
    filler = _fill(tiny_disk)
    freed = threading.Timer(3.0, filler.unlink)
    freed.start()
    began = time.monotonic()
    try:
        c = run.checkpoints.commit(uri, 10, 1, world_size=2, keep=2)
    finally:
        freed.join()
    assert c.step == 10 and time.monotonic() - began >= 2.5
    assert run.checkpoints.loadable().step == 10 and [k.step for k in run.checkpoints.committed()] == [5, 10]
    said = capsys.readouterr().err
    assert said.count("committing the checkpoint of step 10 failed (no space left on the device)") == 1, said
    assert not [p for p in tiny_disk.rglob("*") if ".tmp-" in p.name], "a half-written manifest or pointer was left"

    monkeypatch.setattr("jobs.run.checkpoints.COMMIT_RETRY_S", 2.0)  # a disk that stays full
    uri = stage(run, 1, 15, [0, 1])
    _fill(tiny_disk)
    with pytest.raises(CheckpointError) as failed:
        run.checkpoints.commit(uri, 15, 1, world_size=2, keep=2)
    assert "could not commit the checkpoint of step 15" in str(failed.value)
    assert "The previous committed checkpoint is still the latest. Free space on the storage's device" in \
        str(failed.value)
    assert run.checkpoints.loadable().step == 10
    assert not [p for p in tiny_disk.rglob("*") if ".tmp-" in p.name]


def test_a_restart_reads_again_only_what_it_did_not_commit_or_what_changed_since(tmp_path, monkeypatch):
    """A restart in the same run does not read every byte of the checkpoint it just committed (its ranks read and
    check them as they load it); a file listed otherwise than at the commit is read, and after ``forget`` (an
    attempt that failed before it trained: its ranks may have refused a file) every file is."""
    import os

    import cluster.storage_io as storage_io

    run, newest = two_checkpoints(tmp_path)
    read = []
    real = storage_io.checksum
    monkeypatch.setattr(storage_io, "checksum", lambda fs, path, kind: (read.append(Path(path).name),
                                                                        real(fs, path, kind))[1])
    assert run.checkpoints.loadable().step == 10 and read == []  # committed here, listed as committed: not read
    weights = Path(newest.uri) / "model.safetensors"
    stat = weights.stat()
    weights.write_bytes(b"weights 99")  # same size, other bytes, and its time put back: as bit rot would leave it
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert run.checkpoints.loadable().step == 10 and read == []  # (the ranks' own check refuses it: below)
    run.checkpoints.forget()
    said = []
    assert run.checkpoints.loadable(warn=said.append).step == 5 and "model.safetensors" in read
    assert "model.safetensors does not match the checksum in its manifest" in said[0]
    weights.write_bytes(b"weights 10")  # put right, at a new time: read once, then known again
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    read.clear()
    assert run.checkpoints.loadable().step == 10 and sorted(read) == ["model.safetensors", "random_states_0.pkl"]
    read.clear()
    assert run.checkpoints.loadable().step == 10 and read == []
    (Path(newest.uri) / "random_states_0.pkl").write_bytes(b"rn")  # truncated: found without reading it
    with pytest.raises(CheckpointError, match="random_states_0.pkl has 2 bytes"):
        run.checkpoints.verify(newest, hashes=False)
