"""The run directory on shared storage: the one code that reads and writes the files of a run.

The names that ranks and node actors share with it (checkpoints, staging, manifest) are
``cluster.layout``'s; the rest are spelled here only.

::

    <storage>/<run name>/
      spec.yaml      the resolved spec that ran
      metrics.jsonl  one JSON object a line: step, rank, node, attempt, time, then the metrics
                     (on an object store, a long run's rows continue in metrics.jsonl.000001, ...:
                     ``jobs.appendlog``)
      result.json    status, attempts, world size, last step and metrics, checkpoints, times, error
      checkpoints/   committed checkpoints only, each with manifest.json written last,
                     and latest.json naming the newest
      logs/          rank-<R>.log, one per rank; stacks-<attempt>-<time>.txt, every rank's threads
                     when a hang was detected (``jobs.hangs``)
      tensorboard/   TensorBoard event files the driver writes (``tensorboard --logdir <storage>``)
      .staging/      checkpoints being written; never loaded, cleared at the next start

Paths go through ``pyarrow.fs``, so ``storage`` may be a local or NFS path
or an object-store URI (``s3://``, ``gs://``).
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
from dataclasses import dataclass
from typing import Any

import yaml
from pyarrow import fs as pafs

from cluster.context import RECORD_KEYS
from cluster.errors import RaylaunchError
from cluster.layout import (
    CHECKPOINTS, LATEST, LOGS, MARKER, METRICS, RESULT, RUN_EVENTS, SPEC, STAGING, checkpoint_name,
    flight_recorder_log, is_checkpoint_name, rank_log_file, rank_part_file, stacks_file, staging_dir,
)
from cluster.storage_io import (
    MANIFEST, CheckpointError, check_manifest, describe_files, is_local, open_uri, split_query, storage_credentials,
)
from cluster.strategy import missing_shards
from jobs.appendlog import AppendLogs, read_rows

__all__ = ["CheckpointError", "CommittedCheckpoint", "RECORD_KEYS", "RunDir", "StorageError", "numeric_metrics"]



def numeric_metrics(record: dict) -> dict[str, float]:
    """A metrics.jsonl record's metrics that are numbers (not its RECORD_KEYS, not booleans)."""
    return {k: v for k, v in record.items()
            if k not in RECORD_KEYS and isinstance(v, (int, float)) and not isinstance(v, bool)
            and (isinstance(v, float) or abs(v) < 2**1000)}  # an int float() cannot hold is no curve

class StorageError(RaylaunchError, RuntimeError):
    """The storage path cannot hold a run; the message says what to fix."""

    exit_code = 2


@dataclass(frozen=True)
class CommittedCheckpoint:
    step: int
    uri: str  # what a rank opens: on an object store, with the storage's query string
    name: str  # checkpoint-<step>, as latest.json names it


class RunDir:
    """Every path of one run, and the only code that writes them."""

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
        self._warned: set[str] = set()  # damaged files already said (see _warn_once)
        self.name = name
        self.path = f"{base.rstrip('/')}/{name}"
        self._local = is_local(self.fs)
        self._scheme = "" if self._local else storage.split("://", 1)[0]
        # Filesystem options (endpoint_override=..., scheme=...) travel with every URI
        # handed to node actors and ranks, so they open the same store.
        self._query = split_query(storage)[1]
        self._logs = AppendLogs(self.fs, self.path, self._local)  # metrics, events and rank logs

    # --- paths -----------------------------------------------------------------

    @property
    def uri(self) -> str:
        return self._uri(self.path)

    def _uri(self, path: str) -> str:
        return path if self._local else f"{self._scheme}://{path}{self._query}"

    def _path(self, uri: str) -> str:
        """The inverse of ``_uri``: the path inside ``self.fs``."""
        return uri if self._local else split_query(uri)[0].split("://", 1)[1]

    def _show(self, path: str) -> str:
        """A path as messages show it: the URI without its query string."""
        return path if self._local else f"{self._scheme}://{path}"

    @property
    def checkpoints_path(self) -> str:
        return f"{self.path}/{CHECKPOINTS}"

    def staging_uri(self, attempt: int) -> str:
        return self._uri(f"{self.path}/{staging_dir(attempt)}")

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
            self._write(f"{self.path}/{SPEC}", yaml.safe_dump(spec, sort_keys=False).encode())
            token = secrets.token_hex(8)
            self._write(f"{self.path}/{MARKER}", token.encode())
        except OSError as exc:
            raise StorageError(
                f"cannot write the run directory {self._show(self.path)}: {exc}. Set `storage` in the spec "
                "(or --storage) to a folder every node can write, such as an NFS mount or s3://bucket/runs."
            ) from None
        self.clear_staging()
        return token

    def clear_staging(self) -> None:
        """Delete what earlier attempts left in ``.staging/``; call it only while no rank runs."""
        self.fs.delete_dir_contents(f"{self.path}/{STAGING}", missing_dir_ok=True)

    def marker_uri(self) -> str:
        return self._uri(f"{self.path}/{MARKER}")

    # --- metrics, logs, result -----------------------------------------------------

    def append_metrics(self, records: list[dict]) -> None:
        if records:
            self._append(METRICS, "".join(json.dumps(r) + "\n" for r in records))

    def append_events(self, events: list[dict]) -> None:
        """The run's own events (``jobs.events``), after the earlier sessions'."""
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
        self._write(f"{self.path}/{RESULT}", json.dumps(result, indent=2, default=str).encode())

    def read_result(self) -> dict | None:
        try:
            result = self._read_json(f"{self.path}/{RESULT}")
        except ValueError:
            result = None
        if result is not None and not isinstance(result, dict):
            result = None
        if result is None and self.fs.get_file_info(f"{self.path}/{RESULT}").type == pafs.FileType.File:
            self._warn_once(f"raylaunch: {self._show(self.path)}/{RESULT} cannot be read; treated as absent")
        return result

    def write_stacks(self, attempt: int, text: str, flight_recorder: dict[int, bytes] | None = None) -> str:
        """Write ``logs/stacks-<attempt>-<time>.txt`` (and each rank's NCCL Flight Recorder dump
        beside it, ``logs/nccl-trace-<attempt>-<time>-rank<R>``); returns the stacks file as shown."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = f"{self.path}/{stacks_file(attempt, stamp)}"
        self._write(path, text.encode())
        for rank, data in sorted((flight_recorder or {}).items()):
            self._write(f"{self.path}/{flight_recorder_log(attempt, stamp, rank)}", data)
        return self._show(path)

    # --- checkpoints ---------------------------------------------------------------

    def commit_checkpoint(self, staging_uri: str, step: int, attempt: int, world_size: int, keep: int,
                          reported: dict[str, dict] | None = None, timing: dict | None = None) -> CommittedCheckpoint:
        """Check every rank's part, write the manifest last, move it in, then prune.

        ``reported``: sizes and sha256 the ranks computed on their own disks before
        uploading; files whose size matches are not read back from storage.

        Raises ``CheckpointError`` if a rank's part is missing, or if storage
        fails while committing (full, say); the staging folder is then left
        where no resume will ever load it, and ``latest.json`` is unchanged.
        """
        staging = self._path(staging_uri)
        try:
            return self._commit(staging, step, attempt, world_size, keep, reported or {}, timing)
        except OSError as exc:
            raise CheckpointError(
                f"could not commit the checkpoint of step {step} into {self._show(self.checkpoints_path)}: "
                f"{exc}. The previous committed checkpoint is still the latest."
            ) from exc

    def _commit(self, staging: str, step: int, attempt: int, world_size: int, keep: int,
                reported: dict[str, dict], timing: dict | None = None) -> CommittedCheckpoint:
        self.flush()  # the metrics up to this checkpoint are on storage before it counts
        files = describe_files(self.fs, staging, reported)
        missing = [r for r in range(world_size) if rank_part_file(r) not in files]
        if missing:
            raise CheckpointError(
                f"checkpoint of step {step} lacks the part of ranks {missing} (random_states_<rank>.pkl); "
                "it was not committed"
            )
        if lacking := missing_shards(files, world_size):  # a sharded (FSDP) checkpoint needs every rank's shards
            raise CheckpointError(f"checkpoint of step {step} lacks {', '.join(lacking[:5])}; it was not committed")
        manifest = json.dumps({"step": step, "attempt": attempt, "world_size": world_size,
                               "created": time.time(), "files": files,
                               # how long the save held training, and from the save until this commit
                               **({"timing": timing} if timing else {})}, indent=1).encode()
        name = checkpoint_name(step)
        final = f"{self.checkpoints_path}/{name}"
        if self.fs.get_file_info(final).type != pafs.FileType.NotFound:
            self.fs.delete_dir(final)  # an older commit of the same step, from a previous attempt
        if self._local:
            # A folder rename is atomic: the checkpoint appears with its manifest.
            self._write(f"{staging}/{MANIFEST}", manifest)
            self.fs.move(staging, final)
        else:
            # Object stores cannot rename a folder: copy the files (server-side), then the
            # manifest, whose presence is the commit (a folder without one is never listed).
            for rel in files:
                self.fs.copy_file(f"{staging}/{rel}", f"{final}/{rel}")
            self._write(f"{final}/{MANIFEST}", manifest)
            self.fs.delete_dir(staging)
        self._write(f"{self.checkpoints_path}/{LATEST}", json.dumps({"name": name, "step": step}).encode())
        self._prune(keep, latest=name)
        return CommittedCheckpoint(step, self._uri(final), name)

    def committed_checkpoints(self) -> list[CommittedCheckpoint]:
        """Committed checkpoints, oldest first: real folders of ``checkpoints/`` whose manifest lists their files.

        A folder that is a symbolic link (to anywhere) or whose manifest lists no files was not committed by
        this run: it is never listed, counted, kept or loaded, and that is said once."""
        out = []
        for info in self.fs.get_file_info(pafs.FileSelector(self.checkpoints_path, allow_not_found=True)):
            base = info.base_name
            if info.type == pafs.FileType.Directory and is_checkpoint_name(base):
                if self._local and os.path.islink(info.path):
                    self._warn_once(f"raylaunch: {self._show(info.path)} is a symbolic link, not a folder this run "
                                    "committed; that checkpoint is ignored")
                    continue
                try:
                    manifest = self._read_json(f"{info.path}/{MANIFEST}")
                    step = int(manifest["step"]) if manifest is not None else None
                    if manifest is not None and not manifest.get("files"):
                        self._warn_once(f"raylaunch: {self._show(info.path)}/{MANIFEST} lists no files; that "
                                        "checkpoint is ignored")
                        continue
                except (ValueError, TypeError, KeyError):  # corrupted: as if never committed
                    self._warn_once(f"raylaunch: {self._show(info.path)}/{MANIFEST} cannot be read; that "
                                    "checkpoint is skipped")
                    continue
                if step is not None:
                    out.append(CommittedCheckpoint(step, self._uri(info.path), base))
        return sorted(out, key=lambda c: c.step)

    def _warn_once(self, text: str) -> None:
        """A damaged file of the run is said once on stderr, and what depends on it goes on without it."""
        if text not in self._warned:
            self._warned.add(text)
            print(text, file=sys.stderr, flush=True)

    def latest_checkpoint(self) -> CommittedCheckpoint | None:
        try:
            pointer = self._read_json(f"{self.checkpoints_path}/{LATEST}")
            if pointer is not None and not isinstance(pointer.get("name"), str):
                raise ValueError("no 'name'")
        except (ValueError, AttributeError) as exc:
            committed = self.committed_checkpoints()
            self._warn_once(f"raylaunch: {self._show(self.checkpoints_path)}/{LATEST} cannot be read ({exc}); "
                            "using the newest committed checkpoint" + ("" if committed else ": there is none"))
            return committed[-1] if committed else None
        if pointer is None:
            return None
        committed = {c.name: c for c in self.committed_checkpoints()}
        if pointer["name"] not in committed:
            raise CheckpointError(
                f"{self._show(self.checkpoints_path)}/{LATEST} names {pointer['name']}, which is not a committed "
                "checkpoint in this run directory. Restore that folder, or start over with --fresh."
            )
        return committed[pointer["name"]]

    def verify(self, checkpoint: CommittedCheckpoint) -> None:
        """Check every file against the manifest; ``CheckpointError`` names the first that differs."""
        path = self._path(checkpoint.uri)
        manifest = self._read_json(f"{path}/{MANIFEST}")
        if manifest is None:
            raise CheckpointError(f"{self._show(path)} has no {MANIFEST}")
        check_manifest(self.fs, path, manifest, self._show(path))

    def loadable_checkpoint(self, warn=print) -> CommittedCheckpoint | None:
        """The latest committed checkpoint whose files match its manifest; older ones if it does not."""
        latest = self.latest_checkpoint()
        if latest is None:
            return None
        for c in reversed([c for c in self.committed_checkpoints() if c.step <= latest.step]):
            try:
                self.verify(c)
                return c
            except CheckpointError as exc:
                warn(f"raylaunch: not loading {self._show(self._path(c.uri))}: {exc}; "
                     "trying the previous committed checkpoint")
        raise CheckpointError(
            f"no committed checkpoint in {self._show(self.checkpoints_path)} matches its manifest. Restore the "
            "files, or start over with --fresh."
        )

    def _prune(self, keep: int, latest: str) -> None:
        """Keep the ``keep`` newest by step, and always the one just committed (``latest``): a script may save
        a step below one committed before (its folder names count something else)."""
        committed = [c for c in self.committed_checkpoints() if c.name != latest]
        for old in committed[: max(0, len(committed) - (keep - 1))]:
            self.fs.delete_dir(self._path(old.uri))

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
        """Every event of ``events.jsonl``, in the order written (``jobs.events.decode`` types them)."""
        return self._read_rows(RUN_EVENTS)

    def _read_rows(self, rel: str) -> list[dict]:
        rows, bad = read_rows(self.fs, f"{self.path}/{rel}")
        if bad:
            self._warn_once(f"raylaunch: {bad} line(s) of {self._show(self.path)}/{rel} cannot be read; skipped")
        return rows

    def checkpoint_files(self, checkpoint: CommittedCheckpoint) -> dict[str, dict]:
        """``{relative path: {"size", "sha256"}}`` from a committed checkpoint's manifest."""
        return self.checkpoint_manifest(checkpoint).get("files", {})

    def checkpoint_manifest(self, checkpoint: CommittedCheckpoint) -> dict:
        """A committed checkpoint's manifest: its step, attempt, files and (saves since issue 30) ``timing``."""
        return self._read_json(f"{self._path(checkpoint.uri)}/{MANIFEST}") or {}

    def log_uris(self) -> list[str]:
        infos = self.fs.get_file_info(pafs.FileSelector(f"{self.path}/{LOGS}", allow_not_found=True))
        return sorted(self._show(i.path) for i in infos if i.type == pafs.FileType.File)

    def local_path(self, rel: str) -> str | None:
        """A folder of the run as a local path, or None on object storage."""
        if not self._local:
            return None
        os.makedirs(f"{self.path}/{rel}", exist_ok=True)
        return f"{self.path}/{rel}"

    def upload_file(self, local_file: str, rel: str) -> None:
        """Copy a local file over ``<run>/<rel>`` (object storage: one PUT, seen whole or not at all)."""
        pafs.copy_files(local_file, f"{self.path}/{rel}", source_filesystem=pafs.LocalFileSystem(),
                        destination_filesystem=self.fs)

    # --- helpers ---------------------------------------------------------------------

    def _write(self, path: str, data: bytes) -> None:
        """Readers never see half a file: a temporary name and a rename on POSIX; on an
        object store one PUT, which readers see whole or not at all."""
        if not self._local:
            with self.fs.open_output_stream(path) as f:
                f.write(data)
            return
        tmp = f"{path}.tmp-{secrets.token_hex(4)}"
        with self.fs.open_output_stream(tmp) as f:
            f.write(data)
        self.fs.move(tmp, path)

    def _read_json(self, path: str) -> Any:
        try:
            with self.fs.open_input_stream(path) as f:
                return json.loads(f.read())
        except FileNotFoundError:
            return None
