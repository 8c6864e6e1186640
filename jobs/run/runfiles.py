"""How a run directory's files are reached on its storage: a path inside the filesystem and the URI a node or a
rank opens, a message's spelling of it, a file written whole, a JSON file read, a damaged file said once.

``jobs.run.storage.RunDir`` and its checkpoint catalogue (``jobs.run.checkpoints``) share one ``RunFiles``.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import sys
from typing import Any

from pyarrow import fs as pafs

from cluster.storage_io import is_local, split_query

__all__ = ["RunFiles"]


class RunFiles:
    """One storage's filesystem (``fs``), and the rules of its paths and writes."""

    def __init__(self, fs: pafs.FileSystem, storage: str) -> None:
        self.fs = fs
        self.local = is_local(fs)
        self._scheme = "" if self.local else storage.split("://", 1)[0]
        # Filesystem options (endpoint_override=..., scheme=...) travel with every URI
        # handed to node actors and ranks, so they open the same store.
        self._query = split_query(storage)[1]
        self._warned: set[str] = set()  # damaged files already said (see warn_once)

    def uri(self, path: str) -> str:
        """What a node or a rank opens for ``path``: on an object store with the storage's query string."""
        return path if self.local else f"{self._scheme}://{path}{self._query}"

    def path(self, uri: str) -> str:
        """The inverse of ``uri``: the path inside ``fs``."""
        return uri if self.local else split_query(uri)[0].split("://", 1)[1]

    def show(self, path: str) -> str:
        """A path as messages show it: the URI without its query string."""
        return path if self.local else f"{self._scheme}://{path}"

    def write(self, path: str, data: bytes) -> None:
        """Readers never see half a file: a temporary name and a rename on POSIX; on an
        object store one PUT, which readers see whole or not at all."""
        if not self.local:
            with self.fs.open_output_stream(path) as f:
                f.write(data)
            return
        tmp = f"{path}.tmp-{secrets.token_hex(4)}"
        try:
            with self.fs.open_output_stream(tmp) as f:
                f.write(data)
            self.fs.move(tmp, path)
        except OSError:  # a full disk, say: no half-written file left beside the real one
            with contextlib.suppress(OSError):
                self.fs.delete_file(tmp)
            raise

    def read_json(self, path: str) -> Any:
        """The JSON object of ``path``; None when there is no such file (``ValueError`` when it is not JSON)."""
        try:
            with self.fs.open_input_stream(path) as f:
                return json.loads(f.read())
        except FileNotFoundError:
            return None

    def warn_once(self, text: str) -> None:
        """A damaged file of the run is said once on stderr, and what depends on it goes on without it."""
        if text not in self._warned:
            self._warned.add(text)
            print(text, file=sys.stderr, flush=True)
