"""Storage I/O as every process of a run does it (driver, node actors, ranks): URIs, file hashes, the manifest check.

A storage URI may carry the filesystem's options in its query string
(``s3://bucket/runs?endpoint_override=host:port&scheme=http``), so every process
that opens a URI of the run reaches the same server; ``join_uri`` keeps that
query at the end when it adds path parts. Credentials stay out of URIs: each
process takes them from its node's environment (the AWS or GCP credential chain).

The manifest check lives here too, because both sides run it: the driver before
it hands a checkpoint to an attempt, and each rank before it unpickles anything
from that checkpoint.
"""

from __future__ import annotations

import os
import re
from typing import Any

from pyarrow import fs as pafs

from cluster.checksums import CHECKSUMS, hasher
from cluster.errors import RaylaunchError
from cluster.layout import MANIFEST

__all__ = [
    "CheckpointError", "check_manifest", "checksum", "describe_files", "is_local", "join_uri", "open_uri", "sha256",
    "split_query", "storage_credentials",
]




class CheckpointError(RaylaunchError, RuntimeError):
    """A checkpoint is incomplete or does not match its manifest."""


def split_query(uri: str) -> tuple[str, str]:
    """``("s3://b/p", "?endpoint_override=...")``; the query is ``""`` when there is none."""
    if "://" not in uri or "?" not in uri:
        return uri, ""
    base, query = uri.split("?", 1)
    return base, f"?{query}"


def join_uri(uri: str, *parts: str) -> str:
    """``uri`` with ``parts`` appended to its path, its query string kept at the end."""
    base, query = split_query(uri)
    return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)]) + query


def open_uri(uri: str) -> tuple[pafs.FileSystem, str]:
    """The filesystem and the path inside it; a plain path is a local one."""
    if "://" not in uri:
        return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(uri))
    return pafs.FileSystem.from_uri(uri)


def is_local(fs: pafs.FileSystem) -> bool:
    return isinstance(fs, pafs.LocalFileSystem)


def sha256(fs: pafs.FileSystem, path: str) -> str:
    return checksum(fs, path, "sha256")


def checksum(fs: pafs.FileSystem, path: str, kind: str) -> str:
    """The file's checksum of ``kind`` in hex: sha256, or a snapshot's (``cluster.checksums.CHECKSUMS``)."""
    h = hasher(kind)
    with fs.open_input_stream(path) as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def describe_files(fs: pafs.FileSystem, path: str, known: dict[str, dict] | None = None) -> dict[str, dict]:
    """``{relative path: {"size", "sha256"}}`` for every file under ``path``.

    ``known`` holds entries already computed elsewhere (a rank hashes its part on
    its own disk before uploading it); one whose size matches is taken as is, so
    a file on an object store is read back only when nobody reported it.
    """
    known = known or {}
    out = {}
    for info in fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True)):
        if info.type == pafs.FileType.File:
            rel = info.path[len(path.rstrip("/")) + 1 :]
            meta = known.get(rel)
            out[rel] = meta if meta and meta["size"] == info.size else {"size": info.size, "sha256": sha256(fs, info.path)}
    return out


def check_manifest(fs: pafs.FileSystem, path: str, manifest: Any, label: str, hashes: bool = True) -> None:
    """The folder holds exactly the files the manifest lists, each with its size and sha256 (a snapshot in memory's,
``"snapshot": true``, may carry xxh3 or crc32 instead: ``cluster.checksums.CHECKSUMS``; ``hashes`` False: all but
the checksums, which read every byte).

    Refused, with ``CheckpointError`` naming the file: a malformed manifest, a listed path that
    leads out of the folder, a file missing or changed, a file the manifest does not list, and
    on a local path a symbolic link (the folder itself or anything in it). ``label`` names the
    checkpoint in the error (its URI). A manifest is an integrity check, not a signature:
    whoever can write the storage can write a matching manifest too.
    """
    files = manifest.get("files") if isinstance(manifest, dict) else None
    snapshot = isinstance(manifest, dict) and manifest.get("snapshot") is True
    kinds = CHECKSUMS if snapshot else ("sha256",)
    if not isinstance(files, dict) or not all(
            isinstance(m, dict) and isinstance(m.get("size"), int) and any(isinstance(m.get(k), str) for k in kinds)
            for m in files.values()):
        raise CheckpointError(f"{label}/{MANIFEST} is malformed (no 'files' of size and {' or '.join(kinds)})")
    for rel in files:
        parts = str(rel).replace("\\", "/").split("/")
        if not rel or str(rel).startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise CheckpointError(f"{label}/{MANIFEST} lists {str(rel)[:200]!r}, a path leading out of the checkpoint")
    if is_local(fs):
        _refuse_links(path, label)
    present = {
        info.path[len(path.rstrip("/")) + 1:]
        for info in fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True))
        if info.type != pafs.FileType.Directory
    }
    extra = sorted(present - set(files) - {MANIFEST})
    if extra:
        raise CheckpointError(f"{label}/{extra[0]} is not listed in its manifest"
                              + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
    for rel, meta in files.items():
        info = fs.get_file_info(f"{path}/{rel}")
        if info.type == pafs.FileType.NotFound:
            raise CheckpointError(f"{label}/{rel} is missing (listed in its manifest)")
        if info.size != meta["size"]:
            raise CheckpointError(f"{label}/{rel} has {info.size} bytes; its manifest says {meta['size']}")
        kind = next(k for k in kinds if isinstance(meta.get(k), str))
        if hashes and checksum(fs, f"{path}/{rel}", kind) != meta[kind]:
            raise CheckpointError(f"{label}/{rel} does not match the checksum in its manifest")


def _refuse_links(path: str, label: str) -> None:
    """A checkpoint on a local path holds no symbolic link, and is none itself."""
    if os.path.islink(path.rstrip("/")):
        raise CheckpointError(f"{label} is a symbolic link; a committed checkpoint is a real folder")
    for root, dirs, names in os.walk(path, followlinks=False):
        for name in dirs + names:
            if os.path.islink(os.path.join(root, name)):
                rel = os.path.relpath(os.path.join(root, name), path)
                raise CheckpointError(f"{label}/{rel} is a symbolic link; a checkpoint holds only its own files")


# Query keys of a storage URI that carry a secret (pyarrow's S3 and GCS options, and
# what a user might try): refused, so the secret never lands in spec.yaml or a log.
_SECRET_QUERY = re.compile(r"(secret|password|passwd|token|credential|signature|access_?key|private)", re.I)


def storage_credentials(storage: str) -> str:
    """What in a storage URI is a credential (``"user:password@"``, ``"the query key 'secret_key'"``), or ''."""
    from urllib.parse import parse_qsl, urlsplit

    if "://" not in storage:
        return ""
    try:
        parts = urlsplit(storage)
        netloc = parts.netloc
    except ValueError:
        return ""
    found = []
    if "@" in netloc:
        found.append("a user:password@ part before the bucket")
    keys = sorted({k for k, _ in parse_qsl(parts.query, keep_blank_values=True) if _SECRET_QUERY.search(k)})
    found += [f"the query key {k!r}" for k in keys[:5]]
    return ", ".join(found)
