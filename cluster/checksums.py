"""The checksums of checkpoint files: sha256 for what is committed (the manifest's contract), xxh3 for a snapshot in
memory's (``SNAPSHOT_CHECKSUM``), crc32 still read. Imports nothing but the standard library and xxhash: the writer
process (``cluster.checkpoint.writer``) loads it too."""

from __future__ import annotations

from typing import Any

__all__ = ["CHECKSUMS", "SNAPSHOT_CHECKSUM", "checksum_kind", "hasher"]

# The checksums a file's entry may carry (``{"size", <kind>: hex}``). Committed checkpoints are always sha256 (their
# manifest's contract); a snapshot in memory, which never leaves the nodes' memory, carries xxh3 (XXH3-64): it still
# finds a file cut short or changed by accident, which is what a restore's check is for, for a fraction of the CPU
# (measured here over 16.8 MB: CRC-32 4.3 ms, xxh3 0.6 ms; over 576 MiB: sha256 0.33 s with the CPU's SHA extensions,
# CRC-32 0.14 s; a snapshot's writes run on cores training wants, #58). crc32: what snapshots carried before, still
# verified.
CHECKSUMS = ("sha256", "crc32", "xxh3")
SNAPSHOT_CHECKSUM = "xxh3"


class _Crc32:
    def __init__(self) -> None:
        self.crc = 0

    def update(self, data: Any) -> None:
        import zlib

        self.crc = zlib.crc32(data, self.crc)

    def hexdigest(self) -> str:
        return f"{self.crc:08x}"


def hasher(kind: str) -> Any:
    """A new hash of one of ``CHECKSUMS``: ``update(bytes)``, then ``hexdigest()``.

    >>> import zlib; h = hasher("crc32"); h.update(b"raylaunch"); h.hexdigest() == f"{zlib.crc32(b'raylaunch'):08x}"
    True
    >>> import xxhash; h = hasher("xxh3"); h.update(b"ray"); h.update(b"launch")
    >>> h.hexdigest() == xxhash.xxh3_64_hexdigest(b"raylaunch")
    True
    """
    if kind == "sha256":
        import hashlib

        return hashlib.sha256()
    if kind == "crc32":
        return _Crc32()
    if kind == "xxh3":
        import xxhash

        return xxhash.xxh3_64()
    raise ValueError(f"unknown checksum {kind!r} (one of {', '.join(CHECKSUMS)})")


def checksum_kind(meta: dict) -> str | None:
    """Which of ``CHECKSUMS`` a file's entry (``{"size", <kind>: hex}``) carries; None when none."""
    return next((k for k in CHECKSUMS if isinstance(meta.get(k), str)), None)
