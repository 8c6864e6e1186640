"""A node's metrics rows, rendered where they are read: the lines of ``metrics.jsonl`` as text, and what the
driver's TensorBoard board and progress line need of them, summed per step (``RowBatch``).

At 4,096 ranks logging every step at 10 steps a second the driver would handle 40,960 rows a second, about 14 us
of one Python thread each (decoding, the row's JSON, TensorBoard's means): more than a core. So each node actor
does that work for its own ranks (``RowBatcher.take``, on every poll's answer) and the driver appends the text and
adds up the sums: a few microseconds a node and step. The driver runs the same code on rows that reach it one by
one (its own measurements, a node of an older version), and so do the scale bench's simulated nodes.

No torch and no Ray here: both sides import it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from math import isfinite

from cluster.context import RECORD_KEYS
from cluster.protocol import EventKind

__all__ = ["PER_RANK", "RowBatch", "RowBatcher", "keep_latest", "metrics_row", "numeric_metrics"]

# Metrics TensorBoard also shows per rank (``rank_<R>/<name>``): throughput, memory, and the waits of jobs/driver/pace.py.
PER_RANK = frozenset({"steps_per_s", "samples_per_s", "peak_rss_mb", "peak_gpu_mb", "data_wait", "sync_wait"})
_RECORD_KEYS = frozenset(RECORD_KEYS)
_METRICS = str(EventKind.METRICS)


def metrics_row(step, rank: int, node: int | None, attempt: int, world_size: int, at, values: dict) -> dict:
    """A ``metrics.jsonl`` row: the record keys (``cluster.context.RECORD_KEYS``), then the values."""
    return {"step": step, "rank": rank, "node": node, "attempt": attempt, "world_size": world_size, "time": at,
            **values}


def keep_latest(into: dict[int, int], steps: dict[int, int]) -> None:
    """Each rank's step in ``into`` raised to its step in ``steps`` where that is later."""
    for rank, step in steps.items():
        if into.get(rank, step - 1) < step:
            into[rank] = step


def numeric_metrics(record: dict) -> dict[str, float]:
    """A metrics.jsonl record's metrics that are numbers (not its RECORD_KEYS, not booleans, not an int too large
    for a float; NaN and infinities included: they are numbers the rank logged).

    >>> numeric_metrics({"step": 1, "rank": 0, "loss": 0.5, "ok": True, "note": "x", "n": 3})
    {'loss': 0.5, 'n': 3}
    """
    return {k: v for k, v in record.items() if k not in _RECORD_KEYS and _is_number(v)}


def _is_number(v) -> bool:
    return type(v) is float or (isinstance(v, (int, float)) and not isinstance(v, bool)
                                and (isinstance(v, float) or abs(v) < 2**1000))


def _number(v) -> float | None:
    """``v`` as a finite float when it is a metric TensorBoard can draw; None otherwise."""
    if type(v) is not float:  # (the common case is a float: every row's every value passes here)
        if not _is_number(v):
            return None
        v = float(v)
    return v if isfinite(v) else None


@dataclass
class RowBatch:
    """Metrics rows of one node's poll (or of the driver's own measurements): their ``metrics.jsonl`` lines as one
    text (one string crosses Ray cheaper than a list of rows), and their numbers summed per step for TensorBoard's
    mean across ranks."""

    text: str = ""  # each row's JSON line, in the order read
    count: int = 0  # rows in ``text``
    lead: list[dict] = field(default_factory=list)  # rank 0's rows, as dicts: the progress line
    steps: dict[int, int] = field(default_factory=dict)  # rank -> the latest step it logged here
    first: float | None = None  # the earliest and latest time of a row (training seen)
    last: float | None = None
    sums: dict[int, dict[str, list[float]]] = field(default_factory=dict)  # step -> metric -> [sum, count]
    ranks: dict[str, set[int]] = field(default_factory=dict)  # metric -> the ranks that logged it here
    latest: dict[str, dict[int, float]] = field(default_factory=dict)  # PER_RANK metric -> rank -> newest value

    @classmethod
    def of(cls, rows: list[dict]) -> RowBatch:
        """Rows built elsewhere (the driver's measurements) as one batch.

        >>> b = RowBatch.of([{"step": 2, "rank": 0, "time": 1.5, "loss": 0.5}, {"step": 2, "rank": 1, "loss": 1.5}])
        >>> b.count, b.sums, b.steps, b.text.splitlines()[1]
        (2, {2: {'loss': [2.0, 2]}}, {0: 2, 1: 2}, '{"step": 2, "rank": 1, "loss": 1.5}')
        """
        batch = cls()
        batch.seal([json.dumps(row) + "\n" for row in rows])
        for row in rows:
            rank = row.get("rank", 0)
            batch.add(rank, row.get("step"), row.get("time"), row.items(), row if rank == 0 else None)
        return batch

    def seal(self, lines: list[str]) -> None:
        self.text, self.count = "".join(lines), len(lines)

    def __len__(self) -> int:
        return self.count

    def add(self, rank: int, step, at, values, row: dict | None = None, extra: tuple[str, float] | None = None
            ) -> None:
        """What one row adds (its line is the caller's): ``values``, its (name, value) pairs (record keys among
        them are passed over); ``row``: the whole row, for rank 0's; ``extra``: a metric TensorBoard gets beside
        the row's own that the row does not store (its rank's steps_per_s)."""
        if row is not None:
            self.lead.append(row)
        if isinstance(at, (int, float)):
            if self.first is None or at < self.first:
                self.first = at
            if self.last is None or at > self.last:
                self.last = at
        if step is None:  # logged without a step: stored, never drawn
            return
        step = int(step)
        if self.steps.get(rank, step - 1) < step:
            self.steps[rank] = step
        sums = self.sums.get(step)
        if sums is None:
            sums = self.sums[step] = {}
        ranks, latest = self.ranks, self.latest
        for k, v in (values if extra is None else [*values, extra]):
            if k in _RECORD_KEYS:
                continue
            v = _number(v)
            if v is None:
                continue
            s = sums.get(k)
            if s is None:
                sums[k] = [v, 1]
            else:
                s[0] += v
                s[1] += 1
            r = ranks.get(k)
            if r is None:
                ranks[k] = {rank}
            else:
                r.add(rank)
            if k in PER_RANK:
                latest.setdefault(k, {})[rank] = v


def _line(step, rank, node, attempt: int, world: int, at, values: dict) -> str:
    """The ``metrics.jsonl`` line of one row: ``json.dumps`` of the row (``RECORD_KEYS`` first, then the values),
    its record keys written directly in the common case (the node writes every rank's every row).

    >>> row = {"step": 3, "rank": 1, "node": 0, "attempt": 1, "world_size": 2, "time": 10.25}
    >>> _line(3, 1, 0, 1, 2, 10.25, {"loss": 0.5})[:-1] == json.dumps({**row, "loss": 0.5})
    True
    >>> _line(None, 1, None, 1, 2, 10.25, {})[:-1] == json.dumps({**row, "step": None, "node": None})
    True
    """
    if (type(rank) is int and type(at) is float and isfinite(at) and (type(step) is int or step is None)
            and (type(node) is int or node is None) and not (values.keys() & _RECORD_KEYS)):
        head = (f'{{"step": {"null" if step is None else step}, "rank": {rank}, '
                f'"node": {"null" if node is None else node}, "attempt": {attempt}, "world_size": {world}, '
                f'"time": {at!r}')
        return f"{head}, {json.dumps(values)[1:]}\n" if values else head + "}\n"
    return json.dumps(metrics_row(step, rank, node, attempt, world, at, values)) + "\n"


class RowBatcher:
    """Turns the metrics events of one attempt's ranks into ``RowBatch`` es (``take``), keeping what a rank's rows
    say only together: the time of its previous step, for its steps_per_s."""

    def __init__(self, attempt: int, world_size: int, node_of: dict[int, int]) -> None:
        self.attempt, self.world_size, self.node_of = attempt, world_size, node_of
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (step, time) of its latest row

    def take(self, events: list[dict]) -> tuple[list[dict], RowBatch]:
        """``events`` split: every other kind, in order; and the metrics events as rows."""
        rest: list[dict] = []
        lines: list[str] = []
        batch = RowBatch()
        node_of, attempt, world, seen = self.node_of, self.attempt, self.world_size, self._seen
        for e in events:
            if e.get("kind") != _METRICS:
                rest.append(e)
                continue
            rank, step, at, values = e.get("rank", 0), e.get("step"), e.get("time", 0.0), e.get("values")
            if not isinstance(values, dict):
                values = {}
            node = node_of.get(rank)
            lines.append(_line(step, rank, node, attempt, world, at, values))
            extra = None
            if step is not None and isinstance(at, (int, float)):
                prev = seen.get(rank)
                if prev is None or step > prev[0]:
                    if prev is not None and at > prev[1]:
                        extra = ("steps_per_s", (step - prev[0]) / (at - prev[1]))
                    seen[rank] = (step, at)
            lead = metrics_row(step, rank, node, attempt, world, at, values) if rank == 0 else None
            batch.add(rank, step, at, values.items(), lead, extra)
        batch.seal(lines)
        return rest, batch
