"""The files a run appends to (``metrics.jsonl``, ``events.jsonl``, each rank's log) on any storage: appended
on a local or NFS path; on an object store, which cannot append, written as segments held in memory and
rewritten whole now and then (``_ObjectLog``). ``jobs.run.storage.RunDir`` owns the names; this owns the writing.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import sys
import time
from typing import Any

from pyarrow import fs as pafs

__all__ = ["AppendLogs", "read_rows", "rewrite_due", "segment_path", "segments"]

# On an object store, metrics and logs are rewritten whole at most this often, less often as
# they grow (``rewrite_due``), and at every commit and at the end: what a crash of the driver
# can lose.
OBJECT_FLUSH_S = 2.0
# A growing object (metrics, logs, event files) is rewritten whole: at most this many bytes a
# second on average, so a long run's 50 MB metrics.jsonl goes out every 50 s, not every 2 s.
OBJECT_REWRITE_BYTES_PER_S = 1 << 20


# On an object store a growing file is written as segments (``_ObjectLog``): a new object once
# the last one holds SEGMENT_BYTES or is SEGMENT_S old, so the driver holds and rewrites at most
# one segment of each file, and a crash loses at most its last rewrite interval (about 4 s at
# 4 MiB). Every object-store file held together stays under HELD_BYTES: past it, all roll.
SEGMENT_BYTES = 4 << 20
SEGMENT_S = 600.0
HELD_BYTES = 64 << 20
# Rows a full disk refused are held and written with the next append once there is space: at most this many
# bytes of each file (past it, the oldest rows go and the next write says how many lines were lost).
BACKLOG_BYTES = 16 << 20


@functools.cache
def _open_files_cap() -> int:
    """How many appended files a run keeps open: half of what this process may open, its soft limit raised to its
    hard limit first (often 1,024 and over a million: a driver of 4,096 ranks keeps a log of each open)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, 1 << 16) if hard != resource.RLIM_INFINITY else 1 << 16
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (OSError, ValueError):
            pass
    return max(16, (soft if soft != resource.RLIM_INFINITY else 1 << 16) // 2)


def segment_path(path: str, index: int) -> str:
    """Segment ``index`` of a growing file: the file's own name first, then ``<name>.000001``, ..."""
    return path if index == 0 else f"{path}.{index:06d}"


def segments(fs: pafs.FileSystem, path: str) -> list[str]:
    """The segments of the growing file ``path`` on storage, in order (one on a local path)."""
    folder, base = path.rsplit("/", 1)
    found = []
    for info in fs.get_file_info(pafs.FileSelector(folder, allow_not_found=True)):
        name = info.base_name
        if info.type != pafs.FileType.File or not name.startswith(base):
            continue
        suffix = name[len(base):]
        if suffix == "":
            found.append((0, info.path))
        elif suffix[0] == "." and len(suffix) == 7 and suffix[1:].isdigit():
            found.append((int(suffix[1:]), info.path))
    return [p for _, p in sorted(found)]


def rewrite_due(size: int, written_at: float) -> bool:
    """Whether a growing object of ``size`` bytes, last written at ``written_at``
    (``time.monotonic()``), is due to be written again."""
    return time.monotonic() - written_at >= max(OBJECT_FLUSH_S, size / OBJECT_REWRITE_BYTES_PER_S)


class AppendLogs:
    """The growing files of one run directory (``root``), each opened on its first append."""

    def __init__(self, fs: pafs.FileSystem, root: str, local: bool) -> None:
        self.fs, self.root, self.local = fs, root, local
        self._streams: dict[str, Any] = {}
        self._objects: dict[str, _ObjectLog] = {}
        self._held = 0  # bytes the _ObjectLogs hold in memory
        self._sizes: dict[str, int] = {}  # a POSIX file's size after the last append that went through
        self._backlog: dict[str, bytes] = {}  # rows a full disk refused, written with the next append
        self._dropped: dict[str, int] = {}  # lines of the backlog dropped past BACKLOG_BYTES
        self._torn: set[str] = set()  # files a failed append may have left ending mid-line (not cut back)

    def append(self, rel: str, text: str) -> None:
        """Append ``text`` (whole lines) to ``rel``. On a POSIX path a write the disk refuses raises ``OSError``,
        and its lines are held (up to ``BACKLOG_BYTES`` a file) and written before the next append's: a few
        seconds of a full disk lose no row."""
        path = f"{self.root}/{rel}"
        if not self.local:
            log = self._objects.get(rel)
            if log is None:
                log = self._objects[rel] = _ObjectLog(self.fs, path)
                self._held += len(log.data)
            self._held += log.append(text.encode())
            if self._held > HELD_BYTES:  # many files each holding part of a segment: all of them roll
                for log in self._objects.values():
                    log.roll()
                self._held = 0
            return
        data = self._backlog.pop(rel, b"") + text.encode()
        stream = self._streams.pop(rel, None)
        if stream is not None:
            self._streams[rel] = stream  # the most recently used last: the first is the one closed for room
        try:
            if stream is None:
                if len(self._streams) >= _open_files_cap():
                    self._close_oldest()
                # A plain file of the OS (pyarrow's append stream took 0.8 ms of CPU to open, holding the driver's
                # loop 3 s when 4,096 ranks first printed; a write through either is a system call)
                stream = self._streams[rel] = open(path, "ab", buffering=0)
                self._sizes[rel] = os.fstat(stream.fileno()).st_size
            # A file a failed append left mid-line (it could not be cut back) goes on from a line of its own:
            # only that torn line is unreadable (readers skip it), and the held rows follow it whole.
            view = memoryview(b"\n" + data if rel in self._torn else data)
            while view:  # a write(2) may take part of it (a disk filling up): the rest, or its error
                view = view[stream.write(view):]
        except OSError:
            self._refused(rel, path, stream, data)
            raise
        self._sizes[rel] += len(data) + (rel in self._torn)
        self._torn.discard(rel)
        if rel in self._dropped:
            self._say_dropped(rel)

    def _close_oldest(self) -> None:
        """Room for one more open file: the least recently appended to is closed (reopened when next needed)."""
        rel = next(iter(self._streams))
        self._streams.pop(rel).close()

    def _refused(self, rel: str, path: str, stream: Any, data: bytes) -> None:
        """The disk refused ``data``: cut the file back to its last whole append and hold ``data``."""
        self._streams.pop(rel, None)  # reopened at the next append
        if stream is not None:
            try:
                stream.close()
            except OSError:
                pass
        size = self._sizes.pop(rel, None)  # unknown once the stream is gone: read again at the reopen
        if size is not None and rel not in self._torn:
            try:
                os.truncate(path, size)  # frees what part of the write got in: no half row
            except OSError:
                self._torn.add(rel)
        if len(data) > BACKLOG_BYTES:  # the oldest rows go, whole lines
            newline = data.find(b"\n", len(data) - BACKLOG_BYTES - 1)
            cut = len(data) if newline < 0 else newline + 1
            self._dropped[rel] = self._dropped.get(rel, 0) + data[:cut].count(b"\n")
            data = data[cut:]
        if data:
            self._backlog[rel] = data

    def _say_dropped(self, rel: str) -> None:
        print(f"raylaunch: {self._dropped.pop(rel)} line(s) of {self.root}/{rel} were lost while the disk was "
              f"full (more than {BACKLOG_BYTES >> 20} MiB waited for space)", file=sys.stderr)

    def _write_backlog(self) -> None:
        """Try again what a full disk refused (``OSError`` while it still does; nothing is lost by a failure)."""
        for rel in list(self._backlog):
            self.append(rel, "")

    def flush(self) -> None:
        """Write out what object-store logs hold in memory (POSIX appends are written at once)."""
        for log in self._objects.values():
            log.flush()

    def close(self) -> None:
        """Write out everything held; raises ``OSError`` if the storage still refuses some of it."""
        self.flush()
        try:
            self._write_backlog()
        finally:
            self._close_streams()

    def _close_streams(self) -> None:
        for s in self._streams.values():
            s.close()
        self._streams.clear()
        self._objects.clear()
        self._held = 0


def read_rows(fs: pafs.FileSystem, path: str) -> tuple[list[dict], int]:
    """Every JSON object of the growing file ``path`` (all its segments, in order), and how many lines were not
    one; a line being written (no newline yet) is left out."""
    rows: list[dict] = []
    bad = 0
    for segment in segments(fs, path):
        try:
            with fs.open_input_stream(segment) as f:
                text = f.read().decode("utf-8", "replace")
        except FileNotFoundError:  # removed since it was listed
            continue
        for line in text.split("\n")[:-1]:
            if line.strip():
                try:
                    row = json.loads(line)
                except ValueError:
                    row = None
                if isinstance(row, dict):
                    rows.append(row)
                else:
                    bad += 1
    return rows, bad


class _ObjectLog:
    """A growing file (metrics, logs) on an object store, which cannot append, as segments.

    An output stream kept open shows nothing until it is closed, so a crash of the driver
    would lose the whole file. Instead the last segment is held in memory and rewritten whole,
    at most every ``OBJECT_FLUSH_S`` (less often as it grows: ``rewrite_due``) and on
    ``flush``; each PUT replaces that object whole. Once the segment holds ``SEGMENT_BYTES``
    or is ``SEGMENT_S`` old, a new one starts (``segment_path``): the driver's memory and
    each rewrite stay bounded however long the run. A rerun of the same run continues the
    last segment if it has room.
    """

    def __init__(self, fs: pafs.FileSystem, path: str) -> None:
        self.fs, self.path = fs, path
        existing = segments(fs, path)
        self.index = 0
        self.data = bytearray()
        if existing:
            self.index = 0 if existing[-1] == path else int(existing[-1].rsplit(".", 1)[1])
            with fs.open_input_stream(existing[-1]) as f:
                self.data = bytearray(f.read())
            if len(self.data) >= SEGMENT_BYTES:
                self.index, self.data = self.index + 1, bytearray()
        self.dirty = False
        self.started = time.monotonic()
        self.written_at = 0.0  # the first rows go out at once

    def append(self, data: bytes) -> int:
        """Add ``data``; returns how much more memory this holds (less than ``len(data)`` after a roll)."""
        before = len(self.data)
        if self.data and (len(self.data) + len(data) > SEGMENT_BYTES
                          or time.monotonic() - self.started >= SEGMENT_S):
            self.roll()
        self.data += data
        self.dirty = True
        if rewrite_due(len(self.data), self.written_at):
            self.flush()
        return len(self.data) - before

    def roll(self) -> None:
        """Write the segment out and start the next one (nothing to do while it is empty)."""
        if not self.data:
            return
        self.flush()
        self.index += 1
        self.data = bytearray()
        self.started = time.monotonic()
        self.written_at = 0.0

    def flush(self) -> None:
        if self.dirty:
            with self.fs.open_output_stream(segment_path(self.path, self.index)) as f:
                f.write(bytes(self.data))
            self.dirty = False
            self.written_at = time.monotonic()
