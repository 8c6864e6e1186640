"""A committed checkpoint made ready to load, once per node however many ranks it has.

Before, every rank hashed every file of the checkpoint (and on object storage downloaded all
of it), so a restore read world size x checkpoint size. Now the ranks of a node take turns on
a lock in the node's scratch folder: the first verifies the checkpoint against its manifest
(on object storage: downloads it into the scratch folder, then verifies the copy) and leaves a
marker; the others find the marker and load at once. Reads of the checkpoint for verification
(and downloads) scale with the number of nodes, not with the ranks on each node. The last rank
of the node to finish loading removes the downloaded copy and the marker.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
from pathlib import Path
from typing import Iterator

from pyarrow import fs as pafs

from cluster.layout import MANIFEST, RESUME, SCRIPT_FOLDER
from cluster.storage_io import CheckpointError, check_manifest, is_local, open_uri, split_query

__all__ = ["node_copy", "node_verified"]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def node_verified(uri: str, node_dir: str | Path, local_world_size: int) -> Iterator[tuple[str, dict]]:
    """The path to load the committed checkpoint at ``uri`` from, and its manifest, verified once on this node.

    ``node_dir`` is a folder only this node's ranks of this attempt use; ``local_world_size`` of
    them each enter this once. Raises ``CheckpointError`` on a manifest that cannot be read or a
    file that does not match it, in the rank that verified; the others then verify for themselves
    and fail the same way.
    """
    fs, path = open_uri(uri)
    name = path.rstrip("/").rsplit("/", 1)[-1]
    node_dir = Path(node_dir)
    lock, marker, done = (node_dir / f"restore-{name}.{ext}" for ext in ("lock", "ok", "done"))
    copy = node_dir / f"restore-{name}"
    with _locked(lock):
        if not marker.exists():
            if is_local(fs):
                manifest = _read_manifest(fs, path, uri)
                check_manifest(fs, path, manifest, path)
            else:
                shutil.rmtree(copy, ignore_errors=True)
                copy.mkdir(parents=True)
                try:
                    pafs.copy_files(path, str(copy), source_filesystem=fs,
                                    destination_filesystem=pafs.LocalFileSystem())
                except OSError as exc:
                    raise CheckpointError(f"{split_query(uri)[0]} cannot be downloaded: {str(exc)[:200]}") from None
                manifest = _read_manifest(pafs.LocalFileSystem(), str(copy), uri)
                check_manifest(pafs.LocalFileSystem(), str(copy), manifest, split_query(uri)[0])
            marker.write_text(json.dumps(manifest))  # node-local: the other ranks read it from here
        manifest = json.loads(marker.read_text())
    try:
        yield (path if is_local(fs) else str(copy)), manifest
    finally:
        with _locked(lock):
            with open(done, "a") as f:
                f.write("x")
            if done.stat().st_size >= local_world_size:  # the node's last rank: the round is over
                shutil.rmtree(copy, ignore_errors=True)
                marker.unlink(missing_ok=True)  # a later restore verifies again
                done.unlink()


def node_copy(uri: str, node_dir: str | Path, local_world_size: int) -> tuple[str, dict]:
    """The committed checkpoint at ``uri``, verified, copied once per node into a folder the ranks of a script
    are handed (``--resume_from_checkpoint``); it has the name the script gave ``save_state``. Returns the
    folder and the manifest.

    A copy, not the checkpoint itself: the script may write into the folder it resumed from. The copy lives
    in the node's scratch folder (``resume/<attempt>/<name>``); an earlier attempt's copy is removed.
    """
    node_dir = Path(node_dir)
    with node_verified(uri, node_dir, local_world_size) as (ready, manifest):
        label = Path(ready, SCRIPT_FOLDER)
        name = Path(json.loads(label.read_text())["folder"] if label.is_file() else ready).name
        resume = node_dir.parent / RESUME
        folder = resume / node_dir.name / name
        with _locked(node_dir / "resume.lock"):
            if not folder.is_dir():
                if resume.is_dir():
                    for old in resume.iterdir():
                        if old.name != node_dir.name:
                            shutil.rmtree(old, ignore_errors=True)
                partial = folder.with_name(f".{name}.partial")
                shutil.rmtree(partial, ignore_errors=True)
                # From a download (removed once the node's ranks loaded it) links are enough; from the
                # committed checkpoint itself, copies: the script may write into the folder it was given.
                downloaded = not is_local(open_uri(uri)[0])
                shutil.copytree(ready, partial, copy_function=os.link if downloaded else shutil.copy2)
                partial.rename(folder)
    return str(folder), manifest


def _read_manifest(fs: pafs.FileSystem, path: str, uri: str) -> dict:
    try:
        with fs.open_input_stream(f"{path}/{MANIFEST}") as f:
            return json.loads(f.read())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{split_query(uri)[0]}/{MANIFEST} cannot be read: {str(exc)[:200]}") from None
