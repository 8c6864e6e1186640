"""What a snapshot in memory costs, and how ``auto`` answers it (no processes): the interval grows with the CPU its
background write takes and when a snapshot comes due while the previous one's write is still in flight; a snapshot's
files carry xxh3 (a committed checkpoint's stay sha256), which a restore still verifies."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest
import xxhash
from pyarrow import fs as pafs

from cluster.checkpoint.memory import MemorySnapshots, auto_interval, measured_effect
from cluster.checkpoint.writer import describe_written
from cluster.storage_io import CheckpointError, check_manifest


def snapshots(tmp_path, answers: list[bool], every: int | None = None) -> tuple[MemorySnapshots, list]:
    """A rank's snapshots whose ``save`` answers from ``answers`` (True: taken, its write in flight)."""
    taken: list = []

    def save(accelerator, step, folder, written):
        ok = answers.pop(0)
        if ok:
            taken.append((step, folder, written))
        return ok

    snaps = MemorySnapshots(str(tmp_path), 0, every, 1 << 30, save, say=lambda line: None,
                            report=lambda *a: None)
    snaps.accelerator, snaps.confirmed = object(), True
    return snaps, taken


def test_a_snapshot_due_while_the_previous_write_is_in_flight_is_skipped_and_auto_spaces_them_out(tmp_path):
    snaps, taken = snapshots(tmp_path, [True, False])
    snaps.take(1, lambda: None)
    assert snaps.interval == 1 and len(taken) == 1
    snaps.take(2, lambda: None)  # the first one's write has not ended: skipped
    assert (snaps.skipped, snaps.interval, snaps.next_due(2)) == (1, 2, 4)


def test_a_restarted_rank_starts_from_the_last_attempts_interval(tmp_path):
    """auto began again at one a step after every restart (at 576 MiB a rank, a second's write each step until
    measured); the driver hands the last attempt's interval (``WorkerPayload.snapshot_start``) instead."""
    snaps = MemorySnapshots(str(tmp_path), 0, None, 1 << 30, lambda *a, **k: True, say=lambda line: None,
                            report=lambda *a: None, start=16)
    snaps.accelerator, snaps.confirmed, snaps.base = object(), True, 40  # resumed at step 40
    assert (snaps.interval, snaps.next_due(1)) == (16, 8)  # step 48: the next multiple of 16, as every rank's


def test_a_set_interval_is_kept_when_a_snapshot_is_skipped(tmp_path):
    snaps, taken = snapshots(tmp_path, [True, False], every=4)
    snaps.take(4, lambda: None)
    snaps.take(8, lambda: None)
    assert (snaps.skipped, snaps.interval) == (1, 4)


def test_a_write_given_up_or_failed_is_no_longer_in_flight(tmp_path, monkeypatch):
    clock = Clock()
    monkeypatch.setattr("cluster.checkpoint.memory.time", clock)
    snaps, taken = snapshots(tmp_path, [True, False])
    snaps.take(1, lambda: None)
    step, folder, written = taken[0]
    written(step, folder, None, 0.002)  # given up for a save (or failed): nothing reported, but its cost measured
    clock.now += 0.5
    snaps.take(2, lambda: None)  # a save's write in flight: not a snapshot skipped
    assert (snaps.skipped, snaps.interval) == (0, 1)
    assert [cpu for cpu, _ in snaps._writes] == [0.002]
    assert not (tmp_path / "snap-00000001" / "rank-0.json").exists()


def test_a_skip_keeps_the_interval_up_until_the_write_in_flight_is_measured(tmp_path, monkeypatch):
    clock = Clock()
    monkeypatch.setattr("cluster.checkpoint.memory.time", clock)
    snaps, taken = snapshots(tmp_path, [True, True, True, True, False, True, True])
    for steps in (1, 2, 3, 4):  # a step every 0.5 s; the first three written at once: one a step
        snaps.take(steps, lambda: 0.001)
        if steps < 4:
            step, folder, written = taken[-1]
            Path(folder).mkdir(parents=True, exist_ok=True)
            written(step, folder, {}, 0.001)
        clock.now += 0.5
    snaps.take(5, lambda: 0.001)  # step 4's write goes on: skipped, and the next due at 6
    assert (snaps.skipped, snaps.interval, snaps.next_due(5)) == (1, 2, 6)
    clock.now += 0.5
    snaps.take(6, lambda: 0.001)  # measured again (one a step by its medians), but kept at 2 until step 4's ends
    assert (snaps.interval, len(taken)) == (2, 5)
    step, folder, written = taken[3]
    Path(folder).mkdir(parents=True, exist_ok=True)
    written(step, folder, {}, 0.001)  # step 4's ends: 1.0 s from capture to written
    clock.now += 0.5
    snaps.take(7, lambda: 0.001)
    assert snaps.interval == 1  # measured: one slow write among four is not the median


class Clock:
    """``time`` for ``cluster.checkpoint.memory``: it moves only when told."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now


@pytest.mark.parametrize("cpu_s, write_s, interval", [
    (0.0, 0.1, 1),  # 1 ms held, 0.5 s a step: one a step, by the hold alone
    (0.5, 0.1, 64),  # but 0.5 s of CPU a write: 0.501 / (0.02 x 0.5) = 50.1 steps, up to 64
    (0.0, 3.0, 8),  # a write that takes 3 s (6 steps) from capture to written: the next is due after it
])
def test_auto_counts_the_write_s_cpu_and_its_time_in_flight_beside_the_hold(tmp_path, monkeypatch, cpu_s, write_s,
                                                                             interval):
    clock = Clock()
    monkeypatch.setattr("cluster.checkpoint.memory.time", clock)
    snaps, taken = snapshots(tmp_path, [True] * 4)
    for steps in (1, 2, 3, 4):
        snaps.take(steps, lambda: 0.001)  # (measured from the third snapshot on, each with the previous one's hold)
        step, folder, written = taken[-1]
        Path(folder).mkdir(parents=True, exist_ok=True)
        clock.now += write_s
        written(step, folder, {}, cpu_s)
        clock.now += 0.5 - write_s  # the next step begins 0.5 s after this one
    assert snaps.interval == interval == auto_interval(0.001, 0.5, cpu_s=cpu_s, write_s=write_s)


def first_written(tmp_path, monkeypatch, cpu_s: float, write_s: float, step_s: float):
    """A rank's snapshots under a clock told when to move: the first one taken at step 1, written ``write_s`` after
    its capture with ``cpu_s`` of CPU, and the clock at the next step's end (``step_s`` on)."""
    clock = Clock()
    monkeypatch.setattr("cluster.checkpoint.memory.time", clock)
    snaps, taken = snapshots(tmp_path, [True] * 3)
    snaps.take(1, lambda: 0.001)
    step, folder, written = taken[0]
    Path(folder).mkdir(parents=True, exist_ok=True)
    clock.now += write_s
    written(step, folder, {}, cpu_s)
    clock.now += step_s - write_s
    return snaps, taken, clock


def test_the_first_snapshots_write_sets_the_interval_before_the_next_is_taken(tmp_path, monkeypatch):
    """auto waited for a third snapshot's measure: a run of 240 steps took five where the interval it settled on
    gave three, the first few one step or two apart (#58). The first one's write (its CPU, its time in flight) says
    the interval at the next step due; a step not due at the new one takes none."""
    snaps, taken, clock = first_written(tmp_path, monkeypatch, cpu_s=0.5, write_s=0.1, step_s=0.5)
    assert snaps.next_due(1) == 2
    snaps.take(2, lambda: 0.001)
    assert len(taken) == 1  # not taken at step 2
    assert snaps.interval == 64 == auto_interval(0.0, 0.5, cpu_s=0.5, write_s=0.1)  # 0.5 / (0.02 x 0.5): 50, up to 64
    assert snaps.next_due(2) == 64
    clock.now += 31.0
    snaps.take(64, lambda: 0.001)
    assert [t[0] for t in taken] == [1, 64]


def test_a_functions_first_save_writes_the_first_snapshot_beside_it_and_its_write_sets_the_interval(tmp_path,
                                                                                                      monkeypatch):
    """auto's first snapshot was one of its own at the step after the first save, one a step until measured: the
    bench's run of 240 steps took three snapshots where the interval it settled on gave two (#58). The first save's
    capture is written beside it as the snapshot of its step, and that write (the same as a snapshot's) is the
    first measure: no snapshot is taken while it is written, and none at one a step after it."""
    clock = Clock()
    monkeypatch.setattr("cluster.checkpoint.memory.time", clock)
    snaps, taken = snapshots(tmp_path, [True] * 3)
    reports: list = []
    snaps._report = lambda *a: reports.append(a)
    folder, written = snaps.beside_save(20)
    assert folder == str(tmp_path / "snap-00000020")
    clock.now += 0.5
    snaps.take(21, lambda: 0.001)  # the save's snapshot is being written: auto's first measure, none before it
    assert taken == [] and snaps.skipped == 0
    Path(folder).mkdir(parents=True, exist_ok=True)
    clock.now += 0.1
    assert snaps.beside == 0
    written(20, folder, {}, 0.5)  # 0.5 s of CPU
    assert json.loads((Path(folder) / "rank-0.json").read_text())["step"] == 20 and snaps.beside == 1
    clock.now += 0.4
    snaps.take(22, lambda: 0.001)
    assert taken == [] and snaps.interval == 64 == auto_interval(0.0, 0.5, cpu_s=0.5, write_s=0.1)
    assert [r[0] for r in reports] == [20] and reports[0][-1] is True  # the first measure: copied to the peer
    # A later save, at a step no snapshot is due: its capture is written beside it all the same (its commit lands
    # seconds after it), and kept on its node alone; the snapshots of its own go on at auto's interval.
    folder, written = snaps.beside_save(40)
    assert folder == str(tmp_path / "snap-00000040")
    Path(folder).mkdir(parents=True, exist_ok=True)
    written(40, folder, {}, 0.2)
    assert reports[-1][0] == 40 and reports[-1][-1] is False and snaps.beside == 2
    assert snaps.interval == 64  # a save's write is not a snapshot's cost: no measure of auto's
    clock.now += 21.0
    snaps.take(64, lambda: 0.001)
    assert [t[0] for t in taken] == [64]
    # A save after a step a snapshot was due goes to the peer too, whether or not this rank took that one (a rank
    # whose save was being written took none at 64, where a rank of a few KB did: both copy the save at 70).
    step, folder, written = taken[0]
    Path(folder).mkdir(parents=True, exist_ok=True)
    written(step, folder, {}, 0.2)
    for save in (70, 80):
        folder, written = snaps.beside_save(save)
        Path(folder).mkdir(parents=True, exist_ok=True)
        written(save, folder, {}, 0.2)
    assert [(r[0], r[-1]) for r in reports[-3:]] == [(64, True), (70, True), (80, False)]


def test_a_first_save_whose_snapshot_was_not_written_leaves_the_first_measure_to_a_snapshot_of_its_own(tmp_path,
                                                                                                       monkeypatch):
    # (checkpoint.async: false writes the save before it returns: nothing is written beside it)
    clock = Clock()
    monkeypatch.setattr("cluster.checkpoint.memory.time", clock)
    snaps, taken = snapshots(tmp_path, [True] * 3)
    folder, written = snaps.beside_save(20)
    written(20, folder, None)  # not taken
    written(20, folder, {}, 0.5)  # (said once: a save that failed after its write said so says it again, unheard)
    assert snaps.beside == 0 and not snaps._writes
    clock.now += 0.5
    snaps.take(21, lambda: 0.001)  # one of its own at once, measured when written
    step, folder, written = taken[0]
    Path(folder).mkdir(parents=True, exist_ok=True)
    clock.now += 0.1
    written(step, folder, {}, 0.5)
    clock.now += 0.4
    snaps.take(22, lambda: 0.001)  # its write says the interval at once, as a first snapshot's does
    assert [t[0] for t in taken] == [21] and snaps.interval == 64


def test_a_later_save_writes_no_snapshot_beside_it_before_auto_measured_one(tmp_path):
    snaps, taken = snapshots(tmp_path, [True])
    snaps.take(1, lambda: None)  # its own first: measured when written
    assert snaps.beside_save(2) is None


def test_a_first_write_that_costs_little_leaves_one_a_step(tmp_path, monkeypatch):
    # the bar's case: 0.3 ms of CPU at 50 ms a step
    snaps, taken, _ = first_written(tmp_path, monkeypatch, cpu_s=0.0003, write_s=0.0, step_s=0.05)
    snaps.take(2, lambda: 0.0002)
    assert [t[0] for t in taken] == [1, 2] and snaps.interval == 1


def snapshot_folder(tmp_path, snapshot: bool, kind: str = "crc32") -> Path:
    folder = tmp_path / "restore-00000004"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"weights" * 1000)
    files = {"model.safetensors": describe_written(str(folder / "model.safetensors"), checksum=kind)}
    (folder / "manifest.json").write_text(json.dumps({"step": 4, "files": files, "snapshot": snapshot}))
    return folder


@pytest.mark.parametrize("kind, digest", [
    ("xxh3", xxhash.xxh3_64_hexdigest(b"weights" * 1000)),  # what a snapshot's files carry (SNAPSHOT_CHECKSUM)
    ("crc32", f"{zlib.crc32(b'weights' * 1000):08x}"),  # what they carried before
])
def test_a_snapshots_checksum_is_verified_on_restore(tmp_path, kind, digest):
    folder = snapshot_folder(tmp_path, snapshot=True, kind=kind)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["files"]["model.safetensors"] == {"size": 7000, kind: digest}
    check_manifest(pafs.LocalFileSystem(), str(folder), manifest, "snap")
    (folder / "model.safetensors").write_bytes(b"Weights" * 1000)  # same size, other bytes
    with pytest.raises(CheckpointError, match="does not match the checksum in its manifest"):
        check_manifest(pafs.LocalFileSystem(), str(folder), manifest, "snap")


def test_a_committed_checkpoint_must_carry_sha256(tmp_path):
    folder = snapshot_folder(tmp_path, snapshot=False)
    manifest = json.loads((folder / "manifest.json").read_text())
    with pytest.raises(CheckpointError, match="malformed .no 'files' of size and sha256"):
        check_manifest(pafs.LocalFileSystem(), str(folder), manifest, "ckpt")


@pytest.mark.parametrize("own_s, writer_s, busy, interval", [
    (0.0, 0.5, 1.0, 64),  # the writer process's 0.5 s on cores that were busy: counted whole, as the rank's own
    (0.0, 0.5, 0.1, 8),  # on cores idle 90% of the time: 0.05 s of it, (0.001 + 0.05) / (0.02 x 0.5) = 5.1, up to 8
    (0.5, 0.0, 0.1, 64),  # the rank's own thread's (it holds the interpreter's lock training needs): always whole
    (0.0, 0.5, None, 64),  # the cores' use not known: whole
])
def test_the_writer_process_s_cpu_counts_in_the_share_of_the_node_s_cores_that_was_busy(tmp_path, monkeypatch, own_s,
                                                                                      writer_s, busy, interval):
    clock, ticks = Clock(), [0.0]

    def read_cores():  # another 10 s of the cores' time between readings, ``busy`` of it busy
        ticks[0] += 10.0
        return (ticks[0] * busy, ticks[0], None, None) if busy is not None else (0.0, 0.0, None, None)

    monkeypatch.setattr("cluster.checkpoint.memory.time", clock)
    monkeypatch.setattr("cluster.checkpoint.memory.read_cores", read_cores)
    snaps, taken = snapshots(tmp_path, [True] * 4)
    for steps in (1, 2, 3, 4):
        snaps.take(steps, lambda: 0.001)
        step, folder, written = taken[-1]
        Path(folder).mkdir(parents=True, exist_ok=True)
        clock.now += 0.1
        written(step, folder, {}, own_s, writer_s)
        clock.now += 0.4
    assert snaps.interval == interval


@pytest.mark.parametrize("ended, excess, span", [
    (103.0, 2.0, 3.0),  # its work ended before the mark: the 4 steps after it are quiet (1 s), those before 1.5 s
    (107.0, None, 7.0),  # ended after the mark: those after it were not quiet; only how long it was in flight counts
    (None, None, 10.0),  # still in flight when the next was due: the whole interval, and more
])
def test_the_effect_is_the_steps_before_the_mark_against_the_quiet_ones_after_it(ended, excess, span):
    assert measured_effect((100.0, 10), (106.0, 14), (110.0, 18), ended) == (excess, 1.0, span)


def cycles(tmp_path, monkeypatch, excess_s: float, quiet_s: float, write_s: float, copy_s: float | None,
           peers: bool = True, count: int = 2, writer_cpu_s: float = 0.05) -> MemorySnapshots:
    """``auto`` from k = 4 (a restart's start): ``count`` snapshots and the take after them, each written ``write_s``
    after its capture and copied to the peer ``copy_s`` after that (the driver's note, seen from then on), the steps
    ``quiet_s`` each but those before its mark, which take ``excess_s`` more in all: the step counts and times a rank
    reads at its takes, marks and writes, no timing."""
    clock, notes = Clock(), [None]
    monkeypatch.setattr("cluster.checkpoint.memory.time", clock)
    monkeypatch.setattr("cluster.checkpoint.memory.copied",
                        lambda node_dir, rank: notes[0] if notes[0] and notes[0][1] <= clock.now else None)
    monkeypatch.setattr("cluster.checkpoint.memory.read_cores", lambda: (0.0, 0.0, None, None))  # (charged whole)
    taken: list = []
    told: list[int] = []  # what the driver heard at once (a restart starts from it)

    def save(accelerator, step, folder, written, **kwargs):
        taken.append((step, folder, written))
        return True

    snaps = MemorySnapshots(str(tmp_path), 0, None, 1 << 30, save, say=lambda line: None, report=lambda *a: None,
                            start=4, peers=peers, every_changed=told.append)
    snaps.accelerator, snaps.confirmed = object(), True
    steps = 4
    for _ in range(count):
        began = clock.now
        snaps.take(steps, lambda: 0.003)
        mark = snaps.mark_at
        assert mark == steps + (snaps.next_due(steps) - steps) // 2
        step, folder, written = taken[-1]
        Path(folder).mkdir(parents=True, exist_ok=True)
        clock.now = began + write_s
        written(step, folder, {}, 0.001, writer_cpu_s)
        if copy_s is not None:
            notes[0] = (step, began + write_s + copy_s)
        clock.now = began + (mark - steps) * quiet_s + excess_s
        snaps.mark(mark)
        due = snaps.next_due(mark)  # (later where the mark doubled k)
        clock.now += (due - mark) * quiet_s
        steps = due
    snaps.take(steps, lambda: 0.003)
    assert told == sorted(set(told)) and (told[-1] if told else 4) == snaps.interval
    return snaps


def test_auto_spaces_out_snapshots_whose_effect_on_the_steps_is_large(tmp_path, monkeypatch):
    """The bench's case (576 MiB a rank, 2 busy cores): a hold of 3 ms and 50 ms of the writer's CPU charged, a write
    of 1.5 s; counted as causes (``auto_interval``) they chose k = 4, where the two steps after each snapshot took
    1.3 s against 0.5 s quiet: 1.6 s of excess a snapshot, which 2% of k quiet steps covers from k = 160 on."""
    snaps = cycles(tmp_path, monkeypatch, excess_s=1.6, quiet_s=0.5, write_s=1.5, copy_s=1.0)
    assert auto_interval(0.003, 0.9, cpu_s=0.051, write_s=1.5) == 4
    assert list(snaps._effects) == [(1.6, 0.5, 5.0)] * 2  # its work ended at 2.5 s (the copy), before the mark
    assert snaps.interval == 256


def test_a_copy_that_ends_after_the_mark_makes_room_for_a_quiet_half(tmp_path, monkeypatch):
    """Its copy to the peer ended 4.5 s after the capture, past the mark (2 s on): k doubles there, and the steps
    after the mark were not quiet, so no excess is read from them (not yet noted when the next was due: 3 s, 6
    steps); k grows to twice the steps it was in flight (16), and the next one's mark comes before its copy ends
    again (6 s on, 7.5 s): doubled to 32, twice its 9 steps in flight (4.5 s / 0.5)."""
    snaps = cycles(tmp_path, monkeypatch, excess_s=1.0, quiet_s=0.5, write_s=1.5, copy_s=3.0)
    assert list(snaps._effects) == [(None, 0.5, 6.0), (None, 0.5, 9.0)]
    assert snaps.interval == 32
    one_node = cycles(tmp_path / "one", monkeypatch, excess_s=1.0, quiet_s=0.5, write_s=1.5, copy_s=None, peers=False)
    assert list(one_node._effects)[-1] == (1.0, 0.5, 3.0)  # no peer: its write's end is its work's
    assert one_node.interval == 128  # 1.0 / (0.02 x 0.5) = 100


def test_a_write_shorter_than_a_step_is_not_spaced_out_by_the_steps_jitter(tmp_path, monkeypatch):
    """The bar's case (307 KB, 0.05 s a step, written in 1 ms): two steps 10 ms slower than the two after the mark
    are the steps' own jitter (read as an effect, it would choose k = 32); the hold and the CPU choose."""
    snaps = cycles(tmp_path, monkeypatch, excess_s=0.02, quiet_s=0.05, write_s=0.001, copy_s=0.002, writer_cpu_s=0.0)
    assert list(snaps._effects)[-1][0] == pytest.approx(0.02)
    assert snaps.interval == 4 == auto_interval(0.003, 0.055, cpu_s=0.001, write_s=0.001)


def test_a_new_interval_reaches_the_driver_as_an_event_of_its_own():
    """``every_changed``'s event crosses to the driver as every rank event does (its first version, not a dataclass
    of its own, failed to build, and the rank stopped its snapshots: the bench's drain resumed from storage)."""
    from dataclasses import fields, is_dataclass

    from cluster.protocol import _RANK_EVENTS, SnapshotEvery, decode_rank_event

    assert decode_rank_event(SnapshotEvery(every=512).to_dict()) == SnapshotEvery(every=512)
    for cls in _RANK_EVENTS.values():  # each kind declares its own fields
        assert is_dataclass(cls) and "kind" not in {f.name for f in fields(cls)}, cls
        assert decode_rank_event(cls().to_dict()) == cls()


def test_the_writes_ends_kept_for_the_measure_stay_few(tmp_path):
    """One a step for hours (the bar's case, k = 1: none measured): only the newest few writes' ends are kept."""
    snaps, taken = snapshots(tmp_path, [True] * 20)
    for steps in range(1, 21):
        snaps.take(steps, lambda: None)
        step, folder, written = taken[-1]
        Path(folder).mkdir(parents=True, exist_ok=True)
        written(step, folder, {}, 0.0)
    assert sorted(snaps._ended) == list(range(13, 21))
