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
job's whole environment, its working folder and its search path when it starts (``cluster.forkserver``), and
imports the job's modules itself. A job whose own folders (working directory, ``py_modules``) hold a module
the host has imported (a project with its own ``yaml.py``, or its own ``cluster`` package) does not use a host:
its ranks would see the host's module instead of its own. Nor does a job with ``env.pip``: its Python is the
job's own.

The host is multiprocessing's fork server (``multiprocessing.forkserver.main``) on a socket of its own, so ranks
are started, watched and reaped exactly as from the fork server an actor starts.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Claim", "MAX_HOSTS", "WarmHost", "alive", "claim", "host_key", "ready", "rss_mb", "unclaim"]

MAX_HOSTS = 2  # warm hosts a node keeps at most; a newer one ends the least recently claimed idle one
_STARTING_S = 60.0  # a host folder without a live host is left alone this long: its host may be starting
_KEY_CHECK_S = 10.0  # how often a host checks its packages are still the ones it imported
# Variables that change what the host's imports do, or where they come from: part of the key.
_KEY_VARS = re.compile(r"^(HF_|HUGGINGFACE_|TRANSFORMERS_|ACCELERATE_|TOKENIZERS_|TORCH|PYTORCH_|MKL_|KMP_|"
                       r"LD_PRELOAD$|LD_LIBRARY_PATH$|CUDA_HOME$|PYTHONHASHSEED$|PYTHONNOUSERSITE$)")
# What the host keeps of the claiming actor's environment beside those: nothing of a job's own.
_HOST_VARS = {"PATH", "HOME", "USER", "LOGNAME", "LANG", "TMPDIR", "TZ", "SHELL"}
_RAYLAUNCH = Path(__file__).resolve().parent  # the runner's own code, which ranks run from the host


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
    reused: bool
    note: str


def _job_specific(entry: str, cwd: str) -> bool:
    """A search-path entry that is one job's own: its working directory, its ``py_modules``."""
    return entry in ("", ".", cwd) or "runtime_resources" in entry or entry.startswith(cwd + os.sep)


def _shared_path(sys_path: list[str]) -> list[str]:
    cwd = os.getcwd()
    return [p for p in sys_path if not _job_specific(p, cwd)]


def _code_digest() -> str:
    h = hashlib.sha256()
    for path in sorted(_RAYLAUNCH.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def _distributions(entry: str) -> list[tuple[str, int]]:
    """The packages installed in a search-path folder, with their modification times."""
    out = []
    try:
        with os.scandir(entry) as it:
            for e in it:
                if e.name.endswith((".dist-info", ".egg-info", ".egg-link", ".pth")):
                    try:
                        out.append((e.name, e.stat().st_mtime_ns))
                    except OSError:
                        pass
    except OSError:
        pass
    return sorted(out)


def host_key(sys_path: list[str] | None = None, environ: dict | None = None) -> str:
    """The key of the host a process with this search path and environment may fork its ranks from."""
    shared = _shared_path(sys.path if sys_path is None else sys_path)
    env = os.environ if environ is None else environ
    facts = {
        "python": [sys.executable, sys.version],
        "path": shared,
        "dists": {p: _distributions(p) for p in shared},
        "vars": {k: v for k, v in sorted(env.items()) if _KEY_VARS.match(k)},
        "raylaunch": _code_digest(),
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()


def _base() -> Path:
    base = Path(tempfile.gettempdir()) / f"raylaunch-hosts-{os.getuid()}"
    base.mkdir(mode=0o700, exist_ok=True)
    return base


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, ...


def _raylet() -> tuple[int, str] | None:
    """The pid and start time of the raylet this process descends from (a Ray worker's), or None."""
    pid = os.getpid()
    for _ in range(8):
        fields = _stat(pid)
        if fields is None:
            return None
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            return None
        if comm == "raylet":
            return pid, fields[19]
        pid = int(fields[1])
        if pid <= 1:
            return None
    return None


def _alive(pid: int, started: str | None = None) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X") and (started is None or fields[19] == started)


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def rss_mb(pid: int) -> float | None:
    """A process's resident memory in MB, or None once it has ended."""
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, IndexError, ValueError):
        return None


@contextmanager
def _locked(folder: Path):
    with open(folder / "lock", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _host_pid(folder: Path) -> int | None:
    try:
        pid = int((folder / "pid").read_text())
    except (OSError, ValueError):
        return None
    return pid if _alive(pid) else None


def _tidy(base: Path, prefix: str) -> None:
    """Remove the folders of hosts that ended without removing theirs (a minute after their last change: a
    host being started has none yet), and make room for one more host on this node: the least recently
    claimed idle hosts beyond ``MAX_HOSTS - 1`` are asked to end (they do within seconds)."""
    live = []
    for folder in base.iterdir():
        pid = _host_pid(folder)
        if pid is None:
            if time.time() - _mtime(folder) > _STARTING_S:
                shutil.rmtree(folder, ignore_errors=True)
        elif folder.name.startswith(prefix):
            live.append((_mtime(folder / "claimed"), folder, pid))
    for _, folder, pid in sorted(live)[:max(0, len(live) - (MAX_HOSTS - 1))]:
        if not _busy(folder, pid):
            (folder / "evict").touch()


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def claim(settings: WarmHost, preload: list[str]) -> Claim:
    """The warm host this actor's ranks fork from (started now when there is none), or why there is none."""
    if not settings.enabled:
        return Claim(None, None, None, False, "env.warm_host is false")
    raylet = _raylet()
    if raylet is None:
        return Claim(None, None, None, False, "not in a Ray worker process")
    if "runtime_resources" in sys.executable:
        return Claim(None, None, None, False, "the job has Python packages of its own (env.pip)")
    key = host_key()
    prefix = f"r{raylet[0]}.{raylet[1]}-"
    base = _base()
    folder = base / f"{prefix}{key[:16]}"
    folder.mkdir(mode=0o700, exist_ok=True)
    with _locked(folder):
        pid = _host_pid(folder)
        reused = pid is not None
        if not reused:
            _tidy(base, prefix)
            for name in ("ready", "sock", "pid", "evict"):
                (folder / name).unlink(missing_ok=True)
            args = {"folder": str(folder), "raylet": raylet, "key": key,
                    "preload": preload, "sys_path": _shared_path(sys.path)}
            env = {k: v for k, v in os.environ.items() if k in _HOST_VARS or k.startswith("LC_") or _KEY_VARS.match(k)}
            env["PYTHONPATH"] = os.pathsep.join(args["sys_path"])
            # The host forks itself away (``_detach``): not this actor's child, which Ray ends with the actor.
            with open(folder / "host.log", "ab") as log:
                subprocess.run([sys.executable, "-m", "cluster.rankhost", json.dumps(args)], env=env, cwd="/",
                               stdin=subprocess.DEVNULL, stdout=log, stderr=log, check=True, timeout=60)
            pid = _host_pid(folder)
        (folder / "claimed").write_text(str(settings.idle_s))  # the idle clock, and the idle time a host keeps
        (folder / "claims").mkdir(exist_ok=True)
        (folder / "claims" / str(os.getpid())).touch()  # held until ``unclaim``, or until this process ends
    if pid is None:
        return Claim(None, None, None, False, f"the warm rank host did not start (see {folder / 'host.log'})")
    _wait_for(lambda: (folder / "sock").exists() or not _alive(pid), 30.0)
    return Claim(str(folder / "sock"), pid, str(folder), reused,
                 f"warm rank host {pid}, {'reused' if reused else 'started'}")


def alive(found: Claim) -> bool:
    """The claimed host still runs, in its folder."""
    return found.pid is not None and _alive(found.pid) and Path(found.folder, "ready").exists()


def unclaim(found: Claim) -> None:
    """This process's ranks are done with the host: its idle clock starts (it stays warm for the next job)."""
    try:
        Path(found.folder, "claims", str(os.getpid())).unlink(missing_ok=True)
        Path(found.folder, "claimed").touch()
    except OSError:  # it ended and removed its folder
        pass


def _busy(folder: Path, pid: int) -> bool:
    """A host has ranks, or a live process holds a claim on it (its ranks are about to fork)."""
    if _children(pid):
        return True
    try:
        claims = list((folder / "claims").iterdir())
    except OSError:
        return False
    for claim_file in claims:
        if claim_file.name.isdigit() and _alive(int(claim_file.name)):
            return True
        claim_file.unlink(missing_ok=True)  # its process ended without letting go
    return False


def _wait_for(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def ready(found: Claim, timeout_s: float = 600.0) -> str | None:
    """Wait for a claimed host to finish its imports: None once it serves, else why it cannot be used.

    It checks the job's own folders hold no module the host imported (they would be shadowed)."""
    folder = Path(found.folder)
    _wait_for(lambda: (folder / "ready").exists() or not _alive(found.pid), timeout_s)
    if not (folder / "ready").exists():
        return f"the warm rank host {found.pid} ended before it was ready (see {folder / 'host.log'})"
    loaded = json.loads((folder / "ready").read_text())
    cwd = os.getcwd()
    shadowed = set()
    for entry in (p for p in sys.path if _job_specific(p, cwd) and p not in ("", ".")):
        try:
            names = [e.name[:-3] if e.name.endswith(".py") else e.name for e in os.scandir(entry)
                     if e.name.endswith(".py") or (e.is_dir() and e.name.isidentifier())]
        except OSError:
            continue
        # a module the host imported from this very folder is the job's own too (the runner's checkout)
        shadowed.update(n for n in names if n in loaded and not loaded[n].startswith(entry.rstrip(os.sep) + os.sep))
    shadowed = sorted(shadowed)
    if shadowed:
        return (f"the job's own folders hold modules the warm rank host imported ({', '.join(shadowed[:5])}): "
                "its ranks import their own instead")
    return None


# --- the host process --------------------------------------------------------------------------------------


def _serve(args: dict) -> None:
    from multiprocessing import forkserver

    folder = Path(args["folder"])
    raylet_pid, raylet_started = args["raylet"]
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(folder / "sock.new"))
    os.chmod(folder / "sock.new", 0o600)
    listener.listen(128)
    os.replace(folder / "sock.new", folder / "sock")  # clients wait for this name: it listens once it exists
    threading.Thread(target=_watch, args=(folder, raylet_pid, raylet_started, args["key"]),
                     daemon=True, name="raylaunch-host-watch").start()
    sys.path[:] = args["sys_path"]
    for name in args["preload"]:
        try:
            __import__(name)
        except ImportError:
            pass
    if host_key() != args["key"]:
        print("raylaunch: this host's imports do not match the key it was started for; it ends", flush=True)
        _end(folder)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # a forked rank could not use its GPU
        print("raylaunch: an import initialised CUDA in this host; it ends", flush=True)
        _end(folder)
    tmp = folder / "ready.new"
    tops = {name: getattr(sys.modules.get(name), "__file__", None) or "" for name in
            {m.split(".")[0] for m in list(sys.modules)}}
    tmp.write_text(json.dumps(tops))
    os.replace(tmp, folder / "ready")
    alive_r, _alive_w = os.pipe()  # never at EOF: the host ends itself (``_end``), never through this pipe
    forkserver.main(listener.detach(), alive_r, [])


def _end(folder: Path, only_if_idle: bool = False) -> None:
    """End the host (and remove its folder); ``only_if_idle``: unless it is busy (``_busy``)."""
    with _locked(folder):
        if only_if_idle and _busy(folder, os.getpid()):
            return
        for name in ("ready", "sock", "pid"):
            (folder / name).unlink(missing_ok=True)
    shutil.rmtree(folder, ignore_errors=True)
    os._exit(0)


def _idle_s(folder: Path) -> float:
    try:
        return float((folder / "claimed").read_text())
    except (OSError, ValueError):
        return 600.0


def _watch(folder: Path, raylet_pid: int, raylet_started: str, key: str) -> None:
    """End the host with its node (its ranks too), when idle too long, or once its packages changed."""
    try:
        raylet_fd = os.pidfd_open(raylet_pid)
    except (OSError, AttributeError):
        raylet_fd = None
    stale, checked, busy = False, time.monotonic(), time.time()
    while True:
        if raylet_fd is not None:
            select.select([raylet_fd], [], [], 2.0)
        else:
            time.sleep(2.0)
        if not _alive(raylet_pid, raylet_started):
            for child in _children(os.getpid()):
                try:
                    os.kill(child, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _end(folder)
        if not stale and time.monotonic() - checked > _KEY_CHECK_S and (folder / "ready").exists():
            checked = time.monotonic()
            stale = host_key() != key
            if stale:
                print("raylaunch: the packages this host imported changed on disk; it ends once idle", flush=True)
        if _busy(folder, os.getpid()):
            busy = time.time()
            continue
        idle = time.time() - max(busy, _mtime(folder / "claimed")) > _idle_s(folder)
        if stale or idle or (folder / "evict").exists():
            _end(folder, only_if_idle=not stale)


def _detach(folder: Path) -> None:
    """Leave the claiming actor: fork, the parent returns at once, the child starts a session of its own and
    writes its pid."""
    if os.fork():
        os._exit(0)
    os.setsid()
    (folder / "pid.new").write_text(str(os.getpid()))
    os.replace(folder / "pid.new", folder / "pid")


if __name__ == "__main__":
    _host_args = json.loads(sys.argv[1])
    _detach(Path(_host_args["folder"]))
    _serve(_host_args)
