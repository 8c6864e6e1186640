"""The goodput ledger: every second of a run's wall clock, from each command that drove it to that command's
end, attributed to exactly one category, computed from the run's events (``jobs.run.events``): a pure function.

Categories, and what each is measured from:

- ``training``: steps whose work the final model kept: from an attempt's first step to its end (a succeeded
  attempt) or to the moment its last committed checkpoint's state was taken, or the snapshot in memory the next
  attempt resumed from (any other), less the time saves held training and the ranks' waits for input.
- ``recompute``: work past the last committed checkpoint (or snapshot resumed from) of an attempt that did not
  finish: the next attempt does it again.
- ``startup``: from the command's start to its first attempt, and from each attempt's start to its first step
  (placement, node actors, the environment, processes, imports, rendezvous), less the waits for nodes and the
  restore; an attempt that did not succeed and showed no step at all is start-up until its failure.
- ``restore``: the ranks loading the checkpoint an attempt resumes from (the slowest rank).
- ``checkpoint``: the time saves held training (``checkpoint_blocked_s``, the slowest rank of each save).
- ``data_wait``: the time the ranks waited for their next batch (the most any rank waited, from the pace
  measurement of ``cluster.rank.pace``).
- ``failure``: from the last training seen in a failed attempt to the next attempt's start (or the command's
  end): detection, stopping every rank, the restart decision.
- ``waiting``: waiting for nodes the cluster does not have free (placement, an elastic run's waits), and
  stopping to grow back onto more nodes.
- ``other``: the rest: a function's own work after its last step (evaluation, the end of the last save),
  stopping at the end.

A rerun of the same run is another session: its seconds add to the books (the time between two commands is
not the run's). A session whose driver was killed ends at its last event; its running attempt counts as
failed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from cluster.interval import checkpoint_interval
from jobs.run.events import (
    AttemptEnded, AttemptStarted, Committed, FirstStep, Outcome, Reserved, Restored, RunEvent, Saved,
    SessionEnded, SessionStarted, Waiting, Work,
)

__all__ = ["CATEGORIES", "Category", "Ledger", "Segment", "checkpoint_interval", "ledger", "suggestion"]


class Category(StrEnum):
    """Where a second of the wall clock went (``result.json``'s ``goodput.seconds`` spells each as its value)."""

    TRAINING = "training"  # steps that were kept
    RECOMPUTE = "recompute"  # steps done again after a failure (past the last commit)
    STARTUP = "startup"  # from the command (or attempt) to its first step
    RESTORE = "restore"  # loading a checkpoint
    CHECKPOINT = "checkpoint"  # saves that held training
    DATA_WAIT = "data_wait"  # the ranks waiting for their next batch
    FAILURE = "failure"  # from a failed attempt's last kept work to its end
    WAITING = "waiting"  # for nodes (an elastic run, or growing back)
    OTHER = "other"  # the rest: a stopped run's end, the driver's own


CATEGORIES = tuple(Category)


@dataclass(frozen=True)
class Segment:
    """A stretch of wall clock and its category (``data_wait`` is one slice at the end of each attempt's kept
    steps: it is measured as a sum, not placed in time)."""

    start: float
    end: float
    category: Category
    attempt: int | None = None


@dataclass
class Ledger:
    wall_s: float = 0.0
    seconds: dict[Category, float] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))
    segments: list[Segment] = field(default_factory=list)
    saves: int = 0  # saves that held training
    held_s: float = 0.0  # how long, all together
    failures: int = 0  # attempts that failed (not grow-backs, not stops)

    @property
    def ratio(self) -> float:
        return self.seconds[Category.TRAINING] / self.wall_s if self.wall_s > 0 else 0.0

    def as_result(self) -> dict:
        """``result.json``'s ``goodput``."""
        return {"wall_s": round(self.wall_s, 3), "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
                "ratio": round(self.ratio, 4)}


@dataclass
class _Attempt:
    number: int
    start: float
    end: float | None = None
    outcome: str | None = None
    waits: list[tuple[float, float | None]] = field(default_factory=list)
    restore: tuple[float, float] | None = None  # (when reported, seconds)
    first_step: float | None = None
    joined: float | None = None  # no step seen all through the attempt: when its ranks joined (FirstStep not seen)
    saves: list[tuple[float, float]] = field(default_factory=list)  # (asked for, held_s)
    commits: list[float] = field(default_factory=list)  # state times
    last_work: float | None = None
    data_wait_s: float = 0.0


def _sessions(events: list[RunEvent]) -> list[tuple[float, float, list[_Attempt]]]:
    sessions: list[tuple[float, float, list[_Attempt]]] = []
    start = end = None
    attempts: list[_Attempt] = []
    by_number: dict[int, _Attempt] = {}

    def close() -> None:
        if start is not None:
            sessions.append((start, max(end, start), attempts))

    for e in events:
        if isinstance(e, SessionStarted):
            close()
            start, end, attempts, by_number = e.time, e.time, [], {}
            continue
        if start is None:  # events before any session (not written by this version): the books start later
            continue
        end = max(end, e.time, e.last if isinstance(e, Work) else e.time)
        if isinstance(e, SessionEnded):
            continue
        if isinstance(e, (AttemptStarted, Waiting, Reserved)) and e.attempt not in by_number:
            # an attempt opens with its nodes' reservation, or its own event (written once where it resumes from is
            # final: after its reservation's events, with the time it began; a driver killed meanwhile writes none)
            by_number[e.attempt] = _Attempt(e.attempt, e.time)
            attempts.append(by_number[e.attempt])
        if isinstance(e, AttemptStarted):
            if e.resume_from == "memory" and e.resume_state_time is not None and e.attempt - 1 in by_number:
                # resumed from a snapshot in memory: the work of the attempt before, up to it, was kept
                by_number[e.attempt - 1].commits.append(e.resume_state_time)
            by_number[e.attempt].start = e.time
            continue
        a = by_number.get(getattr(e, "attempt", None))
        if a is None:
            continue
        if isinstance(e, Waiting):
            a.waits.append((e.time, None))
        elif isinstance(e, Reserved):
            a.waits = [(s, e.time if t is None else t) for s, t in a.waits]
        elif isinstance(e, Restored):
            a.restore = (e.time, e.seconds)
        elif isinstance(e, FirstStep) and not e.seen:
            a.joined = e.time
        elif isinstance(e, FirstStep):
            a.first_step = e.time if a.first_step is None else min(a.first_step, e.time)
        elif isinstance(e, Saved):
            a.saves.append((e.time, e.held_s))
        elif isinstance(e, Committed):
            a.commits.append(e.state_time)
        elif isinstance(e, Work):
            a.last_work = max(a.last_work or e.last, e.last)
            if e.first is not None:
                a.first_step = e.first if a.first_step is None else min(a.first_step, e.first)
            a.data_wait_s = max(a.data_wait_s, e.data_wait_s)
        elif isinstance(e, AttemptEnded):
            a.end, a.outcome = e.time, e.outcome
    close()
    return sessions


def _carve(start: float, end: float, base: Category, holes: list[tuple[float, float, Category]],
           attempt: int | None) -> list[Segment]:
    """[start, end] as ``base``, with each hole (clipped, in order, never overlapping) as its own category."""
    out: list[Segment] = []
    at = start
    for s, e, cat in sorted(holes):
        s, e = max(s, at), min(e, end)
        if e <= s:
            continue
        if s > at:
            out.append(Segment(at, s, base, attempt))
        out.append(Segment(s, e, cat, attempt))
        at = e
    if end > at:
        out.append(Segment(at, end, base, attempt))
    return out


def _take_from_end(segments: list[Segment], seconds: float, source: Category, category: Category) -> list[Segment]:
    """``seconds`` of the ``source`` segments, from the last backwards, turned into ``category``."""
    out = list(segments)
    for i in range(len(out) - 1, -1, -1):
        if seconds <= 0:
            break
        s = out[i]
        if s.category != source:
            continue
        cut = min(seconds, s.end - s.start)
        pieces = [Segment(s.start, s.end - cut, source, s.attempt)] if s.end - cut > s.start else []
        out[i:i + 1] = pieces + [Segment(s.end - cut, s.end, category, s.attempt)]
        seconds -= cut
    return out


def _attempt_segments(a: _Attempt, end: float, lost_to: Category) -> list[Segment]:
    """One attempt's stretch of wall clock, from its start to ``end`` (the next attempt's start, or the
    session's end); ``lost_to``: what the time after its last training is (failure, waiting, other)."""
    n, t0 = a.number, a.start
    ended = min(a.end if a.end is not None else end, end)
    if a.first_step is None and a.joined is not None and a.outcome == Outcome.SUCCEEDED:
        a.first_step = a.joined  # no step seen, and it succeeded: it trained from the rendezvous
    if a.first_step is None:  # no step seen: start-up to the last moment known (the failure), nothing trained
        first = min(max(a.last_work if a.last_work is not None else ended, t0), ended)
    else:
        first = min(max(a.first_step, t0), ended)
    holes = [(s, e if e is not None else first, Category.WAITING) for s, e in a.waits]
    if a.restore is not None:
        at, secs = a.restore
        holes.append((min(at, first) - secs, min(at, first), Category.RESTORE))
    out = _carve(t0, first, Category.STARTUP, holes, n)
    last = min(max(a.last_work if a.last_work is not None else first, first), ended)
    if a.first_step is None:
        last = first
    kept_until = last if a.outcome == Outcome.SUCCEEDED else min(max([first, *a.commits]), last)
    for s, h in a.saves:  # the save that took the committed state held training for it: that is kept
        if s <= kept_until < s + h:
            kept_until = min(s + h, last)
    kept = _carve(first, kept_until, Category.TRAINING, [(s, s + h, Category.CHECKPOINT) for s, h in a.saves], n)
    work_s = last - first
    if work_s > 0 and a.data_wait_s > 0:
        kept = _take_from_end(kept, min(a.data_wait_s, work_s) * (kept_until - first) / work_s, Category.TRAINING,
                              Category.DATA_WAIT)
    out += kept
    if last > kept_until:
        out.append(Segment(kept_until, last, Category.RECOMPUTE, n))
    if a.outcome == Outcome.SUCCEEDED:
        out += _carve(last, end, Category.OTHER, [(s, s + h, Category.CHECKPOINT) for s, h in a.saves if s >= last], n)
    elif end > last:
        out.append(Segment(last, end, lost_to, n))
    return out


def ledger(events: list[RunEvent], live: bool = False) -> Ledger:
    """The books of a run from its events, in the order they were written.

    ``live``: the last command is still driving the run, so its attempt that has not ended is running (its
    work so far counts as training), not failed as a killed driver's is."""
    books = Ledger()
    sessions = _sessions(events)
    for k, (start, end, attempts) in enumerate(sessions):
        books.wall_s += end - start
        first = min((a.start for a in attempts), default=end)
        books.segments += _carve(start, max(min(first, end), start), Category.STARTUP, [], None)
        for i, a in enumerate(attempts):
            nxt = attempts[i + 1].start if i + 1 < len(attempts) else end
            nxt = min(max(nxt, a.start), end)
            running = live and k == len(sessions) - 1 and i == len(attempts) - 1 and a.outcome is None
            outcome = a.outcome or (Outcome.SUCCEEDED if running else Outcome.FAILED)
            if a.outcome is None:
                a.outcome = outcome
            lost_to = {Outcome.GROW: Category.WAITING, Outcome.STOPPED: Category.OTHER}.get(outcome, Category.FAILURE)
            books.segments += _attempt_segments(a, nxt, lost_to)
            books.saves += len(a.saves)
            books.held_s += sum(h for _, h in a.saves)
            books.failures += outcome in (Outcome.FAILED, Outcome.PREEMPTED) and not running
    for s in books.segments:
        books.seconds[s.category] += s.end - s.start
    return books


def suggestion(books: Ledger, share: float = 0.03) -> str | None:
    """What the books suggest when saves or recompute take more than ``share`` of the wall clock."""
    if books.wall_s <= 0:
        return None
    ckpt, redo = books.seconds[Category.CHECKPOINT] / books.wall_s, books.seconds[Category.RECOMPUTE] / books.wall_s
    if max(ckpt, redo) <= share or books.saves == 0:
        return None
    cost = books.held_s / books.saves
    if books.failures == 0:
        return (f"saves held training {100 * ckpt:.0f}% of the time with no failure seen: save less often "
                f"(a save costs {cost:.2f} s)")
    mtbf = books.wall_s / books.failures
    every = checkpoint_interval(cost, mtbf)
    why = f"saves {100 * ckpt:.0f}%, recompute {100 * redo:.0f}% of the time"
    return (f"{why}: with a save costing {cost:.2f} s and a failure every {mtbf:.0f} s, a save every "
            f"{every:.0f} s loses the least (Young/Daly)")
