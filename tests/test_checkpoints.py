"""Checkpoints that lose nothing: a full disk, a crash mid-save, a tampered file, pickles.

The runs use the shared multi-node Ray cluster; the rank-side checks run a rank's
session in this process, as the worker entry point would.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from cluster.context import assign_ranks
from cluster.runtime import CheckpointError, Session, WorkerPayload
from jobs.driver import Driver
from jobs.spec import load_spec_text
from jobs.storage import RunDir

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs, mounted for this test and unmounted after it."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_fails_the_save_and_keeps_the_previous_checkpoint(ray_cluster, tmp_path, small_disk):
    # A model of 300k parameters: one checkpoint (1.2 MB) fits on the 2 MiB disk, a second does not.
    spec = load_spec_text(f"""
name: full
train_fn: fns:steady
config: {{steps: 30, every: 10, step_s: 0.02, hidden: 30000, lr: 1.0e-4, pid_dir: {tmp_path / 'pids'}}}
scaling: {{num_nodes: 2, workers_per_node: 1}}
failure: {{max_restarts: 0}}
checkpoint: {{keep: 1}}
storage: {small_disk}
""")
    result = Driver(spec, can_grow=False).run()
    assert result.status == "failed"
    staged = small_disk / "full" / ".staging" / "attempt-1" / "checkpoint-00000020"
    assert re.search(rf"CheckpointSaveError: no space left on the device holding {re.escape(str(staged))}: "
                     "the checkpoint of step 20 was not written", result.error), result.error
    assert "The previous committed checkpoint is kept" in result.error
    checkpoints = small_disk / "full" / "checkpoints"
    assert json.loads((checkpoints / "latest.json").read_text()) == {"name": "checkpoint-00000010", "step": 10}
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint-00000010", "latest.json"]
    run = RunDir(str(small_disk), "full")
    assert run.loadable_checkpoint().step == 10  # every file matches its manifest
    manifest = json.loads((checkpoints / "checkpoint-00000010" / "manifest.json").read_text())
    assert "model.safetensors" in manifest["files"] and not any(f.startswith("pytorch_model") for f in manifest["files"])
    # the half-written part is gone, and the result could be written
    assert not any((small_disk / "full" / ".staging").rglob("*"))
    assert json.loads((small_disk / "full" / "result.json").read_text())["status"] == "failed"


def test_the_next_attempt_clears_what_a_crash_left_in_staging(ray_cluster, tmp_path):
    spec = load_spec_text(f"name: litter\ntrain_fn: fns:litter_then_fail\nscaling: {{num_nodes: 2}}\n"
                          f"failure: {{max_restarts: 1}}\nstorage: {tmp_path}\n")
    result = Driver(spec, can_grow=False).run()
    assert result.status == "succeeded" and result.attempts == 2, result.error
    assert result.rank_results["0"]["earlier_staging_left"] is False
    assert result.rank_results["1"]["earlier_staging_left"] is False
    assert not (tmp_path / "litter" / "checkpoints" / "latest.json").exists()  # nothing was ever committed


class _LoadsRecorded:
    """Stands in for an Accelerator: records what it was asked to load."""

    def __init__(self) -> None:
        self.loaded: list[str] = []

    def load_state(self, path: str) -> None:
        self.loaded.append(path)


def _committed(tmp_path: Path, name: str):
    run = RunDir(str(tmp_path), name)
    run.prepare({"name": name})
    staged = Path(run.staging_uri(1)) / "checkpoint-00000005"
    staged.mkdir(parents=True)
    (staged / "model.safetensors").write_bytes(b"weights")
    (staged / "random_states_0.pkl").write_bytes(b"rng 0")
    return run, run.commit_checkpoint(str(staged), 5, 1, world_size=1, keep=2)


def _rank_session(tmp_path: Path, run: RunDir, restore_uri: str) -> Session:
    payload = WorkerPayload(context=assign_ranks([1])[0], attempt=2, train_fn="fns:steady", config={},
                            events_path=str(tmp_path / "events" / "rank-0.jsonl"),
                            staging_uri=run.staging_uri(2), restore_uri=restore_uri, backend="gloo",
                            rendezvous_timeout_s=10)
    return Session(payload)


def test_a_rank_loads_nothing_from_a_file_altered_after_the_driver_checked_it(tmp_path):
    run, c = _committed(tmp_path, "r")
    run.verify(c)  # what the driver checked before it started the attempt
    accelerator = _LoadsRecorded()
    assert _rank_session(tmp_path, run, c.uri).restore(accelerator) == 5
    assert accelerator.loaded == [c.uri]
    (Path(c.uri) / "random_states_0.pkl").write_bytes(b"rng 9")  # a pickle swapped in afterwards
    with pytest.raises(CheckpointError, match=r"checkpoint-00000005/random_states_0.pkl does not match the checksum"):
        _rank_session(tmp_path, run, c.uri).restore(accelerator)
    assert accelerator.loaded == [c.uri]  # nothing unpickled from it


def test_a_rank_refuses_a_checkpoint_of_another_run(tmp_path):
    run, _ = _committed(tmp_path, "mine")
    _, theirs = _committed(tmp_path, "theirs")
    with pytest.raises(CheckpointError, match="is not a committed checkpoint of this run"):
        _rank_session(tmp_path, run, theirs.uri).restore(_LoadsRecorded())


def test_every_torch_load_in_our_code_is_weights_only():
    calls = []
    for folder in ("cluster", "jobs", "train_fn", "bench"):
        for path in (ROOT / folder).rglob("*.py"):
            for match in re.finditer(r"torch\.load\((.*)\)", path.read_text()):
                calls.append((path.name, match.group(1)))
    assert all("weights_only=True" in args for _, args in calls), calls
