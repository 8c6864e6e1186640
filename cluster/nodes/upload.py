"""What a job's code upload holds: one plan for every path that ships the working directory.

``raylaunch run --address`` (``ray.init(runtime_env={"working_dir": ...})``) and
``raylaunch submit`` (Ray Jobs) upload the working directory; both build an
``UploadPlan`` first, check its size before anything is packaged, and hand Ray
the plan's exclusions. ``UPLOAD_EXCLUDES`` is the one list of patterns (the
cluster files' ``rsync_exclude`` follow it); the plan adds what it finds in
this folder: the run storage, Ray's temporary folders, and ``!`` lines of the
root ``.rayignore`` (how a user includes a secret file on purpose)::

    >>> "id_rsa" in UPLOAD_EXCLUDES and ".env" in SECRET_PATTERNS
    True
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import cluster
from cluster.errors import RaylaunchError

__all__ = ["RUNNER_ROOT", "SECRET_PATTERNS", "UPLOAD_EXCLUDES", "UploadError", "UploadPlan", "plan_upload"]

# Files that hold credentials: never uploaded unless the root .rayignore re-includes one
# with a `!` line (gitignore syntax, e.g. `!deploy.pem`).
SECRET_PATTERNS = [
    ".env", ".env.*",                                     # dotenv files
    "id_rsa", "id_dsa", "id_ecdsa", "id_ed25519",         # SSH private keys
    "*.pem", "*.key", "*.p12", "*.pfx",                   # TLS and other private keys
    ".aws", ".ssh", ".gnupg", ".azure", "gcloud", ".kube", ".docker",  # folders of credentials
    ".netrc", ".pypirc", ".git-credentials",
    "application_default_credentials.json", "credentials.json", "service-account*.json",
    "auth_token", ".ray",                                 # Ray's token file (~/.ray/auth_token)
]

# Everything a job's code upload leaves out, besides what .gitignore and .rayignore name.
# The one list: `.rsync-filter` (what `ray up` copies with cluster.yaml and cluster.onprem.yaml)
# holds the same lines, and a test keeps the two equal.
UPLOAD_EXCLUDES = [
    ".git", ".venv", "venv", "**/__pycache__", "*.pyc", ".pytest_cache", ".mypy_cache",
    ".ruff_cache", "raylaunch-local", "runs", "*.egg-info",
    *SECRET_PATTERNS,
]

# A folder holding these is a Ray temporary folder (`ray start --temp-dir`, /tmp/ray):
# zipping it while Ray writes into it once filled a disk (78 GB).
_RAY_TEMP_MARKERS = ("session_latest", "ray_current_cluster")
_RAY_SESSION = re.compile(r"session_\d{4}-\d\d-\d\d_")
_RUNNER_PACKAGES = ("cluster", "jobs", "train_fn")
RUNNER_ROOT = Path(cluster.__file__).resolve().parents[1]  # the folder holding raylaunch's own packages
# Over this many times the limit uncompressed, the folder is refused without zipping it.
_ZIP_CHECK_FACTOR = 8


class UploadError(RaylaunchError, ValueError):
    """A working directory that cannot be uploaded, with what to leave out."""

    exit_code = 2


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _upload_limit() -> int:
    # The dashboard refuses larger request bodies with HTTP 413 (ray#45602).
    from ray._private import ray_constants

    return int(ray_constants.DASHBOARD_CLIENT_MAX_SIZE)


def _quiet() -> logging.Logger:
    log = logging.getLogger("raylaunch.upload")
    log.setLevel(logging.WARNING)
    return log


@dataclass(frozen=True)
class UploadPlan:
    """The files Ray will upload from ``root`` and the exclusions that say so."""

    root: str
    files: int
    bytes: int
    largest: list[tuple[str, int]]  # (top-level file or folder, bytes), biggest first
    limit: int
    excludes: list[str]  # UPLOAD_EXCLUDES, then what this folder adds: give these to Ray
    secrets: list[str] = field(default_factory=list)  # left out as secret (relative paths)
    left_out: list[str] = field(default_factory=list)  # run storage and Ray temporary folders

    def runtime_env(self) -> dict:
        """The ``working_dir`` part of a Ray runtime environment."""
        return {"working_dir": self.root, "excludes": list(self.excludes)}

    def check(self) -> None:
        """Raise ``UploadError`` if the upload is over Ray's limit (zipping only when it may fit)."""
        if self.bytes <= self.limit:
            return
        size, how = self.bytes, "before compression"
        if self.bytes <= _ZIP_CHECK_FACTOR * self.limit:
            size, how = self._zipped_size(), "compressed"
            if size <= self.limit:
                return
        biggest = ", ".join(f"{p} ({_mib(s)})" for p, s in self.largest)
        raise UploadError(
            f"the working directory {self.root} is {_mib(size)} {how}, over Ray's upload limit of "
            f"{_mib(self.limit)}. Largest: {biggest}. Name what the job does not need in .rayignore "
            "(or .gitignore), or put data on shared storage."
        )

    def describe(self) -> list[str]:
        """Lines for ``--dry-run``: the size, the largest parts, what is left out and why."""
        lines = [f"working dir:   {self.root} ({self.files} files, {_mib(self.bytes)} before compression; "
                 f"limit {_mib(self.limit)})"]
        if self.largest:
            lines.append("largest:       " + ", ".join(f"{p} ({_mib(s)})" for p, s in self.largest))
        if self.secrets:
            lines.append(f"left out as secret ({len(self.secrets)}; a `!` line in .rayignore includes one): "
                         + ", ".join(self.secrets[:20]) + (" ..." if len(self.secrets) > 20 else ""))
        if self.left_out:
            lines.append("left out:      " + ", ".join(self.left_out))
        return lines

    def _zipped_size(self) -> int:
        from ray._private.runtime_env.packaging import _zip_files

        with tempfile.TemporaryDirectory() as tmp:  # outside the folder being zipped
            out = os.path.join(tmp, "pkg.zip")
            _zip_files(self.root, list(self.excludes), out, include_gitignore=True, logger=_quiet())
            return os.path.getsize(out)


def _anchored(rel: str) -> str:
    """A gitignore pattern for exactly this path under the root (and all below it)."""
    return "/" + re.sub(r"([*?\[\]!#\\])", r"\\\1", rel.replace(os.sep, "/"))


def _is_ray_temp(path: Path) -> bool:
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return any(m in names for m in _RAY_TEMP_MARKERS) or any(_RAY_SESSION.match(n) for n in names) \
        or bool(_RAY_SESSION.match(path.name))


def _reincluded(root: Path) -> list[str]:
    """``!`` lines of the root .rayignore: what the user includes on purpose."""
    try:
        lines = (root / ".rayignore").read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return []
    return [line.strip() for line in lines if line.strip().startswith("!")]


def plan_upload(root: str | Path, storage: str | None = None) -> UploadPlan:
    """The files Ray would upload from ``root``: its own rules (.gitignore, .rayignore) plus ours.

    ``storage``, when it is a local path inside ``root``, is left out too. Reads
    file sizes only; packages nothing.
    """
    from ray._private.runtime_env.packaging import _dir_travel, _get_excludes

    root = Path(root).resolve()
    dynamic: list[str] = []
    left_out: list[str] = []
    if storage and "://" not in storage:
        store = Path(os.path.expanduser(storage)).resolve()
        if store != root and store.is_relative_to(root):
            rel = str(store.relative_to(root))
            dynamic.append(_anchored(rel))
            left_out.append(f"{rel}/ (the run storage)")
    if root != RUNNER_ROOT:
        # A project's own folder named like one of the runner's packages would hide it on
        # the nodes (Ray puts the uploaded folder first on their path).
        for name in _RUNNER_PACKAGES:
            if (root / name).exists():
                dynamic.append(_anchored(name))
                left_out.append(f"{name} (named like raylaunch's own package, which it would hide on the nodes)")
    reinclude = _reincluded(root)
    secret_match = _get_excludes(root, [*SECRET_PATTERNS, *reinclude])
    other_match = _get_excludes(root, [*UPLOAD_EXCLUDES, *dynamic, *reinclude])
    temps: list[str] = []
    secrets: list[str] = []

    def excluded(path: Path) -> bool:
        if path == root:
            return False
        rel = str(path.relative_to(root))
        if path.is_dir() and not path.is_symlink() and _is_ray_temp(path):
            temps.append(rel)
            return True
        if secret_match(path):
            secrets.append(rel + ("/" if path.is_dir() else ""))
            return True
        return other_match(path)

    sizes: dict[str, int] = {}

    def handler(path: Path) -> None:
        if path.is_file():
            sizes[str(path.relative_to(root))] = path.stat().st_size

    _dir_travel(root, [excluded], handler, include_gitignore=True, logger=_quiet())
    for rel in temps:
        dynamic.append(_anchored(rel))
        left_out.append(f"{rel}/ (a Ray temporary folder)")
    # Group the largest by top-level folder too: a data folder is one line, not a thousand.
    by_top: dict[str, int] = {}
    for rel, size in sizes.items():
        top = rel.split(os.sep, 1)[0] + ("/" if os.sep in rel else "")
        by_top[top] = by_top.get(top, 0) + size
    largest = sorted(by_top.items(), key=lambda kv: -kv[1])[:5]
    return UploadPlan(
        root=str(root), files=len(sizes), bytes=sum(sizes.values()), largest=largest, limit=_upload_limit(),
        excludes=[*UPLOAD_EXCLUDES, *dynamic, *reinclude], secrets=sorted(secrets), left_out=left_out,
    )
