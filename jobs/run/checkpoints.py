"""A run's committed checkpoints: committing one (every rank's part checked, the manifest written last, then
``latest.json``, then the old ones pruned), listing them, and finding the latest that still matches its manifest.

A ``jobs.run.storage.RunDir`` holds one as ``run_dir.checkpoints`` (``run_dir.checkpoints.commit(...)``); it reaches
storage through the run directory's ``RunFiles``.
"""

from __future__ import annotations

import errno
import json
import os
import time
from dataclasses import dataclass
from typing import Callable

from pyarrow import fs as pafs

from cluster.layout import LATEST, checkpoint_name, is_checkpoint_name, ranks_lacking
from cluster.storage_io import MANIFEST, CheckpointError, check_manifest, describe_files
from cluster.strategy import missing_shards
from jobs.run.runfiles import RunFiles

# How long a commit is tried again while an object store refuses or does not answer, or the disk is full.
COMMIT_RETRY_S = 60.0

__all__ = ["CheckpointCatalogue", "CommittedCheckpoint"]


@dataclass(frozen=True)
class CommittedCheckpoint:
    step: int
    uri: str  # what a rank opens: on an object store, with the storage's query string
    name: str  # checkpoint-<step>, as latest.json names it
    nbytes: int = 0  # its files' bytes, when it was just committed (0: listed, not counted)


class CheckpointCatalogue:
    """The committed checkpoints under ``root`` (a run directory's ``checkpoints/``). ``flush``: writes out what
    the run's metrics hold in memory, called before a commit counts (the rows up to it are on storage first)."""

    def __init__(self, io: RunFiles, root: str, flush: Callable[[], None]) -> None:
        self._io, self.root, self._flush = io, root, flush
        # The checkpoints this catalogue committed, or checked in full, and each file's (size, mtime) as it then
        # listed them: ``loadable`` reads them again only if their listing changed (``_listing``).
        self._known: dict[str, dict[str, tuple[int, int]]] = {}

    def commit(self, staging_uri: str, step: int, attempt: int, world_size: int, keep: int,
               reported: dict[str, dict] | None = None, timing: dict | None = None) -> CommittedCheckpoint:
        """Check every rank's part, write the manifest last, move it in, then prune.

        ``reported``: sizes and sha256 the ranks computed on their own disks before
        uploading; files whose size matches are not read back from storage.

        Raises ``CheckpointError`` if a rank's part is missing, or if storage
        fails while committing for longer than ``COMMIT_RETRY_S``: an object store
        refusing or not answering (503 Slow Down, a reset) and a full disk are
        tried again until then, any other error of a local path fails at once.
        Until its manifest is written the staging folder stays where no resume
        will ever load it, and ``latest.json`` is unchanged; once it is, the
        checkpoint is committed, and a retry only finishes the rest (the staging
        folder removed, ``latest.json``, the pruning).
        """
        staging = self._io.path(staging_uri)
        began = time.monotonic()
        placed: CommittedCheckpoint | None = None
        while True:
            try:
                if placed is None:
                    placed = self._place(staging, step, attempt, world_size, reported or {}, timing)
                    self._remember(placed)
                self._point(staging, placed, keep)
                return placed
            except OSError as exc:
                waited = time.monotonic() - began
                full = getattr(exc, "errno", None) == errno.ENOSPC
                if (self._io.local and not full) or waited >= COMMIT_RETRY_S:
                    where = self._io.show(self.root)
                    tried = f" (tried for {waited:.0f} s)" if waited >= 1 else ""
                    state = ("The previous committed checkpoint is still the latest." if placed is None else
                             "It is in place with its manifest, but latest.json may still name the previous one, "
                             "which a resume then loads.")
                    hint = (" Free space on the storage's device (old runs, other files), or set `storage` to a "
                            "larger volume." if full else "")
                    raise CheckpointError(f"could not commit the checkpoint of step {step} into {where}{tried}: "
                                          f"{exc}. {state}{hint}") from exc
                what = "no space left on the device" if full else str(exc)[:200]
                self._io.warn_once(f"raylaunch: committing the checkpoint of step {step} failed ({what}); trying "
                                   f"again for up to {COMMIT_RETRY_S:g} s")
                time.sleep(min(2.0 ** min(int(waited), 4), 5.0))

    def _place(self, staging: str, step: int, attempt: int, world_size: int, reported: dict[str, dict],
               timing: dict | None = None) -> CommittedCheckpoint:
        """Every rank's part checked, then the checkpoint in its place under ``checkpoints/`` with its manifest,
        whose presence is the commit."""
        self._flush()  # the metrics up to this checkpoint are on storage before it counts
        files = describe_files(self._io.fs, staging, reported)
        if missing := ranks_lacking(files, world_size):
            raise CheckpointError(
                f"checkpoint of step {step} lacks the part of ranks {missing} (random_states_<rank>.pkl, or a "
                "Trainer's rng_state_<rank>.pth); it was not committed"
            )
        if lacking := missing_shards(files, world_size):  # a sharded (FSDP) checkpoint needs every rank's shards
            raise CheckpointError(f"checkpoint of step {step} lacks {', '.join(lacking[:5])}; it was not committed")
        manifest = json.dumps({"step": step, "attempt": attempt, "world_size": world_size,
                               "created": time.time(), "files": files,
                               # how long the save held training, and from the save until this commit
                               **({"timing": timing} if timing else {})}, indent=1).encode()
        name = checkpoint_name(step)
        final = f"{self.root}/{name}"
        if self._io.fs.get_file_info(final).type != pafs.FileType.NotFound:
            # An older commit of the same step, from a previous attempt. latest.json must never name a folder that is
            # gone (a driver killed in between would leave a run that refuses to resume): first it names the newest
            # other committed checkpoint (or nothing), then the old folder goes.
            others = [c for c in self.committed() if c.name != name]
            pointer = f"{self.root}/{LATEST}"
            if others:
                self._io.write(pointer, json.dumps({"name": others[-1].name, "step": others[-1].step}).encode())
            elif self._io.fs.get_file_info(pointer).type != pafs.FileType.NotFound:
                self._io.fs.delete_file(pointer)
            self._io.fs.delete_dir(final)
        if self._io.local:
            # A folder rename is atomic: the checkpoint appears with its manifest.
            self._io.write(f"{staging}/{MANIFEST}", manifest)
            self._io.fs.move(staging, final)
        else:
            # Object stores cannot rename a folder: copy the files (server-side), then the
            # manifest, whose presence is the commit (a folder without one is never listed).
            for rel in files:
                self._io.fs.copy_file(f"{staging}/{rel}", f"{final}/{rel}")
            self._io.write(f"{final}/{MANIFEST}", manifest)
        return CommittedCheckpoint(step, self._io.uri(final), name, sum(int(m["size"]) for m in files.values()))

    def _point(self, staging: str, c: CommittedCheckpoint, keep: int) -> None:
        """After a commit (each part can be redone): its staging folder gone, ``latest.json`` naming it, the
        checkpoints beyond ``keep`` pruned."""
        if self._io.fs.get_file_info(staging).type != pafs.FileType.NotFound:  # an object store's copies' sources
            self._io.fs.delete_dir(staging)
        self._io.write(f"{self.root}/{LATEST}", json.dumps({"name": c.name, "step": c.step}).encode())
        self._prune(keep, latest=c.name)

    def committed(self) -> list[CommittedCheckpoint]:
        """Committed checkpoints, oldest first: real folders of ``checkpoints/`` whose manifest lists their files.

        A folder that is a symbolic link (to anywhere) or whose manifest lists no files was not committed by
        this run: it is never listed, counted, kept or loaded, and that is said once."""
        out = []
        for info in self._io.fs.get_file_info(pafs.FileSelector(self.root, allow_not_found=True)):
            base = info.base_name
            if info.type == pafs.FileType.Directory and is_checkpoint_name(base):
                if self._io.local and os.path.islink(info.path):
                    self._io.warn_once(f"raylaunch: {self._io.show(info.path)} is a symbolic link, not a folder this "
                                       "run committed; that checkpoint is ignored")
                    continue
                try:
                    manifest = self._io.read_json(f"{info.path}/{MANIFEST}")
                    step = int(manifest["step"]) if manifest is not None else None
                    if manifest is not None and not manifest.get("files"):
                        self._io.warn_once(f"raylaunch: {self._io.show(info.path)}/{MANIFEST} lists no files; "
                                           "that checkpoint is ignored")
                        continue
                except (ValueError, TypeError, KeyError):  # corrupted: as if never committed
                    self._io.warn_once(f"raylaunch: {self._io.show(info.path)}/{MANIFEST} cannot be read; that "
                                       "checkpoint is skipped")
                    continue
                if step is not None:
                    out.append(CommittedCheckpoint(step, self._io.uri(info.path), base))
        return sorted(out, key=lambda c: c.step)

    def latest(self) -> CommittedCheckpoint | None:
        try:
            pointer = self._io.read_json(f"{self.root}/{LATEST}")
            if pointer is not None and not isinstance(pointer.get("name"), str):
                raise ValueError("no 'name'")
        except (ValueError, AttributeError) as exc:
            committed = self.committed()
            self._io.warn_once(f"raylaunch: {self._io.show(self.root)}/{LATEST} cannot be read ({exc}); "
                               "using the newest committed checkpoint" + ("" if committed else ": there is none"))
            return committed[-1] if committed else None
        if pointer is None:
            return None
        committed = {c.name: c for c in self.committed()}
        if pointer["name"] not in committed:
            raise CheckpointError(
                f"{self._io.show(self.root)}/{LATEST} names {pointer['name']}, which is not a committed "
                "checkpoint in this run directory. Restore that folder, or start over with --fresh."
            )
        return committed[pointer["name"]]

    def verify(self, checkpoint: CommittedCheckpoint, hashes: bool = True) -> None:
        """Check every file against the manifest (``hashes`` False: all but their checksums); ``CheckpointError``
        names the first that differs."""
        path = self._io.path(checkpoint.uri)
        manifest = self._io.read_json(f"{path}/{MANIFEST}")
        if manifest is None:
            raise CheckpointError(f"{self._io.show(path)} has no {MANIFEST}")
        check_manifest(self._io.fs, path, manifest, self._io.show(path), hashes=hashes)

    def loadable(self, warn=print) -> CommittedCheckpoint | None:
        """The latest committed checkpoint whose files match its manifest; older ones if it does not.

        A checkpoint this catalogue committed, or already read in full, is not read again while its files are
        listed as they were then (each one's size and modification time); its manifest, its files, their sizes
        and the absence of links are checked all the same. A restart read every byte of the latest checkpoint
        before its ranks started (0.4 s of the 1.9 s from a rank killed to training again at 576 MiB a rank in
        ``make bench-recovery``; on an object store, a download of it), and the ranks read and check every byte
        once more as they load it (``cluster.checkpoint.restore.node_verified``), which refuses a file altered in
        place; the driver then ``forget``s, and the next restart reads them all."""
        latest = self.latest()
        if latest is None:
            return None
        for c in reversed([c for c in self.committed() if c.step <= latest.step]):
            try:
                known = c.name in self._known and self._known[c.name] == self._listing(c)
                self.verify(c, hashes=not known)  # (its files, their sizes, no link: checked either way)
                if not known:
                    self._remember(c)
                return c
            except CheckpointError as exc:
                warn(f"raylaunch: not loading {self._io.show(self._io.path(c.uri))}: {exc}; "
                     "trying the previous committed checkpoint")
        raise CheckpointError(
            f"no committed checkpoint in {self._io.show(self.root)} matches its manifest. Restore the "
            "files, or start over with --fresh."
        )

    def forget(self) -> None:
        """Check every checkpoint in full again at the next ``loadable``: an attempt failed before it trained (its
        ranks may have refused a file altered without its listing changing, which only reading it finds)."""
        self._known.clear()

    def _listing(self, c: CommittedCheckpoint) -> dict[str, tuple[int, int]] | None:
        """Each file of ``c`` (its manifest too) with its size and modification time; None where storage gives no
        time."""
        path = self._io.path(c.uri).rstrip("/")
        out = {}
        for info in self._io.fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True)):
            if info.type != pafs.FileType.Directory:
                if info.mtime_ns is None:
                    return None
                out[info.path[len(path) + 1:]] = (info.size, info.mtime_ns)
        return out

    def _remember(self, c: CommittedCheckpoint) -> None:
        try:
            listing = self._listing(c)
        except OSError:
            listing = None
        if listing is None:
            self._known.pop(c.name, None)
        else:
            self._known[c.name] = listing

    def _prune(self, keep: int, latest: str) -> None:
        """Keep the ``keep`` newest by step, and always the one just committed (``latest``): a script may save
        a step below one committed before (its folder names count something else)."""
        committed = [c for c in self.committed() if c.name != latest]
        for old in committed[: max(0, len(committed) - (keep - 1))]:
            self._io.fs.delete_dir(self._io.path(old.uri))
            self._known.pop(old.name, None)

    def files(self, checkpoint: CommittedCheckpoint) -> dict[str, dict]:
        """``{relative path: {"size", "sha256"}}`` from a committed checkpoint's manifest."""
        return self.manifest(checkpoint).get("files", {})

    def manifest(self, checkpoint: CommittedCheckpoint) -> dict:
        """A committed checkpoint's manifest: its step, attempt, files and (saves since issue 30) ``timing``."""
        return self._io.read_json(f"{self._io.path(checkpoint.uri)}/{MANIFEST}") or {}
