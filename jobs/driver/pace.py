"""Judging the ranks' pace: who is starved for data, who the others wait for.

Each rank reports ``data_wait`` and ``sync_wait`` (``cluster/rank/pace.py``): the fractions of its
step time spent waiting for its next batch and waiting in DDP's gradient all-reduce for the
other ranks. The driver (progress lines) and ``raylaunch show`` (from ``metrics.jsonl``) both
ask ``judge`` what they mean, so both say the same.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass

__all__ = ["PACE_KEYS", "PaceTracker", "Verdict", "judge", "pace_of_records"]

PACE_KEYS = ("data_wait", "sync_wait")
# A rank that waits for its data this much of its step time is input-starved.
STARVED = 0.3
# A rank that waits this much less than the rank waiting most is the one being waited for.
BEHIND = 0.2

_ADVICE = ("raise the DataLoader's num_workers (with persistent_workers=True), pin_memory=True on GPUs, "
           "or do the preprocessing once beforehand (datasets' map) instead of in __getitem__")


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


@dataclass(frozen=True)
class Verdict:
    """What the ranks' pace says: the input-starved ranks and the ranks the others wait for."""

    starved: tuple[int, ...] = ()
    stragglers: tuple[int, ...] = ()
    lines: tuple[str, ...] = ()

    def values(self) -> dict[str, str]:
        """For the progress line: ``{"straggler": "1", "starved": "1,3"}`` (empty when all is well)."""
        out = {}
        if self.stragglers:
            out["straggler"] = ",".join(map(str, self.stragglers))
        if self.starved:
            out["starved"] = ",".join(map(str, self.starved))
        return out

    def tokens(self) -> str:
        """As the progress line shows them: ``straggler=1 starved=1,3``."""
        return " ".join(f"{k}={v}" for k, v in self.values().items())


def judge(pace: dict[int, dict[str, float]]) -> Verdict:
    """The verdict on each rank's mean ``data_wait`` and ``sync_wait`` (fractions of its step time).

    >>> v = judge({0: {"data_wait": 0.01, "sync_wait": 0.62}, 1: {"data_wait": 0.02, "sync_wait": 0.01}})
    >>> v.stragglers, v.starved
    ((1,), ())
    >>> print(v.lines[0])
    straggler: rank 1; the others wait for it (rank 0 62% of its step time); its own work is slower, not its data
    >>> judge({0: {"data_wait": 0.0, "sync_wait": 0.5}, 1: {"data_wait": 0.55, "sync_wait": 0.0}}).tokens()
    'straggler=1 starved=1'
    >>> judge({0: {"data_wait": 0.0, "sync_wait": 0.05}, 1: {"data_wait": 0.0, "sync_wait": 0.02}})
    Verdict(starved=(), stragglers=(), lines=())
    """
    if not pace:
        return Verdict()
    data = {r: float(p.get("data_wait") or 0.0) for r, p in pace.items()}
    sync = {r: float(p.get("sync_wait") or 0.0) for r, p in pace.items()}
    lines = []
    most = max(sync.values())
    behind = sorted(r for r, s in sync.items() if most - s >= BEHIND)
    # Named only while they are few: when most ranks "lag", the odd one is the rank that waits.
    stragglers = behind if behind and len(behind) <= len(sync) // 2 else []
    if stragglers:
        waiting = sorted((r for r in sync if r not in stragglers), key=lambda r: -sync[r])
        shown = ", ".join(f"rank {r} {100 * sync[r]:.0f}%" for r in waiting[:4]) + (", ..." if len(waiting) > 4 else "")
        cause = ("waiting for its data" if all(data[r] >= STARVED for r in stragglers)
                 else "its own work is slower, not its data")
        lines.append(f"straggler: {_ranks(stragglers)}; the others wait for it ({shown} of its step time); {cause}")
    starved = sorted(r for r, d in data.items() if d >= STARVED)
    if starved:
        waits = ", ".join(f"rank {r} {100 * data[r]:.0f}%" for r in starved[:8]) + (", ..." if len(starved) > 8 else "")
        where = "" if len(starved) == len(data) else " (only these: look at their nodes' disks and CPUs, or at what they read)"
        verb = "waits" if len(starved) == 1 else "wait"
        lines.append(f"input-starved: {_ranks(starved)} {verb} for the next batch ({waits} of the step time){where}; "
                     f"{_ADVICE}")
    return Verdict(tuple(starved), tuple(stragglers), tuple(lines))


class PaceTracker:
    """The driver's running view: the mean of each rank's last few reports."""

    def __init__(self, keep: int = 3) -> None:
        self._reports: dict[int, deque] = defaultdict(lambda: deque(maxlen=keep))
        self.verdict = Verdict()

    def add(self, rank: int, values: dict) -> Verdict | None:
        """Add one rank's report; the new verdict when it differs from the last one, else None."""
        self._reports[rank].append({k: float(values.get(k) or 0.0) for k in PACE_KEYS})
        verdict = judge({r: _mean(rs) for r, rs in self._reports.items()})
        changed = (verdict.starved, verdict.stragglers) != (self.verdict.starved, self.verdict.stragglers)
        self.verdict = verdict
        return verdict if changed else None


def _mean(reports) -> dict[str, float]:
    return {k: sum(r[k] for r in reports) / len(reports) for k in PACE_KEYS}


def pace_of_records(records: list[dict]) -> dict[int, dict[str, float]]:
    """Each rank's mean pace over the last attempt that reported any, from ``metrics.jsonl`` rows."""
    rows = [r for r in records if any(isinstance(r.get(k), (int, float)) for k in PACE_KEYS)]
    if not rows:
        return {}
    last = max(int(r.get("attempt") or 0) for r in rows)
    by_rank: dict[int, list[dict]] = defaultdict(list)
    for r in rows:
        if int(r.get("attempt") or 0) == last:
            by_rank[int(r.get("rank", 0))].append({k: float(r.get(k) or 0.0) for k in PACE_KEYS})
    return {rank: _mean(rs) for rank, rs in sorted(by_rank.items())}
