"""Where every rank is: Python stacks of the rank processes, read from outside, grouped.

Nothing here runs while training goes well. A rank only registers a signal handler
(``install_signal_dump``, free until the signal comes); stacks are read when the driver
detects a hang or a person asks (``raylaunch stacks``):

- ``py-spy dump`` reads a process's stacks from outside (all threads, the frames of C
  calls' Python callers). It needs ptrace permission on the rank: root, or
  ``CAP_SYS_PTRACE`` in a container, or the same user where ``kernel.yama.ptrace_scope``
  is 0 or 1 (each rank allows any process of its user to read it, ``PR_SET_PTRACER``).
  A stopped (SIGSTOP) process is read without pausing it (``--nonblocking``).
- Where ptrace is refused, the rank's own ``faulthandler`` writes its stacks when sent
  ``DUMP_SIGNAL``: this needs no permission, but a process that is stopped, or blocked
  inside a C call that holds signals off, cannot answer.
- A rank that answers neither is named, with why.

``group_stacks`` puts ranks with the same main-thread stack together, for example
``[ranks 0, 2, 3] in all_reduce (train.py:57 <- accelerate Accelerator.backward)`` and
``[rank 1] in __getitem__ (data.py:12)``; ``format_full`` gives every thread of every rank.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from collections import defaultdict
from dataclasses import dataclass

__all__ = ["DUMP_SIGNAL", "Frame", "RankStack", "ThreadStack", "describe", "find_stragglers", "format_full",
           "group_stacks", "install_signal_dump", "rank_place", "sample_processes", "stack_from_traceback",
           "where_ranks"]

# The signal a rank answers with its own stacks (faulthandler) where py-spy cannot read it.
DUMP_SIGNAL = signal.SIGUSR2
# How long one py-spy or faulthandler read may take; all ranks of a node are read at once.
SAMPLE_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class Frame:
    function: str
    file: str
    line: int

    @property
    def where(self) -> str:
        return f"{os.path.basename(self.file)}:{self.line}"


@dataclass(frozen=True)
class ThreadStack:
    name: str
    frames: tuple[Frame, ...]  # innermost first
    main: bool = False


@dataclass(frozen=True)
class RankStack:
    """One rank's stacks, or why there are none (``error``)."""

    rank: int
    node_rank: int
    pid: int = 0
    threads: tuple[ThreadStack, ...] = ()
    how: str = "py-spy"  # py-spy | faulthandler | traceback (a rank that had failed: its exception's)
    error: str | None = None
    note: str = ""  # e.g. "stopped (SIGSTOP)": the process's state when it was read
    host: str = ""  # the node's host name and address, "host (10.0.0.2)"

    @property
    def main(self) -> ThreadStack | None:
        return next((t for t in self.threads if t.main), self.threads[0] if self.threads else None)


# --- inside a rank -------------------------------------------------------------------------

def install_signal_dump(path: str) -> None:
    """Let this process be read: by py-spy (``PR_SET_PTRACER``), and by ``DUMP_SIGNAL``,
    on which faulthandler appends every thread's stack to ``path``. Costs nothing until asked."""
    import faulthandler
    import threading

    try:  # Yama (ptrace_scope 1) lets only ancestors trace; py-spy is the node actor's child
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(0x59616D61, ctypes.c_ulong(-1 & 0xFFFFFFFFFFFFFFFF), 0, 0, 0)  # PR_SET_PTRACER, ANY
    except (OSError, AttributeError):
        pass
    f = open(path, "w")
    f.write(f"main thread 0x{threading.main_thread().ident:016x}\n")
    f.flush()
    faulthandler.register(DUMP_SIGNAL, file=f, all_threads=True, chain=False)
    install_signal_dump._file = f  # kept open for the process's life: faulthandler writes to its fd


# --- reading from outside --------------------------------------------------------------------

def _py_spy() -> str | None:
    """py-spy from the same environment as this interpreter, else from PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return here if os.access(here, os.X_OK) else shutil.which("py-spy")


def _state(pid: int) -> str:
    try:
        import psutil

        status = psutil.Process(pid).status()
    except Exception:
        return "gone"
    return "stopped (SIGSTOP)" if status in ("stopped", "tracing-stop") else status


def _from_py_spy(text: str) -> tuple[ThreadStack, ...]:
    threads = []
    for t in json.loads(text):
        frames = tuple(Frame(f["name"], f["filename"], int(f["line"])) for f in t["frames"])
        threads.append(ThreadStack(t.get("thread_name") or f"0x{t['thread_id']:x}", frames,
                                   main=t.get("os_thread_id") == t.get("pid")))
    return tuple(threads)


_FH_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+) ")
_FH_FRAME = re.compile(r'^  File "(.*)", line (\d+) in (.*)$')


def _from_faulthandler(text: str, main_ident: str) -> tuple[ThreadStack, ...]:
    """faulthandler's fixed format: ``Thread 0x... (most recent call first):`` then frames."""
    threads: list[ThreadStack] = []
    ident, frames = None, []
    for line in text.splitlines() + [""]:
        m = _FH_THREAD.match(line)
        if (m or not line.strip()) and ident is not None:
            threads.append(ThreadStack(ident, tuple(frames), main=int(ident, 16) == int(main_ident, 16)))
            ident, frames = None, []
        if m:
            ident = m.group(2)
        elif (f := _FH_FRAME.match(line)) and ident is not None:
            frames.append(Frame(f.group(3), f.group(1), int(f.group(2))))
    return tuple(threads)


def sample_processes(pids: dict[int, int], node_rank: int, dump_paths: dict[int, str] | None = None,
                     timeout_s: float = SAMPLE_TIMEOUT_S) -> list[RankStack]:
    """Read the stacks of ``{rank: pid}`` all at once, within about ``timeout_s`` (twice that
    where py-spy fails and the ranks are asked by signal). ``dump_paths``: each rank's
    faulthandler file (``install_signal_dump``)."""
    spy = _py_spy()
    out: dict[int, RankStack] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    if spy is None:
        errors = {r: "py-spy is not installed" for r in pids}
    else:
        todo = dict(pids)
        # A stopped process cannot be paused by ptrace: read it without pausing. The second
        # round reads so the ranks that failed the first (stopped meanwhile, say).
        for nonblocking in (False, True):
            procs = {}
            for rank, pid in todo.items():
                flags = ["--nonblocking"] if nonblocking or _state(pid).startswith("stopped") else []
                procs[rank] = subprocess.Popen([spy, "dump", "--pid", str(pid), "--json", *flags],
                                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            todo = {}
            for rank, p in procs.items():
                try:
                    stdout, stderr = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.communicate()
                    errors[rank] = f"py-spy did not answer within {timeout_s:g} s"
                    continue
                if p.returncode == 0:
                    try:
                        out[rank] = RankStack(rank, node_rank, pids[rank], _from_py_spy(stdout), "py-spy",
                                              note=_state(pids[rank]))
                        errors.pop(rank, None)
                        continue
                    except (ValueError, KeyError) as exc:
                        stderr = f"unreadable output: {exc}"
                errors[rank] = "py-spy: " + _py_spy_error(stderr)
                if _state(pids[rank]) != "gone":
                    todo[rank] = pids[rank]
            if not todo or time.monotonic() > deadline:
                break
    out.update(_by_signal(errors, pids, node_rank, dump_paths or {}, timeout_s))
    return [out[r] for r in sorted(out)]


def _py_spy_error(stderr: str) -> str:
    """py-spy's error and its causes, without the backtrace that follows them."""
    lines = []
    for line in stderr.splitlines():
        if line.startswith("Stack backtrace"):
            break
        if line.strip() and not line.startswith("Caused by"):
            lines.append(line.strip().removeprefix("Error: "))
    return "; ".join(lines)[:300] or "failed"


def _by_signal(errors: dict[int, str], pids: dict[int, int], node_rank: int, paths: dict[int, str],
               timeout_s: float) -> dict[int, RankStack]:
    """The ranks py-spy could not read, asked to write their own stacks (faulthandler)."""
    out, asked = {}, {}
    for rank, why in errors.items():
        path, pid = paths.get(rank), pids[rank]
        state = _state(pid)
        if path is None or state.startswith("stopped") or state == "gone":
            out[rank] = RankStack(rank, node_rank, pid, how="", error=why, note=state)
            continue
        try:
            offset = os.path.getsize(path)
            os.kill(pid, DUMP_SIGNAL)
            asked[rank] = offset
        except OSError as exc:
            out[rank] = RankStack(rank, node_rank, pid, how="", error=f"{why}; signal: {exc}", note=state)
    deadline = time.monotonic() + timeout_s
    while asked:
        for rank, offset in list(asked.items()):
            with open(paths[rank]) as f:
                head = f.readline()
                f.seek(offset)
                text = f.read()
            if text.endswith("\n\n") or (text and time.monotonic() > deadline):
                threads = _from_faulthandler(text, head.split()[-1])
                out[rank] = RankStack(rank, node_rank, pids[rank], threads, "faulthandler", note=_state(pids[rank]))
                del asked[rank]
        if time.monotonic() > deadline:
            for rank in asked:
                out[rank] = RankStack(rank, node_rank, pids[rank], how="", note=_state(pids[rank]),
                                      error=f"{errors[rank]}; it did not answer {DUMP_SIGNAL.name} within {timeout_s:g} s")
            break
        time.sleep(0.05)
    return out


_TB_FRAME = re.compile(r'^  File "(.*)", line (\d+), in (.*)$')


def stack_from_traceback(rank: int, node_rank: int, traceback: str) -> RankStack | None:
    """A failed rank's last stack, from its exception's traceback (Python's fixed format)."""
    frames = [Frame(m.group(3), m.group(1), int(m.group(2)))
              for m in map(_TB_FRAME.match, traceback.splitlines()) if m]
    if not frames:
        return None
    return RankStack(rank, node_rank, threads=(ThreadStack("MainThread", tuple(reversed(frames)), True),),
                     how="traceback", note="failed")


# --- grouping --------------------------------------------------------------------------------

def _library_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths["stdlib"], paths["platstdlib"], paths["purelib"], paths["platlib"]}
    return tuple(os.path.realpath(p) + os.sep for p in roots if p)


_RUNNER = os.path.dirname(os.path.realpath(__file__)) + os.sep  # cluster/: the runner's own frames


def _is_user(frame: Frame, roots: tuple[str, ...]) -> bool:
    f = frame.file
    if f.startswith("<") or "site-packages" in f or "dist-packages" in f:
        return False
    real = os.path.realpath(f)
    return not real.startswith(_RUNNER) and not any(real.startswith(r) for r in roots)


def _package(file: str) -> str:
    """``.../site-packages/accelerate/accelerator.py`` -> ``accelerate``."""
    parts = file.replace(os.sep, "/").split("/")
    for marker in ("site-packages", "dist-packages"):
        if marker in parts and parts.index(marker) + 1 < len(parts):
            return parts[parts.index(marker) + 1].removesuffix(".py")
    return os.path.basename(file).removesuffix(".py")


def _user_frame(frames: tuple[Frame, ...]) -> int | None:
    """The index of the innermost frame of the user's code, else of the runner's (joining the
    group, say); None when the stack holds neither."""
    roots = _library_roots()
    user = next((i for i, f in enumerate(frames) if _is_user(f, roots)), None)
    if user is None:
        user = next((i for i, f in enumerate(frames) if os.path.realpath(f.file).startswith(_RUNNER)), None)
    return user


def describe(stack: ThreadStack) -> str:
    """``all_reduce (train.py:57 <- accelerate Accelerator.backward)``: the innermost function,
    the innermost frame of the user's code, and the library call it was in."""
    frames = stack.frames
    if not frames:
        return "no Python frames"
    top = frames[0]
    user = _user_frame(frames)
    if user is None or user == 0:
        return f"{top.function} ({top.where})"
    inner = frames[user - 1]
    return f"{top.function} ({frames[user].where} <- {_package(inner.file)} {inner.function})"


def _odd_state(note: str) -> str:
    """A process state worth showing (stopped, failed, zombie); not running or sleeping."""
    return "" if note in ("", "running", "sleeping", "disk-sleep", "idle") else note


def _label(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def group_stacks(stacks: list[RankStack]) -> str:
    """One line per distinct main-thread stack, the ranks in it named; unreadable ranks last."""
    groups: dict[tuple, list[RankStack]] = defaultdict(list)
    for s in stacks:
        if s.error is not None or s.main is None:
            key: tuple = ("error", s.error or "no threads", s.note)
        else:
            # A stopped or failed rank stays apart from running ranks with the same stack.
            key = ("stack", tuple((f.function, f.file, f.line) for f in s.main.frames), _odd_state(s.note))
        groups[key].append(s)
    lines = []
    for key, members in sorted(groups.items(), key=lambda kv: (kv[0][0] == "error", min(m.rank for m in kv[1]))):
        ranks = sorted(m.rank for m in members)
        first = members[0]
        if key[0] == "error":
            state = f" ({first.note})" if first.note else ""
            lines.append(f"[{_label(ranks)}] could not be read{state}: {first.error}")
            continue
        extra = f" [{key[2]}]" if key[2] else ""
        lines.append(f"[{_label(ranks)}] in {describe(first.main)}{extra}")
    return "\n".join(lines)


def rank_place(rank: int, node: int, host: str, pid: int) -> str:
    """Where one rank runs, as ``stacks``, ``status`` and ``show --per-rank`` say it (``host``: "name (address)").

    >>> rank_place(1, 0, "a (10.0.0.1)", 42), rank_place(0, 1, "", 0)
    ('rank 1: node 0, host a (10.0.0.1), pid 42', 'rank 0: node 1, host ?, pid ?')
    """
    return f"rank {rank}: node {node}, host {host or '?'}, pid {pid or '?'}"


def where_ranks(stacks: list[RankStack]) -> str:
    """Where each rank runs, one line each: its node, the node's host and address, its process.

    >>> print(where_ranks([RankStack(1, 0, 42, host="a (10.0.0.1)"), RankStack(0, 0, 41, host="a (10.0.0.1)")]))
    rank 0: node 0, host a (10.0.0.1), pid 41
    rank 1: node 0, host a (10.0.0.1), pid 42
    """
    return "\n".join(rank_place(s.rank, s.node_rank, s.host, s.pid) for s in sorted(stacks, key=lambda s: s.rank))


def format_full(stacks: list[RankStack]) -> str:
    """Every thread of every rank, innermost frame first, as the stacks file holds them."""
    out = []
    for s in sorted(stacks, key=lambda s: s.rank):
        head = f"rank {s.rank} (node {s.node_rank}{', host ' + s.host if s.host else ''}, pid {s.pid or '?'}"
        head += f", {s.note}" if s.note else ""
        head += f", read by {s.how})" if s.how else ")"
        out.append(head)
        if s.error is not None:
            out.append(f"  could not be read: {s.error}")
        for t in s.threads:
            out.append(f"  thread {t.name}{' (main)' if t.main else ''}:")
            out.extend(f"    {f.function} ({f.file}:{f.line})" for f in t.frames)
        out.append("")
    return "\n".join(out)


# --- stragglers: several readings of a live run -------------------------------------------------

def _waiting(stack: ThreadStack) -> bool:
    """Whether a main thread waits for the other ranks: in a torch.distributed call, or in the
    autograd engine, where DDP's gradient all-reduce runs (and waits) during backward."""
    inner = stack.frames[:_user_frame(stack.frames)]  # what the user's code called, not what called it
    return any("/torch/distributed/" in f.file.replace(os.sep, "/") or f.function.endswith("_engine_run_backward")
               for f in inner)


def find_stragglers(readings: list[list[RankStack]], ratio: float = 0.5, least: float = 0.3) -> str:
    """From several readings of every rank: the ranks that seldom wait in a collective while the
    others often do (at least ``least`` of the readings, and a straggler at most ``ratio`` times
    as often as them). In synchronous training every rank waits for the slowest at each step,
    so all ranks log the same step rate; the slow one is the one the others wait for.

    Returns one line naming the stragglers, or saying there is none, with each rank's share.
    """
    waited: dict[int, int] = defaultdict(int)
    read: dict[int, int] = defaultdict(int)
    for reading in readings:
        for s in reading:
            if s.error is None and s.main is not None:
                read[s.rank] += 1
                waited[s.rank] += _waiting(s.main)
    share = {r: waited[r] / read[r] for r in sorted(read)}
    slow = []
    for r in share:
        others = sorted(share[o] for o in share if o != r)
        typical = others[len(others) // 2] if others else 0.0
        if typical >= least and share[r] <= ratio * typical:
            slow.append(r)
    shares = ", ".join(f"rank {r} {v:.0%}" for r, v in share.items())
    seen = f"waited in a collective in {len(readings)} readings: {shares}"
    if not slow:
        return f"no straggler: {seen}"
    return f"straggler: {_label(slow)}, which the others wait for ({seen})"
