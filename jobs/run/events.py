"""The run's own events: typed facts the driver states about a run (a command began driving it, an attempt
began, waited for nodes, restored, took its first step, saved, committed, ended), kept in the run directory's
``events.jsonl`` and sent to whoever shows the run.

They are the one source of what a person sees of a run's course: the progress view of ``raylaunch run`` gets
them as objects; under ``raylaunch submit`` the driver prints each as one ``raylaunch-event {json}`` line of
the job's log, which ``submit --follow`` and ``logs --follow`` decode (``decode_line``) instead of reading the
runner's prose. The goodput ledger (``jobs.run.ledger``) is computed from the stored ones.

>>> e = AttemptStarted(time=1.0, attempt=2, restarts=1, max_restarts=3, world_size=4, resume_step=None)
>>> decode_line(encode_line(e)) == e
True
>>> decode_line("raylaunch: attempt 2 failed") is None
True
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar

from cluster.protocol import RunStatus, decode_kind

__all__ = [
    "AttemptEnded", "AttemptStarted", "Committed", "EVENT_PREFIX", "FirstStep", "MemoryMissed", "Outcome",
    "ProgressShown", "RanksPlaced", "Reserved", "Restored", "RunEvent", "Saved", "SessionEnded", "SessionStarted",
    "Waiting", "Work", "decode", "decode_line", "encode_line",
]

# What starts an event's line in a job's log (a person reading raw logs sees what it is).
EVENT_PREFIX = "raylaunch-event "


def _typed(enum: type, value: Any) -> Any:
    """A decoded event's spelling as its enum; one this version does not know (a newer version wrote it) stays the
    string it is, so the event, and the time it carries, is kept."""
    try:
        return enum(value)
    except ValueError:
        return value


class Outcome(StrEnum):
    """How an attempt ended (``events.jsonl`` spells each as its value; a decoded event's string equals it)."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"  # a rank failed or a node was lost (restarted if the budgets allow)
    PREEMPTED = "preempted"  # ranks stopped at a checkpoint after a stop notice
    GROW = "grow"  # stopped at a committed checkpoint to grow back onto more nodes
    STOPPED = "stopped"  # Ctrl-C, SIGTERM or `raylaunch stop`


class MemoryMissed(StrEnum):
    """Why an attempt of a run with snapshots in memory resumed from storage (``events.jsonl`` spells each as its
    value)."""

    # No snapshot newer than the last commit had a part of every rank on any node: the commit is the newest whole
    # state there was (a rank's snapshot is not taken while its save is being written, nor before the attempt's first
    # save)
    NONE_NEWER = "none_newer"
    # One had, but some part of it only on a node lost or being drained (its copy to the peer had not arrived)
    NODE_LOST = "node_lost"
    # The one chosen could not be put together on the nodes (a part pruned, a node's actor failed, too slow)
    NOT_PUT_TOGETHER = "not_put_together"

    def words(self) -> str:
        """What ``raylaunch show`` says of it.

        >>> MemoryMissed.NODE_LOST.words()
        'a newer snapshot had a part only on a node lost'
        """
        return {MemoryMissed.NONE_NEWER: "no newer snapshot was whole in memory",
                MemoryMissed.NODE_LOST: "a newer snapshot had a part only on a node lost",
                MemoryMissed.NOT_PUT_TOGETHER: "the newer snapshot could not be put together"}[self]


@dataclass(frozen=True)
class RunEvent:
    """One fact about a run, at ``time`` (Unix seconds)."""

    kind: ClassVar[str] = ""
    stored: ClassVar[bool] = True  # kept in events.jsonl (progress is not: metrics.jsonl has it)
    time: float

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **dataclasses.asdict(self)}


@dataclass(frozen=True)
class SessionStarted(RunEvent):
    """A command began driving the run (``time``: its process's start); a rerun of the run is a new session."""

    kind: ClassVar[str] = "session"
    pid: int = 0


@dataclass(frozen=True)
class SessionEnded(RunEvent):
    """The command ended driving the run, the run at ``status`` (result.json's spelling)."""

    kind: ClassVar[str] = "session_ended"
    status: RunStatus | str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", _typed(RunStatus, self.status))


@dataclass(frozen=True)
class AttemptStarted(RunEvent):
    """An attempt began at ``time`` (before its nodes were reserved); ``resume_step``: the step it resumes from, of a
    committed checkpoint or a snapshot in memory (None: from the beginning); ``Restored`` says when the ranks have
    loaded it. Written once that is final: after the attempt's ``waiting``/``reserved`` and the snapshot put together
    on its nodes (one that cannot be: the commit it falls back to); or when the attempt ends before (failed or stopped
    while reserving: what it was to load)."""

    kind: ClassVar[str] = "attempt"
    attempt: int = 0
    restarts: int = 0
    max_restarts: int = 0
    world_size: int = 0
    resume_step: int | None = None
    # where it resumes from: "memory" (a snapshot on the nodes, cluster/checkpoint/memory.py), "storage" (a committed
    # checkpoint), None (the beginning)
    resume_from: str | None = None
    # a snapshot's: when its state was captured, the end of the work the previous attempt kept (the goodput ledger)
    resume_state_time: float | None = None
    # with snapshots on, a restart that resumed from storage: why not from memory (None otherwise)
    memory_missed: MemoryMissed | str | None = None

    def __post_init__(self) -> None:
        if self.memory_missed is not None:
            object.__setattr__(self, "memory_missed", _typed(MemoryMissed, self.memory_missed))


@dataclass(frozen=True)
class Waiting(RunEvent):
    """The attempt waits for nodes the cluster does not have free (placement, or an elastic run's wait)."""

    kind: ClassVar[str] = "waiting"
    attempt: int = 0


@dataclass(frozen=True)
class Reserved(RunEvent):
    """The attempt holds its nodes (a wait for them, if any, ended here)."""

    kind: ClassVar[str] = "reserved"
    attempt: int = 0
    world_size: int = 0


@dataclass(frozen=True)
class RanksPlaced(RunEvent):
    """Every rank of the attempt reached the rendezvous: where each one runs, ``ranks`` holding one
    ``{"rank", "node", "hostname", "ip", "pid"}`` per rank (``show --per-rank``, ``status``)."""

    kind: ClassVar[str] = "ranks"
    attempt: int = 0
    ranks: list = field(default_factory=list)

    def lines(self) -> list[str]:
        """One line per rank, as the commands print them.

        >>> RanksPlaced(time=0, attempt=2, ranks=[{"rank": 0, "node": 0, "hostname": "a", "ip": "10.0.0.1",
        ...                                          "pid": 41}]).lines()
        ['rank 0: node 0, host a (10.0.0.1), pid 41']
        """
        from cluster.stacks import rank_place

        return [rank_place(r.get("rank"), r.get("node"), f"{r.get('hostname') or '?'} ({r.get('ip') or '?'})",
                           r.get("pid")) for r in self.ranks]


@dataclass(frozen=True)
class Restored(RunEvent):
    """The ranks loaded the checkpoint of ``step``; ``seconds``: the slowest rank's load."""

    kind: ClassVar[str] = "restored"
    attempt: int = 0
    step: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class FirstStep(RunEvent):
    """The attempt's first step began (the first batch asked for, or the first step logged); ``seen`` False: no step
    was seen all through the attempt, and ``time`` is when its ranks joined (which stands for its first step only
    if the attempt succeeded: a function that neither logs nor reads a prepared dataloader)."""

    kind: ClassVar[str] = "first_step"
    attempt: int = 0
    seen: bool = True


@dataclass(frozen=True)
class Saved(RunEvent):
    """Every rank saved its part of ``step``; ``time``: when the save was asked for; ``held_s``: how long it
    held training (the slowest rank)."""

    kind: ClassVar[str] = "saved"
    attempt: int = 0
    step: int = 0
    held_s: float = 0.0


@dataclass(frozen=True)
class Committed(RunEvent):
    """The checkpoint of ``step`` counts; ``state_time``: when its state was taken (the save was asked for)."""

    kind: ClassVar[str] = "committed"
    attempt: int = 0
    step: int = 0
    state_time: float = 0.0


@dataclass(frozen=True)
class Work(RunEvent):
    """Where the attempt's training stands (written now and then, and before it ends): ``first`` and ``last``,
    the earliest and latest moments a rank was seen training (a batch asked for, a step logged); ``data_wait_s``,
    the most seconds any rank waited for its input; ``step``, rank 0's latest step."""

    kind: ClassVar[str] = "work"
    attempt: int = 0
    last: float = 0.0
    first: float | None = None
    data_wait_s: float = 0.0
    step: int | None = None


@dataclass(frozen=True)
class AttemptEnded(RunEvent):
    kind: ClassVar[str] = "attempt_ended"
    attempt: int = 0
    outcome: Outcome | str = Outcome.FAILED
    restarts: int = 0  # the restarts used once this attempt's failure counted

    def __post_init__(self) -> None:
        object.__setattr__(self, "outcome", _typed(Outcome, self.outcome))


@dataclass(frozen=True)
class ProgressShown(RunEvent):
    """Rank 0's latest step and values as shown (floats with 4 significant digits); not stored."""

    kind: ClassVar[str] = "progress"
    stored: ClassVar[bool] = False
    step: int | None = None
    values: dict[str, str] = field(default_factory=dict)


_KINDS: dict[str, type[RunEvent]] = {
    c.kind: c for c in (SessionStarted, SessionEnded, AttemptStarted, Waiting, Reserved, RanksPlaced, Restored,
                        FirstStep, Saved, Committed, Work, AttemptEnded, ProgressShown)
}


def decode(row: dict) -> RunEvent | None:
    """An event from its stored or sent form; None for a kind or fields this version does not know."""
    return decode_kind(_KINDS, row)


def encode_line(event: RunEvent) -> str:
    return EVENT_PREFIX + json.dumps(event.to_dict(), separators=(",", ":"))


def decode_line(text: str) -> RunEvent | None:
    """The event a job's log line carries, or None for any other line."""
    if not text.startswith(EVENT_PREFIX):
        return None
    try:
        return decode(json.loads(text[len(EVENT_PREFIX):]))
    except ValueError:
        return None
