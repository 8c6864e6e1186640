"""Storage as every process of a run opens it: the driver, the node actors and the ranks.

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

import hashlib
import os

from pyarrow import fs as pafs

__all__ = [
    "MANIFEST", "CheckpointError", "check_manifest", "describe_files", "is_local", "join_uri", "open_uri", "sha256",
    "split_query",
]


# Written last into a checkpoint: every file with its size and sha256; its presence is the commit.
MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
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
    h = hashlib.sha256()
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


def check_manifest(fs: pafs.FileSystem, path: str, manifest: dict, label: str) -> None:
    """Every file the manifest lists is in ``path`` with its size and sha256.

    ``label`` names the checkpoint in the error (its URI); the error names the
    first file that differs.
    """
    for rel, meta in manifest["files"].items():
        info = fs.get_file_info(f"{path}/{rel}")
        if info.type == pafs.FileType.NotFound:
            raise CheckpointError(f"{label}/{rel} is missing (listed in its manifest)")
        if info.size != meta["size"]:
            raise CheckpointError(f"{label}/{rel} has {info.size} bytes; its manifest says {meta['size']}")
        if sha256(fs, f"{path}/{rel}") != meta["sha256"]:
            raise CheckpointError(f"{label}/{rel} does not match the checksum in its manifest")
