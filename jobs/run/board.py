"""TensorBoard event files of a run, written by the driver beside ``metrics.jsonl``.

``tensorboard --logdir <storage>`` then shows every run (one TensorBoard
"run" per run directory). Each numeric metric is written as the mean across
the ranks that logged it, once every one of those ranks has moved past that
step (or the attempt ends); per-rank throughput and peak memory go under
``rank_<R>/`` (a point per rank at each flush) so an imbalance or an
out-of-memory risk shows before it happens. A resumed attempt opens a new event file with ``purge_step`` at the
resumed step, so the curve shows the steps the final model saw, once.

On object storage the event files are written to a local folder; a flush
copies into the run directory the files that grew, no more often than
``rewrite_due`` allows (a long run's event file is not sent whole every 2 s).

The driver writes the files itself, in its own thread: a flush is one ``Event`` per step (every tag of the step
in its ``Summary``) and one write. TensorBoard's ``EventFileWriter`` handed each scalar to a writer thread that
opened, appended to and closed the file once per scalar: most of the driver's CPU in steady steps.
"""

from __future__ import annotations

import io
import itertools
import os
import shutil
import socket
import sys
import tempfile
import time
from collections import defaultdict

from cluster.layout import TENSORBOARD
from cluster.metric_rows import PER_RANK, RowBatch, keep_latest
from jobs.run.appendlog import rewrite_due
from jobs.run.storage import RunDir

__all__ = ["Board"]

_files = itertools.count()  # event files this process opened: a part of each name, as TensorBoard's own writer


class _EventFile:
    """One TensorBoard event file (the name and records TensorBoard's ``EventFileWriter`` writes), written in the
    caller's thread: ``write`` takes a flush's events and appends them at once."""

    def __init__(self, folder: str) -> None:
        from tensorboard.compat.proto.event_pb2 import Event, SourceMetadata

        os.makedirs(folder, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(_files)}"
        self._file = open(os.path.join(folder, name), "wb")
        self.write([Event(wall_time=time.time(), file_version="brain.Event:2",
                          source_metadata=SourceMetadata(writer="raylaunch"))])

    def write(self, events: list) -> None:
        from tensorboard.summary.writer.record_writer import RecordWriter

        buffer = io.BytesIO()
        records = RecordWriter(buffer)  # the framing and checksums of TFRecord
        for e in events:
            records.write(e.SerializeToString())
        self._file.write(buffer.getvalue())
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _scratch() -> str:
    """A folder for one run's event files while they go to object storage, inside this process's
    ``raylaunch-tb-<pid namespace>-<pid>``; those of drivers that no longer run (one killed outright cannot remove
    its own: the suite left one a killed driver) go first, as node actors' scratch folders do."""
    from cluster.hosting.forkserver import pid_namespace, process_folder

    return tempfile.mkdtemp(dir=process_folder(f"raylaunch-tb-{pid_namespace()}-"))


class Board:
    """One run's TensorBoard writer; ``add`` records as they arrive, ``flush`` now and then."""

    def __init__(self, run_dir: RunDir) -> None:
        self.run_dir = run_dir
        self._local = run_dir.local_path(TENSORBOARD)
        self._tmp = None
        if self._local is None:  # object storage: write here, copy on flush
            self._tmp = _scratch()
            self._local = self._tmp
        self._writer = None
        self._failed_said = False
        self._sent: dict[str, int] = {}  # event file -> the size the run directory holds
        self._sent_at = 0.0
        self._reset()

    def _reset(self) -> None:
        # step -> metric -> [sum, count] across the ranks that logged it, for steps not yet written
        self._pending: dict[int, dict[str, list[float]]] = defaultdict(dict)
        self._ranks_of: dict[str, set[int]] = defaultdict(set)  # metric -> the ranks that log it
        self._rank_step: dict[int, int] = {}  # rank -> the latest step it reported anything at
        self._latest: dict[str, dict[int, float]] = defaultdict(dict)  # PER_RANK metric -> rank -> newest value

    def start_attempt(self, resume_step: int | None) -> None:
        """A new event file; on resume, TensorBoard drops what the old files hold past ``resume_step``."""
        # tensorboard's protocol buffers: no torch import in the driver (tensorboardX's imports it).
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        self.close_writer()
        self._reset()
        try:
            self._writer = _EventFile(self._local)
            if resume_step is not None:
                # What torch's SummaryWriter(purge_step=...) writes: readers drop later steps of earlier files.
                self._writer.write([Event(step=resume_step + 1, file_version="brain.Event:2"),
                                    Event(step=resume_step + 1, session_log=SessionLog(status=SessionLog.START))])
        except OSError as exc:
            self._failed(exc)

    def _failed(self, exc: OSError) -> None:
        """The event files cannot be written (a full disk, say): never the run's failure. Said once; TensorBoard
        misses the rest of this attempt (metrics.jsonl has it), and the next attempt opens a new file."""
        if not self._failed_said:
            self._failed_said = True
            print(f"raylaunch: TensorBoard files could not be written ({exc}); metrics.jsonl keeps every metric, "
                  "TensorBoard gets the next attempt's", file=sys.stderr, flush=True)
        if self._writer is not None:  # every later write would raise the error again
            try:
                self._writer.close()
            except OSError:
                pass
        self._writer = None

    def _write(self, scalars: dict[int, list[tuple[str, float]]]) -> None:
        """Step -> its (tag, value) pairs, as one event per step, in one write."""
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        now = time.time()
        self._writer.write([Event(wall_time=now, step=step, summary=Summary(
            value=[Summary.Value(tag=tag, simple_value=value) for tag, value in pairs]))
            for step, pairs in sorted(scalars.items())])

    def add(self, batch: RowBatch) -> None:
        """A batch of rows (``cluster.metric_rows``: a node's, summed there, or the driver's own measurements)."""
        pending = self._pending
        for step, sums in batch.sums.items():
            at_step = pending[step]
            for name, (total, count) in sums.items():
                held = at_step.get(name)
                if held is None:
                    at_step[name] = [total, count]
                else:
                    held[0] += total
                    held[1] += count
        for name, ranks in batch.ranks.items():
            self._ranks_of[name].update(ranks)
        keep_latest(self._rank_step, batch.steps)
        for name, values in batch.latest.items():
            self._latest[name].update(values)

    def flush(self, final: bool = False) -> None:
        """Write every step that all its ranks have passed (all of them when ``final``).

        The ``PER_RANK`` series get one point per rank and flush (every 2 s while an attempt runs), its newest value
        at the newest step written, so a thousand ranks logging at every step do not cost the driver 20,000
        TensorBoard events a second."""
        if self._writer is None:
            return
        try:
            self._flush(final)
        except OSError as exc:
            self._failed(exc)

    def _flush(self, final: bool) -> None:
        scalars: dict[int, list[tuple[str, float]]] = defaultdict(list)
        newest: dict[str, int] = {}  # PER_RANK metric -> the newest step it was written at
        passed: dict[str, float] = {}  # metric -> the step every rank that logs it has passed
        for step in sorted(self._pending):
            metrics = self._pending[step]
            for name in list(metrics):
                if not final:
                    floor = passed.get(name)
                    if floor is None:
                        floor = passed[name] = min(self._rank_step[r] for r in self._ranks_of[name])
                    if floor <= step:
                        continue
                total, count = metrics.pop(name)
                scalars[step].append((name, total / count))
                if name in PER_RANK:
                    newest[name] = step
            if not metrics:
                del self._pending[step]
        for name, step in newest.items():
            scalars[step] += [(f"rank_{rank}/{name}", v) for rank, v in self._latest.pop(name, {}).items()]
        if scalars:
            self._write(scalars)
        self._upload(final)

    def goodput(self, books: dict, step: int) -> None:
        """The goodput ledger (``result.json``'s ``goodput``) as scalars at ``step``: ``goodput/ratio`` and
        ``goodput/<category>_s``, written as each attempt ends."""
        if self._writer is None or not books:
            return
        try:
            self._write({step: [("goodput/ratio", float(books["ratio"]))]
                         + [(f"goodput/{cat}_s", float(secs)) for cat, secs in books["seconds"].items()]})
        except OSError as exc:
            self._failed(exc)

    def _upload(self, final: bool) -> None:
        """Object storage: copy the event files that grew since they were last sent."""
        if self._tmp is None:
            return
        sizes = {name: os.path.getsize(os.path.join(self._tmp, name)) for name in os.listdir(self._tmp)}
        grown = [name for name, size in sizes.items() if self._sent.get(name) != size]
        if not grown or not (final or rewrite_due(sum(sizes[n] for n in grown), self._sent_at)):
            return
        for name in grown:
            self.run_dir.upload_file(os.path.join(self._tmp, name), f"{TENSORBOARD}/{name}")
            self._sent[name] = sizes[name]
        self._sent_at = time.monotonic()

    def close_writer(self) -> None:
        if self._writer is not None:
            self.flush(final=True)
            try:
                if self._writer is not None:
                    self._writer.close()
                self._upload(final=True)
            except OSError as exc:
                self._failed(exc)
            self._writer = None

    def close(self) -> None:
        self.close_writer()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
