"""The run directory on shared storage: the one code that reads and writes the files of a run.

The names that ranks and node actors share with it (checkpoints, staging, manifest) are
``cluster.layout``'s; the rest are spelled here only.

::

    <storage>/<run name>/
      spec.yaml      the resolved spec that ran
      metrics.jsonl  one JSON object a line: step, rank, node, attempt, time, then the metrics
                     (on an object store, a long run's rows continue in metrics.jsonl.000001, ...:
                     ``jobs.run.appendlog``)
      result.json    status, attempts, world size, last step and metrics, checkpoints, times, error
      checkpoints/   committed checkpoints only, each with manifest.json written last,
                     and latest.json naming the newest
      logs/          rank-<R>.log, one per rank; stacks-<attempt>-<time>.txt, every rank's threads
                     when a hang was detected (``jobs.driver.hangs``)
      tensorboard/   TensorBoard event files the driver writes (``tensorboard --logdir <storage>``)
      .staging/      checkpoints being written; never loaded, cleared at the next start

Paths go through ``pyarrow.fs``, so ``storage`` may be a local or NFS path
or an object-store URI (``s3://``, ``gs://``).
"""

from __future__ import annotations

import json
import os
import secrets
import time

import yaml
from pyarrow import fs as pafs

from cluster.context import RECORD_KEYS
from cluster.errors import RaylaunchError
from cluster.layout import (
    CHECKPOINTS, LOGS, MARKER, METRICS, RESULT, RUN_EVENTS, SPEC, STAGING, flight_recorder_log, rank_log_file,
    stacks_file, staging_dir,
)
from cluster.metric_rows import numeric_metrics
from cluster.storage_io import CheckpointError, open_uri, storage_credentials
from jobs.run.appendlog import AppendLogs, read_rows
from jobs.run.checkpoints import CheckpointCatalogue, CommittedCheckpoint
from jobs.run.runfiles import RunFiles

__all__ = ["CheckpointError", "CommittedCheckpoint", "RECORD_KEYS", "RunDir", "StorageError", "numeric_metrics"]


class StorageError(RaylaunchError, RuntimeError):
    """The storage path cannot hold a run; the message says what to fix."""

    exit_code = 2


class RunDir:
    """Every path of one run, and the only code that writes them; its committed checkpoints are ``checkpoints``
    (``jobs.run.checkpoints.CheckpointCatalogue``)."""

    def __init__(self, storage: str, name: str) -> None:
        storage = os.path.expanduser(storage)
        if "://" not in storage:
            storage = os.path.abspath(storage)
        secret = storage_credentials(storage)
        if secret:  # never echoed: the value holds the secret
            raise StorageError(f"the storage URI holds credentials ({secret}); remove them: each node and "
                               "this machine use their own credential chain (instance profile, AWS_* variables)")
        try:
            self.fs, base = open_uri(storage)
        except Exception as exc:  # pyarrow raises ArrowInvalid and friends
            raise StorageError(f"storage {storage!r} is not a path or a URI pyarrow can open: {exc}") from None
        self.storage = storage
        self.name = name
        self.path = f"{base.rstrip('/')}/{name}"
        self.files = RunFiles(self.fs, storage)  # its paths, URIs and whole-file writes
        self._logs = AppendLogs(self.fs, self.path, self.files.local)  # metrics, events and rank logs
        self.checkpoints = CheckpointCatalogue(self.files, f"{self.path}/{CHECKPOINTS}", flush=self.flush)

    # --- paths -----------------------------------------------------------------

    @property
    def uri(self) -> str:
        return self.files.uri(self.path)

    def staging_uri(self, attempt: int) -> str:
        return self.files.uri(f"{self.path}/{staging_dir(attempt)}")

    def exists(self) -> bool:
        return self.fs.get_file_info(self.path).type != pafs.FileType.NotFound

    # --- start -------------------------------------------------------------------

    def prepare(self, spec: dict) -> str:
        """Create the folders, write ``spec.yaml`` and a marker; return the marker's token.

        Fails with ``StorageError`` when the path cannot be written.
        """
        try:
            for sub in ("", f"/{CHECKPOINTS}", f"/{LOGS}"):
                self.fs.create_dir(self.path + sub, recursive=True)
            self.files.write(f"{self.path}/{SPEC}", yaml.safe_dump(spec, sort_keys=False).encode())
            token = secrets.token_hex(8)
            self.files.write(f"{self.path}/{MARKER}", token.encode())
        except OSError as exc:
            raise StorageError(
                f"cannot write the run directory {self.files.show(self.path)}: {exc}. Set `storage` in the spec "
                "(or --storage) to a folder every node can write, such as an NFS mount or s3://bucket/runs."
            ) from None
        self.clear_staging()
        return token

    def clear_staging(self) -> None:
        """Delete what earlier attempts left in ``.staging/``; call it only while no rank runs."""
        self.fs.delete_dir_contents(f"{self.path}/{STAGING}", missing_dir_ok=True)

    def marker_uri(self) -> str:
        return self.files.uri(f"{self.path}/{MARKER}")

    # --- metrics, logs, result -----------------------------------------------------

    def append_metrics(self, records: list[dict]) -> None:
        if records:
            self._append(METRICS, "".join(json.dumps(r) + "\n" for r in records))

    def append_metric_text(self, text: str) -> None:
        """Rows rendered already (``cluster.metric_rows.RowBatch.text``: a node's, JSON lines)."""
        if text:
            self._append(METRICS, text)

    def append_events(self, events: list[dict]) -> None:
        """The run's own events (``jobs.run.events``), after the earlier sessions'."""
        if events:
            self._append(RUN_EVENTS, "".join(json.dumps(e) + "\n" for e in events))

    def append_log(self, rank: int, lines: list[str]) -> None:
        if lines:
            self._append(rank_log_file(rank), "".join(line + "\n" for line in lines))

    def _append(self, rel: str, text: str) -> None:
        self._logs.append(rel, text)

    def flush(self) -> None:
        """Write out what object-store logs hold in memory (POSIX appends are written at once)."""
        self._logs.flush()

    def close(self) -> None:
        self._logs.close()

    def write_result(self, result: dict) -> None:
        self.flush()
        self.files.write(f"{self.path}/{RESULT}", json.dumps(result, indent=2, default=str).encode())

    def read_result(self) -> dict | None:
        try:
            result = self.files.read_json(f"{self.path}/{RESULT}")
        except ValueError:
            result = None
        if result is not None and not isinstance(result, dict):
            result = None
        if result is None and self.fs.get_file_info(f"{self.path}/{RESULT}").type == pafs.FileType.File:
            self.files.warn_once(f"raylaunch: {self.files.show(self.path)}/{RESULT} cannot be read; treated as absent")
        return result

    def write_stacks(self, attempt: int, text: str, flight_recorder: dict[int, bytes] | None = None) -> str:
        """Write ``logs/stacks-<attempt>-<time>.txt`` (and each rank's NCCL Flight Recorder dump
        beside it, ``logs/nccl-trace-<attempt>-<time>-rank<R>``); returns the stacks file as shown."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = f"{self.path}/{stacks_file(attempt, stamp)}"
        self.files.write(path, text.encode())
        for rank, data in sorted((flight_recorder or {}).items()):
            self.files.write(f"{self.path}/{flight_recorder_log(attempt, stamp, rank)}", data)
        return self.files.show(path)

    # --- reading a run back (raylaunch runs, show, plot) ------------------------------

    @staticmethod
    def names(storage: str) -> list[str]:
        """The runs under ``storage``: folders holding a ``spec.yaml``, by name."""
        probe = RunDir(storage, "_")
        base = probe.path.rsplit("/", 1)[0]
        infos = probe.fs.get_file_info(pafs.FileSelector(base, allow_not_found=True))
        dirs = [i for i in infos if i.type == pafs.FileType.Directory]
        return sorted(
            i.base_name for i in dirs
            if probe.fs.get_file_info(f"{i.path}/{SPEC}").type == pafs.FileType.File
        )

    def read_spec(self) -> dict | None:
        try:
            with self.fs.open_input_stream(f"{self.path}/{SPEC}") as f:
                return yaml.safe_load(f.read())
        except FileNotFoundError:
            return None

    def read_metrics(self) -> list[dict]:
        """Every record of ``metrics.jsonl``; a line being written (no newline yet) is left out."""
        return self._read_rows(METRICS)

    def read_events(self) -> list[dict]:
        """Every event of ``events.jsonl``, in the order written (``jobs.run.events.decode`` types them)."""
        return self._read_rows(RUN_EVENTS)

    def _read_rows(self, rel: str) -> list[dict]:
        rows, bad = read_rows(self.fs, f"{self.path}/{rel}")
        if bad:
            self.files.warn_once(f"raylaunch: {bad} line(s) of {self.files.show(self.path)}/{rel} cannot be read; "
                                 "skipped")
        return rows

    def log_uris(self) -> list[str]:
        infos = self.fs.get_file_info(pafs.FileSelector(f"{self.path}/{LOGS}", allow_not_found=True))
        return sorted(self.files.show(i.path) for i in infos if i.type == pafs.FileType.File)

    def local_path(self, rel: str) -> str | None:
        """A folder of the run as a local path, or None on object storage."""
        if not self.files.local:
            return None
        os.makedirs(f"{self.path}/{rel}", exist_ok=True)
        return f"{self.path}/{rel}"

    def upload_file(self, local_file: str, rel: str) -> None:
        """Copy a local file over ``<run>/<rel>`` (object storage: one PUT, seen whole or not at all)."""
        pafs.copy_files(local_file, f"{self.path}/{rel}", source_filesystem=pafs.LocalFileSystem(),
                        destination_filesystem=self.fs)
