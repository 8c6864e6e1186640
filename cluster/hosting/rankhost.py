"""Warm rank hosts: one process per Ray node and Python environment, with torch, Accelerate and transformers
imported, that the ranks of every job on that node fork from.

A job's node actor claims the host that matches its environment (``claim``) or starts it, and its ranks are
forked there instead of by a fork server the actor starts and preloads itself: on a cluster that stays up, the
second job on a node starts without importing torch again. The host outlives the job; it ends when its node's
raylet ends, when it has had no rank and no claim for its idle time (``env.warm_host_idle_s``), when the
packages it imported change on disk, or to make room for a newer host (at most ``MAX_HOSTS`` a node).

What a job cannot share is never in the host. The host is keyed (``host_key``) by the Python executable, the
search path outside any job's own folders, the packages installed there (each distribution's name, version and
modification time), raylaunch's own code, and the variables that change what those imports do (``HF_*``,
``TORCH*``, ...): a job whose key differs gets a host of its own, so a host is never reused after the cluster's
packages change. The host's own environment holds none of a job's variables or secrets; each rank gets its
job's whole environment, its working folder and its search path when it starts (``cluster.hosting.forkserver``), and
imports the job's modules itself. A job whose own folders (working directory, ``py_modules``) hold a module
the host has imported (a project with its own ``yaml.py``, or its own ``cluster`` package) does not use a host:
its ranks would see the host's module instead of its own; unless that module's source is the host's to the byte
(a job run from raylaunch's own checkout, whose working directory holds the very ``cluster`` package the host
imported). Nor does a job with ``env.pip``: its Python is the
job's own.

The host is multiprocessing's fork server (``multiprocessing.forkserver.main``) on a socket of its own, so ranks
are started, watched and reaped exactly as from the fork server an actor starts.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from cluster.hosting.hostproc import (KEY_VARS, PROJECT_VAR, alive_pid, busy, host_key, job_specific, locked, mtime,
                                      pid_namespace, project_dirs, rss_mb, shared_path, source_digest, stat_fields)

__all__ = ["Claim", "MAX_HOSTS", "PROJECT_VAR", "WarmHost", "alive", "claim", "host_key", "ready", "rss_mb",
           "starting", "unclaim"]


MAX_HOSTS = 2  # warm hosts a node keeps at most; a newer one ends the least recently claimed idle one


_STARTING_S = 60.0  # a host folder without a live host is left alone this long: its host may be starting


START_HUNG_S = 120.0  # a start of ranks a host has not answered in this long hung (one takes milliseconds)


# What the host keeps of the claiming actor's environment beside those: nothing of a job's own.
_HOST_VARS = {"PATH", "HOME", "USER", "LOGNAME", "LANG", "TMPDIR", "TZ", "SHELL"}


@dataclass(frozen=True)
class WarmHost:
    """The spec's ``env.warm_host`` and ``env.warm_host_idle_s``."""

    enabled: bool = True
    idle_s: float = 600.0


@dataclass(frozen=True)
class Claim:
    """What a node actor got: a host's socket (``address``), or None and why not (``note``)."""

    address: str | None
    pid: int | None
    folder: str | None
    note: str


def _base() -> Path:
    """The hosts' folders of this user and PID namespace: a host's pid means nothing in another namespace, where
    a claim could take an unrelated process for a live host (nodes in PID namespaces of their own that share a
    temporary folder, as the tests' namespace hosts do)."""
    base = Path(tempfile.gettempdir()) / f"raylaunch-hosts-{os.getuid()}-{pid_namespace()}"
    base.mkdir(mode=0o700, exist_ok=True)
    return base


def _raylet() -> str | None:
    """The raylet this process descends from (a Ray worker's), as a host is tied to it: ``<pid>.<start time>``
    (a pid alone may be reused); None outside Ray."""
    pid = os.getpid()
    for _ in range(12):
        fields = stat_fields(pid)
        if fields is None:
            break
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == "raylet":
                return f"{pid}.{fields[19]}"
        except OSError:
            break
        pid = int(fields[1])
        if pid <= 1:
            break
    return None


def _host_pid(folder: Path) -> int | None:
    try:
        pid = int((folder / "pid").read_text())
    except (OSError, ValueError):
        return None
    return pid if alive_pid(pid) else None


def _tidy(base: Path, prefix: str) -> None:
    """Remove the folders of hosts that ended without removing theirs (a minute after their last change: a
    host being started has none yet), and make room for one more host on this node: the least recently
    claimed idle hosts beyond ``MAX_HOSTS - 1`` are asked to end (they do within seconds)."""
    live = []
    for folder in base.iterdir():
        pid = _host_pid(folder)
        if pid is None:
            if time.time() - mtime(folder) > _STARTING_S:
                with locked(folder, wait=False) as mine:
                    if mine and _host_pid(folder) is None:
                        shutil.rmtree(folder, ignore_errors=True)
        elif folder.name.startswith(prefix):
            live.append((mtime(folder / "claimed"), folder, pid))
    for _, folder, pid in sorted(live)[:max(0, len(live) - (MAX_HOSTS - 1))]:
        if not busy(folder, pid):
            (folder / "evict").touch()


def claim(settings: WarmHost, preload: list[str]) -> Claim:
    """The warm host this actor's ranks fork from (started now when there is none), or why there is none."""
    if not settings.enabled:
        return Claim(None, None, None, "env.warm_host is false")
    raylet = _raylet()
    if raylet is None:
        return Claim(None, None, None, "not in a Ray worker process")
    if os.environ.get(PROJECT_VAR):  # the nodes `raylaunch run` started for this command end with it
        return Claim(None, None, None, "local nodes end with the command: no host to keep warm")
    if "runtime_resources" in sys.executable:
        return Claim(None, None, None, "the job has Python packages of its own (env.pip)")
    key = host_key()
    base = _base()
    folder = base / f"a{raylet}-{key[:16]}"  # the host tied to this node's raylet
    prefix = f"a{raylet}-"
    replaced = ""
    with locked(folder):
        pid = _host_pid(folder)
        hung = _hung_start(folder) if pid is not None else None
        if hung is not None:  # a start it never answered: not trusted with this job's ranks
            _kill(pid)
            replaced = f" in place of host {pid}, which left the start of process {hung}'s ranks unanswered"
            pid = None
        reused = pid is not None
        if not reused:
            _tidy(base, prefix)
            for name in ("ready", "sock", "pid", "evict"):
                (folder / name).unlink(missing_ok=True)
            shutil.rmtree(folder / "starts", ignore_errors=True)
            _spawn({"folder": str(folder), "anchor": raylet, "key": key, "preload": preload,
                    "sys_path": shared_path(sys.path)}, os.environ)
            _wait_for(lambda: _host_pid(folder) is not None, 30.0)  # it writes its pid once it has left us
            pid = _host_pid(folder)
        (folder / "claimed").write_text(str(settings.idle_s))  # the idle clock, and the idle time a host keeps
        (folder / "claims").mkdir(exist_ok=True)
        (folder / "claims" / str(os.getpid())).touch()  # held until ``unclaim``, or until this process ends
    if pid is None:
        return Claim(None, None, None, f"the warm rank host did not start (see {folder / 'host.log'})")
    _wait_for(lambda: (folder / "sock").exists() or not alive_pid(pid), 30.0)
    said = "started" if not reused else "reused" if (folder / "ready").exists() else "claimed while it imports"
    return Claim(str(folder / "sock"), pid, str(folder), f"warm rank host {pid}, {said}{replaced}")


def _hung_start(folder: Path) -> int | None:
    """The process whose start of ranks this host left unanswered (``starting``), if one did: its mark outlived it
    (the driver ends a node whose start outlasts the rendezvous bound), or is older than ``START_HUNG_S``. A start
    under way elsewhere (milliseconds) is waited for."""
    while True:
        try:
            marks = list((folder / "starts").iterdir())
        except OSError:
            return None
        pending = False
        for mark in marks:
            age = time.time() - mtime(mark)
            if not mark.name.isdigit() or age > 1e6:  # not ours, or gone meanwhile (answered)
                continue
            if age > START_HUNG_S or not alive_pid(int(mark.name)):
                return int(mark.name)
            pending = True
        if not pending:
            return None
        time.sleep(0.05)


def _kill(pid: int) -> None:
    """End a host that hung (its ranks, which hold their own actors' pipes, are left to those)."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    _wait_for(lambda: not alive_pid(pid), 10.0)


@contextmanager
def starting(found: Claim) -> Iterator[None]:
    """Around a start of ranks from the host: a mark this process removes once the host has answered (or
    failed to). A mark left by a process that ended while it waited (the driver ends a node whose start outlasts
    the rendezvous bound) is a start the host never answered: the next claim ends that host and starts another
    (``claim``)."""
    mark = Path(found.folder, "starts", str(os.getpid()))
    try:
        mark.parent.mkdir(exist_ok=True)
        mark.touch()
    except OSError:  # the host ended and removed its folder: the start fails on its socket
        pass
    try:
        yield
    except BaseException as exc:
        # Ending the actor while it waits (the driver does, after the rendezvous bound) comes as SystemExit, or as
        # torch's SignalException from the SIGTERM its launcher turns into one: the mark stays. Any other
        # failure is the host's answer (it ended: its socket refused or closed) or the start's own.
        if isinstance(exc, Exception) and type(exc).__name__ != "SignalException":
            mark.unlink(missing_ok=True)
        raise
    mark.unlink(missing_ok=True)


def _spawn(args: dict, environ: dict) -> None:
    """Start a host: it forks itself away (``_detach``), so it is not the caller's child, which Ray would end with
    the caller; its environment keeps none of a job's own variables."""
    env = {k: v for k, v in environ.items() if k in _HOST_VARS or k.startswith("LC_") or KEY_VARS.match(k)}
    env["PYTHONPATH"] = os.pathsep.join(args["sys_path"])
    proc = subprocess.Popen([sys.executable, "-m", "cluster.hosting.hostproc", json.dumps(args)], env=env, cwd="/",
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    proc.wait(timeout=60)


def alive(found: Claim) -> bool:
    """The claimed host still runs, in its folder."""
    return found.pid is not None and alive_pid(found.pid) and Path(found.folder, "ready").exists()


def unclaim(found: Claim) -> None:
    """This process's ranks are done with the host: its idle clock starts (it stays warm for the next job)."""
    try:
        Path(found.folder, "claims", str(os.getpid())).unlink(missing_ok=True)
        Path(found.folder, "claimed").touch()
    except OSError:  # it ended and removed its folder
        pass


def _wait_for(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def _same_source(entry: str, name: str, host_file: str) -> bool:
    """Whether the job's module ``name`` in the folder ``entry`` is the source the host imported from
    ``host_file``, to the byte (a compiled or namespace module never is)."""
    host = Path(host_file)
    if not host_file or host.suffix != ".py":
        return False
    if host.name == "__init__.py":
        theirs, ours = source_digest(host.parent), source_digest(Path(entry, name))
    else:
        theirs, ours = source_digest(host), source_digest(Path(entry, f"{name}.py"))
    return theirs is not None and theirs == ours


def ready(found: Claim, timeout_s: float = 600.0) -> str | None:
    """Wait for a claimed host to finish its imports: None once it serves, else why it cannot be used.

    It checks the job's own folders hold no module the host imported (they would be shadowed)."""
    folder = Path(found.folder)
    _wait_for(lambda: (folder / "ready").exists() or not alive_pid(found.pid), timeout_s)
    if not (folder / "ready").exists():
        return f"the warm rank host {found.pid} ended before it was ready (see {folder / 'host.log'})"
    loaded = json.loads((folder / "ready").read_text())
    shadowed = set()
    for entry in (p for p in sys.path if job_specific(p, project_dirs()) and p not in ("", ".")):
        try:
            names = [e.name[:-3] if e.name.endswith(".py") else e.name for e in os.scandir(entry)
                     if e.name.endswith(".py") or (e.is_dir() and e.name.isidentifier())]
        except OSError:
            continue
        # a module the host imported from this very folder is the job's own too (the runner's checkout), and so
        # is one whose source here is the host's to the byte (a job run from a copy of raylaunch's checkout,
        # whose working directory holds raylaunch's own ``cluster`` package)
        shadowed.update(n for n in names if n in loaded and not loaded[n].startswith(entry.rstrip(os.sep) + os.sep)
                        and not _same_source(entry, n, loaded[n]))
    shadowed = sorted(shadowed)
    if shadowed:
        return (f"the job's own folders hold modules the warm rank host imported ({', '.join(shadowed[:5])}): "
                "its ranks import their own instead")
    return None
