"""A save holds training for its call only: what only an optimizer step changes (the prepared model's parameters, the
optimizer's state) is copied after ``save`` returns, by the thread that writes, beside the next forward and backward;
the next optimizer step waits for that copy, and the wait counts in the save's hold. A tensor changed in place
before its copy was made is found (its version counter) and that checkpoint is not written."""

from __future__ import annotations

import hashlib
import threading
import time
import zipfile

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from safetensors.torch import load_file

import cluster.checkpoint.snapshot as snapshot_module
from cluster.checkpoint.staged import StagedCheckpoints
from cluster.checksums import SNAPSHOT_CHECKSUM
from conftest import wait_for
from cluster.context import WorkerContext
from cluster.layout import checkpoint_name

COPY_DELAY_S = 1.0  # the deferred copies start this late: the next step comes first, and must wait


@pytest.fixture
def slow_copies(monkeypatch):
    copy = snapshot_module.Snapshot.copy_deferred

    def late(self):
        if self.deferred:
            time.sleep(COPY_DELAY_S)
        return copy(self)

    monkeypatch.setattr(snapshot_module.Snapshot, "copy_deferred", late)


@pytest.fixture
def trained(tmp_path, monkeypatch):
    # this model's state (about 400 KB) is below the size whose copies are deferred: deferred here all the same
    monkeypatch.setattr("cluster.checkpoint.staged.DEFER_FROM_BYTES", 0)
    AcceleratorState._reset_state(True)
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    rows, reports = [], []
    ctx = WorkerContext(world_rank=0, local_rank=0, node_rank=0, world_size=1, local_world_size=1, num_nodes=1)
    checkpoints = StagedCheckpoints(str(tmp_path / "staging"), None, lambda *a, **k: reports.append((a, k)),
                                    context=ctx, node_dir=str(tmp_path), background=True,
                                    log=lambda row, step: rows.append((step, row)))

    def step():
        accelerator.backward(model(torch.randn(8, 64)).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()

    step()
    yield accelerator, model, optimizer, checkpoints, step, rows, reports
    checkpoints.wait_for_upload()
    checkpoints._writer.close()
    AcceleratorState._reset_state(True)


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_the_next_step_waits_for_the_copies_and_the_checkpoint_holds_the_state_at_the_save(trained, tmp_path,
                                                                                          slow_copies):
    accelerator, model, optimizer, checkpoints, step, rows, reports = trained
    at_save = weights(model)
    moments = {k: v.clone() for k, v in optimizer.state_dict()["state"][0].items()}
    began = time.perf_counter()
    checkpoints.save(accelerator, 1)
    assert time.perf_counter() - began < COPY_DELAY_S  # the call returned before the copies were made
    assert rows == []  # its hold is not known yet
    step()  # waits for the copies, then changes every parameter
    assert rows and rows[0][0] == 1 and rows[0][1]["checkpoint_blocked_s"] >= COPY_DELAY_S * 0.5, rows
    checkpoints.wait_for_upload()
    folder = tmp_path / "staging" / checkpoint_name(1)
    saved = load_file(folder / "model.safetensors")
    assert saved.keys() == at_save.keys()
    assert all(torch.equal(saved[k], at_save[k]) for k in at_save)  # bitwise the state when save was called
    assert not torch.equal(weights(model)["0.weight"], at_save["0.weight"])  # and the step did change it after
    saved_moments = torch.load(folder / "optimizer.bin", weights_only=True)["state"][0]
    assert all(torch.equal(saved_moments[k], moments[k]) for k in moments)
    [(args, kwargs)] = reports
    assert args[0] == 1 and kwargs["blocked_s"] >= COPY_DELAY_S * 0.5  # the driver hears the same hold


def test_a_parameter_changed_in_place_before_its_copy_skips_that_checkpoint_and_says_so(trained, tmp_path,
                                                                                        slow_copies, capfd):
    accelerator, model, optimizer, checkpoints, step, rows, reports = trained
    checkpoints.save(accelerator, 1)
    with torch.no_grad():
        model[0].weight.clamp_(-0.01, 0.01)  # between the save and the next step, before the copy
    step()
    checkpoints.wait_for_upload()
    assert reports == []  # never reported: no commit of step 1
    assert not (tmp_path / "staging" / checkpoint_name(1) / "model.safetensors").exists()
    err = capfd.readouterr().err
    assert ("raylaunch: rank 0: the checkpoint of step 1 is not saved: a parameter or optimizer state in "
            "model.safetensors changed in place after session.save returned") in err, err
    assert checkpoints.defer_copies is False
    at_save = weights(model)
    checkpoints.save(accelerator, 2)  # copies everything before it returns from now on
    with torch.no_grad():
        model[0].weight.mul_(2)
    checkpoints.wait_for_upload()
    saved = load_file(tmp_path / "staging" / checkpoint_name(2) / "model.safetensors")
    assert all(torch.equal(saved[k], at_save[k]) for k in at_save)
    assert [a[0] for a, _ in reports] == [2]


def test_a_save_while_a_snapshot_is_being_written_keeps_that_snapshot_and_never_waits_for_it(trained, tmp_path,
                                                                                           monkeypatch):
    """A commit's save never waits behind a snapshot's write: it returns at once, and its own write starts once the
    snapshot's has ended. The snapshot, whose files the writer was writing (it cannot stop within a request), is kept
    and reported: until the save is committed it is the newest state a restart can read (it was written whole, then
    removed)."""
    accelerator, model, optimizer, checkpoints, step, rows, reports = trained
    release, order = threading.Event(), []
    write = snapshot_module.Snapshot.write

    def held_up(self, writer=None, hash_files=False, durable=False, **kw):
        if hash_files == SNAPSHOT_CHECKSUM:  # the snapshot's (a save's files are sha256)
            order.append("snapshot writing")
            release.wait(20)  # a save that waited for this would not return before it is released
            order.append("snapshot's write ended")
        return write(self, writer, hash_files, durable, **kw)

    monkeypatch.setattr(snapshot_module.Snapshot, "write", held_up)
    folder, parts = tmp_path / "snap-1", []
    assert checkpoints.hold_in_memory(accelerator, 1, str(folder), lambda *part: parts.append(part))
    wait_for(lambda: order, 20, "the snapshot's write to begin")
    step()
    at_save = weights(model)
    checkpoints.save(accelerator, 2)
    order.append("save returned")
    release.set()
    step()
    checkpoints.wait_for_upload()
    assert order == ["snapshot writing", "save returned", "snapshot's write ended"]
    assert [part[:2] for part in parts] == [(1, str(folder))] and parts[0][2], parts  # kept: reported with its files
    assert all((folder / rel).is_file() for rel in parts[0][2]), parts
    assert [a[0] for a, _ in reports] == [2]
    saved = load_file(tmp_path / "staging" / checkpoint_name(2) / "model.safetensors")
    assert saved.keys() == at_save.keys() and all(torch.equal(saved[k], at_save[k]) for k in at_save)


def test_a_save_before_a_snapshots_write_began_gives_that_snapshot_up(trained, tmp_path, monkeypatch):
    """A snapshot whose write has not begun when a save comes (its copies still being made) is given up: nothing of
    it is written or reported, and the save is written."""
    accelerator, model, optimizer, checkpoints, step, rows, reports = trained
    release, copying = threading.Event(), threading.Event()
    copy = snapshot_module.Snapshot.copy_deferred

    def late(self):
        copying.set()
        release.wait(20)
        return copy(self)

    monkeypatch.setattr(snapshot_module.Snapshot, "copy_deferred", late)
    folder, parts = tmp_path / "snap-1", []
    assert checkpoints.hold_in_memory(accelerator, 1, str(folder), lambda *part: parts.append(part))
    wait_for(copying.is_set, 20, "the snapshot's copies to begin")
    monkeypatch.setattr(snapshot_module.Snapshot, "copy_deferred", copy)
    threading.Timer(0.5, release.set).start()  # the save's next step waits for the snapshot's copies
    checkpoints.save(accelerator, 2)
    step()
    checkpoints.wait_for_upload()
    assert [part[:3] for part in parts] == [(1, str(folder), None)]  # given up: not reported as written
    assert not folder.exists()
    assert [a[0] for a, _ in reports] == [2]


def test_a_snapshot_hands_its_write_to_the_rank_s_lanes_without_starting_a_thread(trained, tmp_path, monkeypatch):
    """A thread started for each write held training for its start (0.3-4.4 ms a snapshot on a loaded 2-core
    machine, more than copying a few hundred KB): the writes run on two long-lived threads instead, in order."""
    accelerator, model, optimizer, checkpoints, step, rows, reports = trained
    parts = []
    assert checkpoints.hold_in_memory(accelerator, 1, str(tmp_path / "snap-1"), lambda *part: parts.append(part))
    checkpoints.wait_for_upload()  # the lanes' threads are running from here on
    started = []
    start = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda self: (started.append(self.name), start(self)))
    for n in (2, 3, 4):
        step()
        assert checkpoints.hold_in_memory(accelerator, n, str(tmp_path / f"snap-{n}"), lambda *part: parts.append(part))
        checkpoints.wait_for_upload()
    assert started == []
    assert [part[0] for part in parts] == [1, 2, 3, 4] and all(part[2] for part in parts)  # each written, in order
    at_4 = load_file(tmp_path / "snap-4" / "model.safetensors")
    assert all(torch.equal(at_4[k], v) for k, v in weights(model).items())


def test_a_small_state_is_copied_during_the_save_and_its_write_starts_at_once(trained, monkeypatch, slow_copies):
    """Below ``DEFER_FROM_BYTES`` nothing waits for the next optimizer step: the save returns with every copy made,
    so its write (a snapshot's, too) is not a step longer in flight (#59)."""
    accelerator, model, optimizer, checkpoints, step, rows, reports = trained
    monkeypatch.setattr("cluster.checkpoint.staged.DEFER_FROM_BYTES", 4 << 20)
    before = weights(model)
    checkpoints.save(accelerator, 2)
    assert checkpoints._copying is None  # no copy left for the next optimizer step
    wait_for(lambda: reports, 30, "the save's report, before any further step")
    saved = load_file(f"{checkpoints.staging_uri}/{checkpoint_name(2)}/model.safetensors")
    assert all(torch.equal(saved[k], v) for k, v in before.items())


@pytest.mark.parametrize("through_writer", [True, False], ids=["writer-process", "rank-thread"])
def test_a_saves_commit_is_copied_from_the_snapshot_beside_it_not_written_again(trained, tmp_path, monkeypatch,
                                                                               through_writer):
    """With a snapshot beside a save (a function's, ``MemorySnapshots.beside_save``), the commit is a copy of that
    snapshot's files made by the kernel, not a second serializing of the state: each committed file is the state at
    its save, bitwise, and so is the snapshot; the sha256 each rank reports is its file's; a committed torch.save
    keeps its zip's CRC-32s. A save asked for meanwhile waits for the whole write (one in flight)."""
    accelerator, model, optimizer, checkpoints, step, rows, reports = trained
    if through_writer:
        assert checkpoints._writer.ensure()
        wait_for(checkpoints._writer.ready, 60, "the checkpoint writer process to start")
    else:
        monkeypatch.setattr(checkpoints._writer, "ready", lambda: False)
    serialized, write = [], snapshot_module.Snapshot.write

    def counted(self, writer=None, hash_files=False, durable=False, **kw):
        serialized.append(hash_files)
        return write(self, writer, hash_files, durable, **kw)

    monkeypatch.setattr(snapshot_module.Snapshot, "write", counted)
    snaps, parts, states = tmp_path / "node", [], {}
    for n in (1, 2):
        states[n] = weights(model)
        checkpoints.save(accelerator, n, beside=(str(snaps / f"snap-{n}"), lambda *part: parts.append(part)))
        step()
    checkpoints.wait_for_upload()
    assert serialized == [SNAPSHOT_CHECKSUM, SNAPSHOT_CHECKSUM]  # the snapshots', written; the commits copied
    assert [a[0] for a, _ in reports] == [1, 2]
    assert [part[0] for part in parts] == [1, 2] and all(part[2] for part in parts), parts
    for n in (1, 2):
        committed = tmp_path / "staging" / checkpoint_name(n)
        for folder in (committed, snaps / f"snap-{n}"):
            saved = load_file(folder / "model.safetensors")
            assert saved.keys() == states[n].keys() and all(torch.equal(saved[k], states[n][k]) for k in saved)
        assert sorted(p.name for p in committed.iterdir()) == sorted(p.name for p in (snaps / f"snap-{n}").iterdir())
        files = reports[n - 1][0][2]
        assert all(meta["sha256"] == hashlib.sha256((committed / rel).read_bytes()).hexdigest()
                   and meta["size"] == (committed / rel).stat().st_size for rel, meta in files.items()), files
        with zipfile.ZipFile(committed / "optimizer.bin") as saved_zip:  # a committed torch.save keeps its CRC-32s
            assert saved_zip.testzip() is None
