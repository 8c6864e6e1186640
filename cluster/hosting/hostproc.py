"""The warm rank host itself (``cluster.hosting.rankhost`` claims and starts them): what a host is keyed by
(``host_key``), the host process (``python -m cluster.hosting.hostproc``: multiprocessing's fork server on a socket
of its own, after its imports), and when it ends. The process facts both sides read (``/proc``) are here too.
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
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

__all__ = ["KEY_VARS", "PROJECT_VAR", "alive_pid", "busy", "children", "host_key", "job_specific", "locked", "mtime",
           "pid_namespace", "project_dirs", "rss_mb", "shared_path", "stat_fields"]


_KEY_CHECK_S = 10.0  # how often an idle host checks its packages are still the ones it imported


# Variables that change what the host's imports do, or where they come from: part of the key.
KEY_VARS = re.compile(r"^(HF_|HUGGINGFACE_|TRANSFORMERS_|ACCELERATE_|TOKENIZERS_|TORCH|PYTORCH_|MKL_|KMP_|"
                       r"LD_PRELOAD$|LD_LIBRARY_PATH$|CUDA_HOME$|PYTHONHASHSEED$|PYTHONNOUSERSITE$)")


_RAYLAUNCH = Path(__file__).resolve().parents[1]  # cluster/: the runner's own code, which ranks run from the host


_RAY_DIR = os.sep + "ray" + os.sep  # Ray puts folders of its own package on its workers' search path


PROJECT_VAR = "RAYLAUNCH_PROJECT_DIR"  # the project folder on the nodes' path, where `raylaunch run` starts them


def pid_namespace() -> str:
    """This process's PID namespace, in hex (the inode of ``/proc/self/ns/pid``)."""
    try:
        return f"{os.stat('/proc/self/ns/pid').st_ino:x}"
    except OSError:  # not Linux
        return "0"


def project_dirs() -> list[str]:
    """This process's job's own folders beyond Ray's runtime environment ones: the project `raylaunch run` put
    on the path of the nodes it started (``cluster.nodes.connect``)."""
    return [os.environ[PROJECT_VAR]] if os.environ.get(PROJECT_VAR) else []


def job_specific(entry: str, job_dirs: list[str]) -> bool:
    """A search-path entry that is one job's own: its working directory, its ``py_modules``."""
    return entry in ("", ".") or "runtime_resources" in entry or any(
        entry == d or entry.startswith(d.rstrip(os.sep) + os.sep) for d in job_dirs)


def shared_path(sys_path: list[str], job_dirs: list[str] | None = None) -> list[str]:
    """The search path every job on the node shares: its folders, in order, once each, without Ray's own (a
    path hook's entry, such as an editable install's, comes from a ``.pth`` file the key counts)."""
    job_dirs = project_dirs() if job_dirs is None else job_dirs
    out: list[str] = []
    for p in sys_path:
        if p not in out and not job_specific(p, job_dirs) and _RAY_DIR + "_private" not in p \
                and not p.endswith(_RAY_DIR + "thirdparty_files") and os.path.isdir(p):
            out.append(p)
    return out


def source_digest(path: Path) -> str | None:
    """A module's source: the file, or every ``.py`` file of a package's folder with its place in it (so code moved
    to another folder is other code); None when there is none to read."""
    h = hashlib.sha256()
    try:
        if path.is_file():
            h.update(path.read_bytes())
            return h.hexdigest()
        files = sorted(p for p in path.rglob("*.py") if "__pycache__" not in p.parts)
        for p in files:
            h.update(str(p.relative_to(path)).encode() + b"\0" + p.read_bytes() + b"\0")
    except OSError:
        return None
    return h.hexdigest() if files else None


def _code_digest() -> str | None:
    """raylaunch's own code, by place and bytes: a host started by another version or layout is never reused."""
    return source_digest(_RAYLAUNCH)


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


def host_key(sys_path: list[str] | None = None, environ: dict | None = None, job_dirs: list[str] | None = None) -> str:
    """The key of the host a process with this search path and environment may fork its ranks from."""
    shared = shared_path(sys.path if sys_path is None else sys_path, job_dirs)
    env = os.environ if environ is None else environ
    facts = {
        "python": [sys.executable, sys.version],
        "path": shared,
        "dists": {p: _distributions(p) for p in shared},
        "vars": {k: v for k, v in sorted(env.items()) if KEY_VARS.match(k)},
        "raylaunch": _code_digest(),
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()


def stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, ...


def alive_pid(pid: int, started: str | None = None) -> bool:
    fields = stat_fields(pid)
    return fields is not None and fields[0] not in ("Z", "X") and (started is None or fields[19] == started)


def children(pid: int) -> list[int]:
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
def locked(folder: Path, wait: bool = True):
    """Hold a host folder's lock (made when missing); yields False when ``wait`` is false and another holds it.
    A folder removed while this process waited for its lock is made again and locked anew."""
    while True:
        folder.mkdir(mode=0o700, exist_ok=True)
        with open(folder / "lock", "a+") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            if os.fstat(f.fileno()).st_nlink == 0:  # its folder went (a host ended) while we waited
                continue
            try:
                yield True
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
            return


def mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def busy(folder: Path, pid: int) -> bool:
    """A host has ranks, or a live process holds a claim on it (its ranks are about to fork)."""
    if children(pid):
        return True
    try:
        claims = list((folder / "claims").iterdir())
    except OSError:
        return False
    for claim_file in claims:
        if claim_file.name.isdigit() and alive_pid(int(claim_file.name)):
            return True
        claim_file.unlink(missing_ok=True)  # its process ended without letting go
    return False


def _serve(args: dict) -> None:
    from multiprocessing import forkserver

    folder = Path(args["folder"])
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(folder / "sock.new"))
    os.chmod(folder / "sock.new", 0o600)
    listener.listen(128)
    os.replace(folder / "sock.new", folder / "sock")  # clients wait for this name: it listens once it exists
    # The key's variables as the host started: imports set some of their own (torch._dynamo sets
    # TORCHINDUCTOR_CACHE_DIR), which are not a change of what the host was started for.
    environ = dict(os.environ)
    threading.Thread(target=_watch_or_end, args=(folder, args["anchor"], args["key"], environ),
                     daemon=True, name="raylaunch-host-watch").start()
    sys.path[:] = args["sys_path"]
    for name in args["preload"]:
        try:
            __import__(name)
        except ImportError:
            pass
    if host_key(job_dirs=[], environ=environ) != args["key"]:  # its search path is the shared one already
        print("raylaunch: this host's imports do not match the key it was started for; it ends", flush=True)
        _end(folder)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # a forked rank could not use its GPU
        print("raylaunch: an import initialised CUDA in this host; it ends", flush=True)
        _end(folder)
    tmp = folder / "ready.new"
    tops = {name: _where(sys.modules.get(name)) for name in {m.split(".")[0] for m in list(sys.modules)}}
    tmp.write_text(json.dumps(tops))
    os.replace(tmp, folder / "ready")
    alive_r, _alive_w = os.pipe()  # never at EOF: the host ends itself (``_end``), never through this pipe
    forkserver.main(listener.detach(), alive_r, [])


def _where(module: object) -> str:
    """Where a module was imported from: its file, or a namespace package's first folder ("" for a built-in)."""
    return getattr(module, "__file__", None) or next(iter(getattr(module, "__path__", None) or []), "")


def _end(folder: Path, only_if_idle: bool = False) -> None:
    """End the host (and remove its folder); ``only_if_idle``: unless it is busy (``busy``)."""
    with locked(folder):
        if only_if_idle and busy(folder, os.getpid()):
            return
        shutil.rmtree(folder, ignore_errors=True)  # under its lock: a claim waiting for it makes the folder anew
    os._exit(0)


def _idle_s(folder: Path) -> float:
    try:
        return float((folder / "claimed").read_text())
    except (OSError, ValueError):
        return 600.0


def _watch_or_end(folder: Path, anchor: str, key: str, environ: dict[str, str]) -> None:
    """``_watch``; a host whose watch failed would never end: it ends at once, and says why in its log."""
    try:
        _watch(folder, anchor, key, environ)
    except BaseException:
        import traceback

        traceback.print_exc()
        _end(folder)


def _watch(folder: Path, anchor: str, key: str, environ: dict[str, str]) -> None:
    """End the host with its node's raylet (its ranks too), when idle too long, or once its packages changed."""
    raylet_pid, raylet_started = int(anchor.split(".")[0]), anchor.split(".")[1]
    try:
        raylet_fd = os.pidfd_open(raylet_pid)
    except (OSError, AttributeError):
        raylet_fd = None
    stale, checked, last_busy = False, time.monotonic(), time.time()
    while True:
        if raylet_fd is not None:
            select.select([raylet_fd], [], [], 2.0)
        else:
            time.sleep(2.0)
        if not alive_pid(raylet_pid, raylet_started):
            for child in children(os.getpid()):
                try:
                    os.kill(child, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _end(folder)
        if busy(folder, os.getpid()):
            last_busy = time.time()
            continue
        # Its packages are checked only while it idles (a stale host ends once idle: checking while ranks train
        # cost them 2.5 ms of a core every 10 s, #58)
        if not stale and time.monotonic() - checked > _KEY_CHECK_S and (folder / "ready").exists():
            checked = time.monotonic()
            stale = host_key(job_dirs=[], environ=environ) != key
            if stale:
                print("raylaunch: the packages this host imported changed on disk; it ends now, idle", flush=True)
        idle = time.time() - max(last_busy, mtime(folder / "claimed")) > _idle_s(folder)
        if stale or idle or (folder / "evict").exists():
            _end(folder, only_if_idle=not stale)


def _detach(folder: Path) -> None:
    """Leave the claiming actor: fork, the parent returns at once, the child starts a session of its own and
    writes its pid."""
    if os.fork():
        os._exit(0)
    os.setsid()
    log = os.open(folder / "host.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    (folder / "pid.new").write_text(str(os.getpid()))
    os.replace(folder / "pid.new", folder / "pid")


if __name__ == "__main__":
    _host_args = json.loads(sys.argv[1])
    _detach(Path(_host_args["folder"]))
    _serve(_host_args)
