"""Snapshots in memory between commits: every few optimizer steps each rank's whole state, in its node's memory.

A snapshot is what a committed checkpoint holds (``save_state``'s files, the loaders' positions), taken by the same
capture as ``session.save`` (``cluster.checkpoint.staged``: training holds while the state is copied into host
memory, a writer process writes it) but written into the node's memory (``/dev/shm``, a tmpfs: ``cluster.snapshots``
has its folders) instead of the run's storage, and never committed. It is taken by raylaunch itself, at the point a
save at the end of a step would be: when the training loop asks its loader for the next batch after an optimizer
step (``cluster.rank.pace``), so a function, unchanged, resumes from it exactly as from a checkpoint it saved there.
The driver decides which snapshot a restart resumes from (``jobs.driver.memory``). Imports nothing from Ray.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import shutil
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from cluster.checkpoint.writer import describe_written
from cluster.layout import SCRIPT_FOLDER
from cluster.snapshots import COPY_WINDOW_S, KEEP, copied, prune, prune_from, snap_name, used_bytes, write_part_json

__all__ = ["AUTO_SHARE", "CodeSave", "MEASURED_FROM", "MemorySnapshots", "SLOW_WRITE_S", "auto_interval", "busy_share",
           "charged_cpu_s", "effect_interval", "measured_effect", "read_cores", "renumbered"]

# ``every: auto``: snapshots at most this share of the step time (what each costs: the time the steps took beyond
# quiet ones while its work was in flight, ``measured_effect``; at least its hold and the CPU its write takes).
AUTO_SHARE = 0.02
# A rank whose writes take this long (the median of its last few; its first, not measured yet) says when it takes one
# (``writing``), so that the other ranks' parts of that step are kept until its own is written
# (``cluster.snapshots.pin``): well within the copy window other ranks' parts are kept anyway.
SLOW_WRITE_S = COPY_WINDOW_S / 5
# ``auto`` measures a snapshot's effect on the steps (``measured_effect``) from this interval on (two steps before its
# mark, two after), and where its write lasts a step or more: a shorter one's few steps are within their own jitter.
MEASURED_FROM = 4
ENDED_KEPT = 8  # the writes' ends a rank keeps for that measure (the one measured is the newest taken)

def auto_interval(held_s: float, step_s: float, cpu_s: float = 0.0, write_s: float = 0.0) -> int:
    """``every: auto``: the optimizer steps between snapshots that keep each one's cost at most ``AUTO_SHARE`` of the
    step time, rounded up to a power of two; and at least the steps its write takes (``write_s``: capture to
    written, seconds), so the next one is not due while it is still in flight (it would be skipped).

    A snapshot costs its hold on training (``held_s``) and the CPU seconds of its background write that training
    pays (``cpu_s``, ``charged_cpu_s``): the rank's own thread's, whole (it holds the interpreter's lock the training
    thread needs between its operators), and the writer process's writing and checksums in the share the node's cores
    were busy: the writer runs at the lowest priority, on the node's cores, which training (other ranks, data loader
    workers, the kernel's page allocation for the snapshot's files) wants too, and shares their memory bandwidth and
    caches; on cores that were idle it takes only time no one wanted. Counting the hold alone chose a snapshot every
    step at 576 MiB a rank and slowed steps 1.36x (``make bench-recovery``, 2 cores, their ranks computing); counting
    these causes chose k = 4 there, and the steps were 1.36x again (its copy to the peer, the page faults of the
    node's memory, memory bandwidth are none of them). They are the floor of ``MemorySnapshots``' interval: what it
    measures of the effect itself (``effect_interval``) decides above it.

    >>> auto_interval(0.0005, 0.05), auto_interval(0.003, 0.05), auto_interval(0.5, 0.05)
    (1, 4, 512)
    >>> auto_interval(0.003, 0.5), auto_interval(0.003, 0.5, cpu_s=0.5), auto_interval(0.003, 0.5, write_s=3.0)
    (1, 64, 8)
    """
    return _power_of_two(max((held_s + cpu_s) / (AUTO_SHARE * step_s), write_s / step_s))


def _power_of_two(need: float) -> int:
    return 1 if need <= 1 else 1 << math.ceil(math.log2(need))


def measured_effect(taken: tuple[float, int], mark: tuple[float, int], due: tuple[float, int],
                    ended: float | None) -> tuple[float | None, float, float]:
    """What one snapshot cost training, from the times and optimizer-step counts the rank read at three step ends:
    when it was ``taken`` (before its capture), at the ``mark`` (half the interval on) and when the next one was
    ``due``; ``ended``: when its work ended as far as the rank knows (its write, and its copy to the peer node: a
    note of the driver's, ``cluster.snapshots.copied``), None while it goes on. The steps from the mark to the next
    due are the quiet ones (none of its work in flight) when it ended before the mark; the steps before the mark then
    took the snapshot's excess over as many quiet steps (its hold included). Returns (the excess seconds, None when
    the steps after the mark were not quiet; the quiet step's seconds, the mark to the next due; the steps its work
    was in flight, at that step time).

    >>> measured_effect((100.0, 10), (106.0, 14), (110.0, 18), ended=103.0)   # 4 steps of 1 s, 4 of 1.5 s
    (2.0, 1.0, 3.0)
    >>> measured_effect((100.0, 10), (106.0, 14), (110.0, 18), ended=None)     # still in flight: not measured
    (None, 1.0, 10.0)
    """
    quiet = (due[0] - mark[0]) / max(due[1] - mark[1], 1)
    end = due[0] if ended is None else ended
    span = (end - taken[0]) / quiet if quiet > 0 else math.inf
    if ended is None or ended > mark[0] or quiet <= 0:
        return None, quiet, span
    return round((mark[0] - taken[0]) - (mark[1] - taken[1]) * quiet, 9), quiet, round(span, 9)


def effect_interval(excess_s: float | None, quiet_s: float, span_steps: float) -> int:
    """``every: auto`` from the effect a snapshot had on training (``measured_effect``, medians of the latest few):
    the power of two k of optimizer steps with ``excess_s`` at most ``AUTO_SHARE`` of k quiet steps, and at least
    twice the steps its work is in flight (``span_steps``), so that the half of the interval after the mark is quiet
    and the next measure is one (where it is not, only the span counts).

    >>> effect_interval(1.0, 0.5, 10.0), effect_interval(None, 0.5, 10.0), effect_interval(0.001, 0.5, 0.2)
    (128, 32, 1)
    """
    need = 2 * span_steps
    if excess_s is not None and quiet_s > 0:
        need = max(need, excess_s / (AUTO_SHARE * quiet_s))
    return _power_of_two(need)


def charged_cpu_s(cpu_s: float, writer_cpu_s: float, busy: float | None) -> float:
    """The CPU seconds of a snapshot's write that ``auto`` counts: ``cpu_s`` (the rank's own thread's) whole, and
    ``writer_cpu_s`` (the writer process's) in the share ``busy`` of the node's cores that was busy meanwhile (None,
    not known: whole).

    >>> charged_cpu_s(0.0004, 0.0026, 0.1), charged_cpu_s(0.0004, 0.0026, None), charged_cpu_s(0.01, 0.8, 1.0)
    (0.00066, 0.003, 0.81)
    """
    share = 1.0 if busy is None else min(1.0, max(0.0, busy))
    return round(cpu_s + writer_cpu_s * share, 9)


def busy_share(before: tuple[float, float, float | None, float | None],
               after: tuple[float, float, float | None, float | None]) -> float | None:
    """The share of the node's CPU time that was busy between two readings of ``read_cores`` (``(busy, total,
    container_used, container_allowed)``, in seconds of CPU time): of its cores' time not idle, or of its container's
    CPU quota used where that is higher; None when nothing was read.

    >>> busy_share((10.0, 40.0, None, None), (11.0, 44.0, None, None))
    0.25
    >>> busy_share((10.0, 40.0, 5.0, 8.0), (11.0, 44.0, 6.5, 10.0))
    0.75
    """
    shares = []
    if after[1] > before[1]:
        shares.append((after[0] - before[0]) / (after[1] - before[1]))
    if None not in (before[2], before[3], after[2], after[3]) and after[3] > before[3]:
        shares.append((after[2] - before[2]) / (after[3] - before[3]))
    return max(shares) if shares else None


def read_cores() -> tuple[float, float, float | None, float | None]:
    """``(busy, total)`` CPU seconds of the cores this process may run on since boot (``/proc/stat``: user, nice,
    system, irq, softirq, steal; idle and iowait are idle), and ``(used, allowed)`` of its container's CPU quota
    (cgroup v2, then v1; None without a quota): ``allowed`` is the quota's cores times the time since an origin of
    this process's."""
    try:
        mine = {f"cpu{c}" for c in os.sched_getaffinity(0)}
    except (AttributeError, OSError):
        mine = set()
    busy = total = 0.0
    try:
        with open("/proc/stat") as f:
            per_cpu = [line.split() for line in f.read().splitlines() if line.startswith("cpu")]
        if not mine or {fields[0] for fields in per_cpu[1:]} <= mine:  # all of them: the first line sums them
            per_cpu = per_cpu[:1]
        else:
            per_cpu = [fields for fields in per_cpu[1:] if fields[0] in mine]
        for fields in per_cpu:
            ticks = [int(x) for x in fields[1:9]]
            busy += sum(ticks) - ticks[3] - ticks[4]
            total += sum(ticks)
    except (OSError, ValueError, IndexError):
        pass
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    used, allowed = _container_cpu()
    return busy / hz, total / hz, used, allowed


def _container_cpu() -> tuple[float | None, float | None]:
    """(CPU seconds used, the quota's cores x seconds since an origin) of this process's container, or (None, None)
    where it has no CPU quota."""
    cores = _quota_cores()
    if cores is None:
        return None, None
    try:
        stat = Path("/sys/fs/cgroup/cpu.stat").read_text().splitlines()
        used = next(int(line.split()[1]) / 1e6 for line in stat if line.startswith("usage_usec "))
    except (OSError, ValueError, StopIteration):
        try:
            used = int(Path("/sys/fs/cgroup/cpuacct/cpuacct.usage").read_text()) / 1e9
        except (OSError, ValueError):
            return None, None
    return used, cores * time.monotonic()


@functools.lru_cache(maxsize=1)
def _quota_cores() -> float | None:
    """The cores this process's container may use, by its CPU quota (cgroup v2, then v1); None without one."""
    for path, period_path in (("/sys/fs/cgroup/cpu.max", None),
                              ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us")):
        try:
            text = Path(path).read_text().split()
            quota = float(text[0]) if text[0] not in ("max", "-1") else None
            period = float(Path(period_path).read_text()) if period_path else float(text[1])
        except (OSError, ValueError, IndexError):
            continue
        return quota / period if quota is not None and period > 0 else None
    return None


def renumbered(name: str, step: int) -> str:
    """``name`` (a checkpoint folder's, ending in its step) with ``step`` in place of its number, as wide.

    >>> renumbered("step_20", 48), renumbered("checkpoint-0008", 48), renumbered("ckpt7", 1234)
    ('step_48', 'checkpoint-0048', 'ckpt1234')
    """
    m = re.search(r"\d+$", name)
    if m is None:
        raise ValueError(f"{name!r} does not end in a number")
    return name[:m.start()] + str(step).zfill(len(m.group()))


@dataclass
class CodeSave:
    """A snapshot of code that resumes from checkpoint folders of its own (a script's ``save_state`` folders, a
    Trainer's ``checkpoint-<n>``): written as that code writes them, named as it names them, and handed to its own
    resume (``cluster.checkpoint.restore.node_copy`` reads the name from the snapshot's label).

    ``save(folder, default)`` runs this rank's save into ``folder`` under the capture (``default()``: the
    Accelerator's ``save_state`` there; files it writes itself, not through torch.save or safetensors, are part of the
    snapshot too); ``name``: a folder
    name of the code's, ending in a step (None until the code saved once: no snapshot before); ``step()``: the step the
    code counts itself (Trainer's ``global_step``), None to count optimizer steps."""

    save: Callable[[str, Callable[[], None]], None]
    name: str | None = None
    step: Callable[[], int] | None = None


def _once(call: Callable[..., None]) -> Callable[..., None]:
    """``call``, which only its first call calls (a save that failed says its snapshot was not taken, whether or not
    the save's write had already said so)."""
    token = [True]

    def first(*args: Any, **kwargs: Any) -> None:
        try:
            token.pop()  # (atomic: two threads never both get it)
        except IndexError:
            return
        call(*args, **kwargs)

    return first


def _median(values: Any) -> float:
    """The median of ``values`` (0.0 for none)."""
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else 0.0


class MemorySnapshots:
    """One rank's snapshots: when one is due, taking it (``take``, from the prepared loader's iteration, before the
    batch after an optimizer step is fetched), and what it costs.

    ``every``: optimizer steps between snapshots, or None (``auto``): as often as keeps their cost at most
    ``AUTO_SHARE`` of the step time: what they did to the steps (``measured_effect``, read at a ``mark`` half an
    interval after each, ``effect_interval``), and at least what their hold and their write's CPU count
    (``auto_interval``); one a step until the first one's write is measured (a function's first is its first save's,
    written beside it: none of its own before), then at the interval its CPU and its time in flight say (its hold,
    not a measure, counted from the third one on); twice as far apart at once when one
    comes due while the previous one's write is still in flight, which skips it. ``peers``: a peer node keeps a copy
    of each part (its end, which the driver notes, ends the snapshot's work); ``every_changed(k)`` tells the driver a
    new interval at once (a restart's ranks start from it). ``save`` is ``StagedCheckpoints.hold_in_memory``; ``report`` reports a part
    once written; ``writing(step)`` says a part was taken whose write is slow (``SLOW_WRITE_S``); ``budget``: bytes
    the node's snapshots may hold."""

    def __init__(self, node_dir: str, rank: int, every: int | None, budget: int,
                 save: Callable[..., bool], say: Callable[[str], None],
                 report: Callable[..., None], start: int = 1,
                 writing: Callable[[int], None] | None = None, peers: bool = False,
                 every_changed: Callable[[int], None] | None = None) -> None:
        self.node_dir, self.rank, self.every, self.budget = Path(node_dir), rank, every, budget
        self.peers = peers  # a peer node keeps a copy of each part (the driver notes its end: ``snapshots.copied``)
        self._save, self._say, self._report, self._writing = save, say, report, writing
        self._every_changed = every_changed
        self.accelerator: Any = None  # the latest Accelerator that prepared a model (``cluster.rank.prepared``)
        self.code: CodeSave | None = None  # a script's or Trainer's own format; None: a function's (session.restore)
        self.base = 0  # the step training resumed at: a snapshot's step is this plus the optimizer steps taken
        self.off: str | None = None  # why this rank takes no more snapshots
        # A save of this attempt numbered as the optimizer steps count (``Session._steps_agree``): until then no
        # snapshot is taken (one labelled with another count would be resumed at the wrong step)
        self.confirmed = False
        self._said: set[str] = set()
        self._last: tuple[float, int] | None = None  # (perf_counter, steps) at the last snapshot taken
        self.interval = every or start  # optimizer steps from one snapshot to the next (auto: from ``start``)
        self._told = self.interval  # the interval the driver last heard (``every_changed``, a part's report)
        self.taken = 0
        self.beside = 0  # snapshots written beside a save, from its capture (``beside_save``), kept: not in ``taken``
        self.last_nbytes = 0  # the size of this rank's latest part
        self.used = 0  # bytes the node's snapshots held after this rank's latest write
        self._recent: deque[tuple[float, float]] = deque(maxlen=5)  # (hold, step time) of the latest snapshots
        # (CPU seconds training paid, capture to written) of their writes: ``charged_cpu_s``
        # (appended by the write's thread: read through a copy, ``list(...)``, never iterated in place)
        self._writes: deque[tuple[float, float]] = deque(maxlen=5)
        self.skipped = 0  # snapshots due while the previous one's write was in flight
        self._floor = 1  # ``auto``'s interval after a skip, until the write in flight has been measured
        self._taken_at: dict[int, float] = {}  # step -> when its state was captured, until its part is written
        self._cores: tuple[float, float, float | None, float | None] | None = None  # ``read_cores`` at the last write
        # ``auto``'s measure of the effect (``measured_effect``): the optimizer steps at which ``mark`` reads the clock
        # (inf: none), the snapshot measured (Unix time and steps before its capture, its step), the mark's reading
        self.mark_at: float = math.inf
        self._measuring: tuple[float, int, int] | None = None
        self._mark: tuple[float, int] | None = None
        self._ended: dict[int, tuple[float, bool]] = {}  # step -> (when its write ended, a copy to the peer follows)
        self._effects: deque[tuple[float | None, float, float]] = deque(maxlen=5)  # the latest ``measured_effect``s
        self._began = False  # this attempt's first snapshot was taken (``_first_of_attempt``)
        self._first_beside = False  # ``auto``'s first measure is of a snapshot beside a save (``beside_save``)
        self._last_save: int | None = None  # the step of this attempt's previous save (``beside_save``)

    def say_once(self, line: str) -> None:
        if line not in self._said:
            self._said.add(line)
            self._say(line)

    def stop(self, why: str) -> None:
        """No more snapshots from this rank (a restart then resumes from storage), said once."""
        if self.off is None:
            self.off, self.mark_at = why, math.inf
            self.say_once(f"raylaunch: rank {self.rank}: no more snapshots in memory: {why}")

    def next_due(self, steps: int) -> float:
        """The count of optimizer steps taken at which the next snapshot is due (``math.inf``: never): the next step
        that is a multiple of the interval. Every rank takes its snapshots at the same steps without asking the others
        (``auto``'s intervals are powers of two: ranks that measured differently still meet at the larger one's)."""
        if self.off is not None:
            return math.inf
        step = self.base + steps
        return steps + self.interval - step % self.interval

    def mark(self, steps: int) -> None:
        """Half an interval after a snapshot (``mark_at``, at the end of an optimizer step, as ``take``): the clock
        read once, for ``auto``'s measure of that snapshot's effect on the steps (``measured_effect``). A slow
        write's snapshot whose work goes on past it doubles the interval at once (the steps after it would not be
        quiet): a run whose ranks fail often learns its k in fewer snapshots."""
        now = time.time()
        self._mark, self.mark_at = (now, steps), math.inf
        if self._measuring is None:
            return
        at, steps0, step = self._measuring
        ended = self._ended.get(step)
        if ended is None or (ended[1] and self.peers and not self._copied(step)):
            if self._slow_writes((now - at) / max(steps - steps0, 1)):
                self._set_interval(self.interval * 2)

    def _copied(self, step: int) -> float | None:
        """When the driver saw the copy of this rank's part of ``step`` (or of a later one) to the peer end."""
        note = copied(self.node_dir, self.rank)
        return note[1] if note is not None and note[0] >= step else None

    def _slow_writes(self, step_s: float) -> bool:
        """This rank's writes last a step (``step_s``) or more: their effect is measured (``MEASURED_FROM``)."""
        return bool(self._writes) and _median(w for _, w in list(self._writes)) >= step_s

    def _set_interval(self, interval: int) -> None:
        self.interval = interval
        if interval != self._told and self._every_changed is not None:
            self._told = interval
            self._every_changed(interval)

    def _measure(self, now: float, steps: int) -> None:
        """At the next snapshot's step (``now``, ``steps``): what the one measured cost the steps between, if it
        was marked; its work ended when its write did, and (``peers``) its copy to the peer node, as the driver
        noted (``cluster.snapshots.copied``: a note of its step or a later one)."""
        measuring, mark, self._measuring, self._mark, self.mark_at = self._measuring, self._mark, None, None, math.inf
        if measuring is None or mark is None or not measuring[1] < mark[1] < steps:
            return
        at, steps0, step = measuring
        ended, copy = self._ended.get(step, (None, False))
        for old in [s for s in list(self._ended) if s <= step]:
            self._ended.pop(old, None)
        if ended is not None and copy and self.peers:
            copy_ended = self._copied(step)
            ended = None if copy_ended is None else max(ended, copy_ended)
        self._effects.append(measured_effect((at, steps0), mark, (now, steps), ended))
        self._set_interval(max(self.interval, self._effect_interval()))  # (only up: ``take`` may bring it down)

    def _effect_interval(self) -> int:
        """``effect_interval`` of the medians of the latest measures (1 where none is, or where the writes are
        shorter than a step: ``MEASURED_FROM``)."""
        effects = list(self._effects)
        if not effects or not self._writes:
            return 1
        quiet = _median(q for _, q, _ in effects)
        if not self._slow_writes(quiet):
            return 1
        clean = [e for e, _, _ in effects if e is not None]
        return effect_interval(_median(clean) if clean else None, quiet, _median(s for _, _, s in effects))

    def take(self, steps: int, hold_s: Callable[[], float | None], stopping: bool = False) -> None:
        """Take the snapshot of step ``base + steps`` (``steps``: optimizer steps this process took; a Trainer's: its
        own ``global_step``); ``hold_s`` reads how long the previous one held training, for ``auto``. ``stopping``:
        the snapshot of a stop notice's step, taken at a step the rank saved too (the restart reads it from memory)."""
        code = self.code
        if self.off is not None or self.accelerator is None or not self.confirmed or \
                (code is not None and code.name is None):
            return
        step = self.base + steps if code is None or code.step is None else code.step()
        if self._first_beside and not self._writes and self._taken_at:
            return  # ``auto``'s first measure, the snapshot beside the first save, is being written: none before it
        if not self._began:
            self._first_of_attempt(step)
        wall = time.time()
        if self.every is None:
            self._measure(wall, steps)
        now = time.perf_counter()
        # (the first snapshot's hold is not a measure: it imports and maps what the others reuse)
        if self.every is None and self._last is not None and steps > self._last[1] and self.taken >= 2:
            held = hold_s()
            if held is not None:  # the medians of the last few: one slow moment of a busy node moves nothing
                self._recent.append((held, (now - self._last[0]) / (steps - self._last[1])))
                if _median(s for _, s in self._recent) > 0:
                    self._set_interval(max(self._floor, self._effect_interval(), auto_interval(
                        _median(h for h, _ in self._recent), _median(s for _, s in self._recent),
                        cpu_s=_median(c for c, _ in list(self._writes)),
                        write_s=_median(w for _, w in list(self._writes)))))
        elif self.every is None and self.taken == (0 if self._first_beside else 1) and self._writes and not stopping \
                and self._last is not None and now > self._last[0] and steps > self._last[1]:
            # The first one's write measured: its CPU and its time in flight say the interval at once (its hold does
            # not), where waiting for the third one's measure took a run of 240 steps two snapshots more, each at
            # one step or two apart (#58: the steps after the first save ran 1.04-1.20x for 50 steps). A step not
            # due at the new interval takes none: the next multiple of it does. A function's first one is the
            # first save's, written beside it (``beside_save``): no snapshot of its own at one a step at all.
            first = max(self._floor, auto_interval(0.0, (now - self._last[0]) / (steps - self._last[1]),
                                                   cpu_s=self._writes[0][0], write_s=self._writes[0][1]))
            if first > self.interval:
                self._set_interval(first)
                if (self.base + steps) % first:
                    return
        self._last = (now, steps)
        used = self.used  # (read by the write's thread: no walk of the folder on the training thread)
        if used + self.last_nbytes > self.budget:  # the parts kept only for the copies' sake go first
            prune(self.node_dir, self.rank, KEEP)
            used = self.used = used_bytes(self.node_dir)
            if used + self.last_nbytes > self.budget:  # the newest and the step the driver pinned, no more
                prune(self.node_dir, self.rank, 1)
                used = self.used = used_bytes(self.node_dir)
        if used + self.last_nbytes > self.budget:
            self.say_once(f"raylaunch: snapshots in memory: this node's hold {used / 2**20:.3g} MiB, and one more of "
                          f"{self.last_nbytes / 2**20:.3g} MiB would pass their bound of {self.budget / 2**20:.3g} MiB "
                          "(checkpoint.snapshots.memory_mb): none is taken while it would; a restart resumes from an "
                          "older one or from storage. Raise the bound, or take them less often "
                          "(checkpoint.snapshots.every) (said once)")
            return
        if step in self._taken_at:  # written beside the save of this step, from its capture (``beside_save``)
            return
        folder = self.node_dir / snap_name(step)
        in_flight = bool(self._taken_at)  # a snapshot taken whose write has not ended
        kwargs: dict[str, Any] = {"saved_too": True} if stopping else {}
        if code is not None:  # written apart (the code writes files of its own), then moved in: ``_written``
            folder = self._apart(step)

            def save(into: str, default: Callable[[], None]) -> None:
                self._clear_apart()  # (called once no write of this rank's is in flight)
                code.save(into, default)

            kwargs["save"] = save
        self._taken_at[step] = time.time()
        if self._save(self.accelerator, step, str(folder), self._written, **kwargs):
            self.taken += 1
            gap = self.next_due(steps) - steps
            if self.every is None and gap >= MEASURED_FROM:  # its effect measured: marked half way to the next
                self._measuring, self.mark_at = (wall, steps, step), steps + gap // 2
            if self._writing is not None and (not self._writes
                                              or _median(w for _, w in list(self._writes)) >= SLOW_WRITE_S):
                self._writing(step)
            return
        self._taken_at.pop(step, None)
        if in_flight and self._taken_at:  # skipped: its write takes longer than the interval
            self.skipped += 1
            if self.every is None:  # (measured when that write ends: ``_written``); the driver told, as any change
                self._floor = self.interval * 2
                self._set_interval(self._floor)

    def beside_save(self, step: int) -> tuple[str, Callable[..., None]] | None:
        """A function's save at ``step`` (numbered as the optimizer steps count): the save's own capture is written
        into the node's memory too, first, as that step's snapshot (``StagedCheckpoints.save``'s ``beside``), so a
        rank killed before the commit of its step lands resumes there, not from the commit before (a step a rank saves
        takes no snapshot of its own: ``take``). Every save, not only one at a step a snapshot is due: its commit lands
        once every rank's part is written and flushed to storage, seconds after the save (3-9 s at 576 MiB a rank in
        ``make bench-recovery``, where a rank killed in that time lost 12 steps back to the commit before, the
        snapshots of its own at k = 32 none newer), and the save's hold is paid already: what it adds is a write from
        the same copy into the node's memory. It is copied to the peer too where a snapshot came due since the
        previous save (a step every rank reckons alike: a rank whose save's write was still in flight at the due step
        took none there, where a rank whose part is a few KB did, and the newest snapshot copied to the peers was not
        whole; a node lost then resumed from storage). Returns the folder and what is called once that part is
        written; None where one would not be kept."""
        since, self._last_save = self._last_save, step
        if self.off is not None or self.accelerator is None or not self.confirmed or self.code is not None \
                or self._taken_at:  # (one in flight, this step's too: skipped)
            return None
        first = self.every is None and not self._writes  # ``auto`` before its first measure: this one is it
        if first and (self.taken or self._first_beside):  # (one of its own, or an earlier save's, is being measured:
            return None  # k is 1 until then, and every save would write one beside it: at 576 MiB, steps 1.44x)
        if self.used + self.last_nbytes > self.budget:
            return None  # (said by ``take`` when it comes to it)
        if not self._began:  # (not counted in ``taken``: ``auto``'s measures count the snapshots of its own)
            self._first_of_attempt(step)
        self._taken_at[step] = time.time()
        if first:  # its write, the same as a snapshot's, is measured: ``take`` sets the interval from it
            self._first_beside, self._last = True, (time.perf_counter(), step - self.base)
        peer = first or since is None or step // self.interval > since // self.interval
        return str(self.node_dir / snap_name(step)), _once(functools.partial(self._written, beside=True,
                                                                             measured=first, peer=peer))

    def _first_of_attempt(self, step: int) -> None:
        """Before this attempt's first snapshot (its own, or one beside a save): an earlier attempt's parts past it
        are not this run's any more."""
        self._began = True
        prune_from(self.node_dir, self.rank, step)
        self._clear_apart()  # (a part an earlier attempt's rank was writing when it died)
        self._cores = read_cores()

    def _apart(self, step: int) -> Path:
        """Where this rank's part of a script's or Trainer's snapshot of ``step`` is written before it joins the
        step's folder."""
        return self.node_dir / f".writing-rank-{self.rank}-{step}"

    def _clear_apart(self) -> None:
        for old in self.node_dir.glob(f".writing-rank-{self.rank}-*"):
            shutil.rmtree(old, ignore_errors=True)

    def _joined(self, step: int, apart: Path, files: dict[str, dict]) -> tuple[Path, dict[str, dict]]:
        """This rank's part of a script's or Trainer's snapshot moved from ``apart`` into the step's folder, with the
        files the code wrote itself (a config, Trainer's state) described beside those the capture wrote, and on
        rank 0 the label naming the folder the code resumes from. A join that fails leaves none of its files."""
        folder = self.node_dir / snap_name(step)
        out, moved = dict(files), []
        try:
            folder.mkdir(parents=True, exist_ok=True)
            for root, _, names in os.walk(apart):
                for n in names:
                    rel = os.path.relpath(os.path.join(root, n), apart)
                    (folder / rel).parent.mkdir(parents=True, exist_ok=True)
                    os.replace(apart / rel, folder / rel)
                    moved.append(folder / rel)
                    if rel not in out:
                        out[rel] = describe_written(str(folder / rel))
            if self.rank == 0 and self.code is not None and self.code.name is not None:
                moved.append(folder / SCRIPT_FOLDER)
                moved[-1].write_text(json.dumps({"folder": renumbered(self.code.name, step)}))
                out[SCRIPT_FOLDER] = describe_written(str(moved[-1]))
        except BaseException:
            for path in moved:
                path.unlink(missing_ok=True)
            raise
        finally:
            shutil.rmtree(apart, ignore_errors=True)
        return folder, out

    def _write_ended(self, step: int, at: float, copy: bool) -> None:
        """The write's thread: this rank's part of ``step`` ended at ``at`` (``copy``: a copy to the peer follows), for
        ``_measure``; only the newest few are kept (a snapshot every step, and none measured below ``MEASURED_FROM``)."""
        self._ended[step] = (at, copy)
        for old in sorted(self._ended)[:-ENDED_KEPT]:
            self._ended.pop(old, None)

    def _written(self, step: int, folder: str, files: dict[str, dict] | None, cpu_s: float = 0.0,
                 writer_cpu_s: float = 0.0, beside: bool = False, measured: bool = False, peer: bool = True) -> None:
        """The write's thread: this rank's part of ``step`` is in ``folder``: its json last, then older parts go;
        ``cpu_s``, ``writer_cpu_s``: what the write cost on the rank's thread and in the writer process (for ``auto``,
        whether it was kept or not). ``files`` None: it was not written (failed, or given up for a save). ``beside``: a
        save's capture written beside it (``beside_save``), whose write is not a snapshot's cost (its capture and hold
        are the save's) and measures nothing for ``auto``, but the first save's (``measured``: ``auto``'s first
        measure, ``beside_save``); ``peer``: copied to the peer node (False: a save's, kept on its node alone)."""
        taken_at = self._taken_at.get(step)  # (in flight until its measure is in: ``take`` reads the two together)
        ended = time.time()
        cores, self._cores = self._cores, read_cores()  # how busy the node was since the last write ended
        if taken_at is not None and (measured or not beside) and (files is not None or cpu_s + writer_cpu_s > 0):
            # (one given up cost what it did)
            busy = None if cores is None else busy_share(cores, self._cores)
            self._writes.append((charged_cpu_s(cpu_s, writer_cpu_s, busy), ended - taken_at))
            self._floor = 1
        elif measured:  # the first save's, not written (a save written before it returned, or one that failed):
            self._first_beside = False  # no measure; ``take``'s first snapshot of its own is it
        self._taken_at.pop(step, None)
        if files is None:
            self._write_ended(step, ended, False)
            return
        if Path(folder) == self._apart(step):
            joined, files = self._joined(step, Path(folder), files)
            folder = str(joined)
        write_part_json(folder, self.rank, step, files)
        prune(self.node_dir, self.rank, KEEP, COPY_WINDOW_S)
        self.used = used_bytes(self.node_dir)
        self.last_nbytes = sum(int(m.get("size", 0)) for m in files.values())
        if self.used > self.budget:  # (the first part's size was not known before it was written) not kept
            prune_from(self.node_dir, self.rank, step)
            self.used = used_bytes(self.node_dir)
            self._write_ended(step, ended, False)
            self.say_once(f"raylaunch: snapshots in memory: a part of {self.last_nbytes / 2**20:.3g} MiB would pass "
                          f"their bound of {self.budget / 2**20:.3g} MiB (checkpoint.snapshots.memory_mb) on this "
                          "node: it is not kept; a restart resumes from an older one or from storage. Raise the bound, "
                          "or take them less often (checkpoint.snapshots.every) (said once)")
            return
        # A save's snapshot with no snapshot due since the save before stays on its node (a rank killed resumes from
        # it); the others go to the peer too, at ``auto``'s interval, which their cost sets (a node lost resumes there).
        peer = not beside or peer
        self._write_ended(step, ended, peer)  # (before the report: the driver's copy, and its note, come after it)
        self.beside += beside
        self._report(step, self.last_nbytes, self.interval, taken_at, peer)
