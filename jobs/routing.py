"""What the ranks of one attempt reported, and which of them went silent: events routed to the recorder and
to checkpoint commits, and lost nodes and stopped heartbeats turned into rank failures.

``jobs.driver`` hands every node's poll to an ``AttemptRouter``; it keeps the attempt's
state (who arrived, joined, checkpointed, was preempted) and asks ``jobs.storage`` to
commit a checkpoint once every rank reported its part.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

from cluster.storage_io import join_uri
from cluster.layout import checkpoint_name
from cluster.node import NodeInfo
from cluster.protocol import EventKind, NodePoll, NodeState, RankFailure
from jobs.hangs import HEARTBEAT_LOST
from jobs.pace import PACE_KEYS, PaceTracker
from jobs.record import Recorder
from jobs.storage import RunDir

__all__ = ["AttemptRouter", "AttemptState", "group_failures"]


@dataclass
class AttemptState:
    """What the driver tracks while one attempt runs."""

    number: int
    staging: str
    node_of: dict[int, int]  # world rank -> node rank
    arrived: set[int] = field(default_factory=set)  # ranks at the rendezvous
    joined: set[int] = field(default_factory=set)  # ranks in the process group
    preempted: set[int] = field(default_factory=set)  # ranks that checkpointed in a grace period and stopped
    # step -> rank -> the files of its saved part it reported ({rel: {size, sha256}}; empty on a local path)
    parts: dict[int, dict[int, dict]] = field(default_factory=lambda: defaultdict(dict))
    # step -> rank -> (when the save was asked for, how long it held training)
    save_times: dict[int, dict[int, tuple[float, float]]] = field(default_factory=lambda: defaultdict(dict))
    steps: dict[int, int] = field(default_factory=dict)  # rank -> the latest step it logged
    last_commit: tuple[int, float] | None = None  # (step, time) of this attempt's latest committed checkpoint

    @property
    def world(self) -> int:
        return len(self.node_of)


def group_failures(failures: list[RankFailure]) -> str:
    """``[ranks 0, 1] ValueError: ...`` once per distinct error, with one traceback each."""
    groups: dict[str, list[RankFailure]] = defaultdict(list)
    for f in failures:
        groups[f.message].append(f)
    parts = []
    for message, fs in groups.items():
        ranks = sorted(f.rank for f in fs)
        label = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        tb = next((f.traceback for f in fs if f.traceback), "")
        parts.append(f"[{label}] {message}" + (f"\n{tb.rstrip()}" if tb else ""))
    return "\n".join(parts)


class AttemptRouter:
    """Routes one attempt's polls: logs and metrics to the recorder, checkpoint parts to a commit."""

    def __init__(self, state: AttemptState, recorder: Recorder, run_dir: RunDir, keep: int,
                 heartbeat_s: float) -> None:
        self.a = state
        self.recorder = recorder
        self.run_dir = run_dir
        self.keep = keep  # checkpoint.keep
        self.heartbeat_s = heartbeat_s
        self.pace_tracker = PaceTracker()  # who starves for data, who the others wait for, this attempt

    def forward(self, node_rank: int, p: NodePoll) -> None:
        """Print and store one node's logs; handle its events."""
        self.recorder.logs(node_rank, p.logs)
        self.events(p.events)

    def events(self, events: list[dict]) -> None:
        a, rec = self.a, self.recorder
        records = []
        for e in events:
            rank = e.get("rank", 0)
            kind = e.get("kind")
            if kind == EventKind.ARRIVED:
                a.arrived.add(rank)
                if len(a.arrived) == a.world:
                    rec.mark("arrived", e["time"])
            elif kind == EventKind.PREEMPTED:
                a.preempted.add(rank)
            elif kind == EventKind.PREEMPT_NOTICE:
                rec.say(f"raylaunch: rank {rank} got a stop notice (SIGTERM): checkpointing at the next step")
            elif kind == EventKind.JOINED:
                a.joined.add(rank)
                if len(a.joined) == a.world:
                    rec.mark("joined", e["time"])
            elif kind == EventKind.METRICS:
                record = {"step": e.get("step"), "rank": rank, "node": a.node_of.get(rank), "attempt": a.number,
                          "world_size": a.world, "time": e["time"], **e.get("values", {})}
                records.append(record)
                if record["step"] is not None:
                    a.steps[rank] = max(int(record["step"]), a.steps.get(rank, 0))
                if rank == 0:
                    rec.mark("first_step", e["time"])
                    rec.progress(record, self.pace_tracker.verdict.values())
            elif kind == EventKind.RESOURCES and rank in a.steps:
                # Peak memory, at the rank's latest step, beside its metrics.
                records.append({"step": a.steps[rank], "rank": rank, "node": a.node_of.get(rank),
                                "attempt": a.number, "world_size": a.world, "time": e["time"],
                                **{k: v for k, v in e.items() if k.startswith("peak_")}})
            elif kind == EventKind.PACE:
                records.extend(self.pace(rank, e))
            elif kind == EventKind.CHECKPOINT:
                step = int(e["step"])
                a.parts[step][rank] = e.get("files") or {}
                a.save_times[step][rank] = (float(e.get("requested", e["time"])), float(e.get("blocked_s", 0.0)))
                if len(a.parts[step]) == a.world:
                    times = a.save_times.pop(step).values()
                    asked = min(t for t, _ in times)
                    timing = {"blocked_s": round(max(b for _, b in times), 4),
                              "to_commit_s": round(time.time() - asked, 4)}
                    c = self.run_dir.commit_checkpoint(
                        join_uri(a.staging, checkpoint_name(step)), step, a.number, a.world,
                        self.keep, reported=_agreed(a.parts.pop(step).values()), timing=timing,
                    )
                    timing["to_commit_s"] = round(time.time() - asked, 4)
                    rec.say(f"raylaunch: committed checkpoint of step {step}: {c.uri} (training held "
                            f"{timing['blocked_s']:.2f} s, committed {timing['to_commit_s']:.2f} s after the save)")
                    a.last_commit = (step, time.time())
        rec.metrics(records)

    def pace(self, rank: int, e: dict) -> list[dict]:
        """A rank's data_wait and sync_wait, at its latest step (or rank 0's, for a rank that logs
        none); said when the ranks starved for data or waited for change."""
        a = self.a
        if verdict := self.pace_tracker.add(rank, e):
            for line in verdict.lines or ["no rank is starved for data or waited for any more"]:
                self.recorder.say(f"raylaunch: {line}")
        step = a.steps.get(rank, a.steps.get(0))
        if step is None:
            return []
        return [{"step": step, "rank": rank, "node": a.node_of.get(rank), "attempt": a.number, "time": e["time"],
                 **{k: e[k] for k in PACE_KEYS if k in e}}]

    def silent(self, node_rank: int, info: NodeInfo, p: NodePoll, known: set[int]) -> list[RankFailure]:
        """The ranks of a node that is lost, or that stopped beating, as failures (not those in ``known``)."""
        heartbeat_s = self.heartbeat_s
        if p.state == NodeState.LOST:
            why = "was lost" if p.silent_s is None else (
                f"did not answer for {p.silent_s:.0f} s (timeouts.heartbeat_s is {heartbeat_s:g}): "
                "its host or its network link is down; treated as lost")
            return [RankFailure(rank=r, exitcode=-9, traceback="",
                                message=f"node {node_rank} ({info.node_id[:12]}, {info.ip}) {why}")
                    for r, n in sorted(self.a.node_of.items()) if n == node_rank]
        return [RankFailure(rank=rank, exitcode=-1, traceback="",
                            message=f"{HEARTBEAT_LOST} {age:.0f} s (timeouts.heartbeat_s is {heartbeat_s:g}): "
                                    "the process is stopped or frozen")
                for rank, age in p.beat_age_s.items() if age > heartbeat_s and rank not in known]


def _agreed(reports) -> dict[str, dict]:
    """The files the ranks reported for one checkpoint; a file two ranks reported
    differently (both wrote it, with ``save_on_each_node``) is left out, so the commit
    hashes what storage holds."""
    out: dict[str, dict] = {}
    clash: set[str] = set()
    for files in reports:
        for rel, meta in files.items():
            if out.setdefault(rel, meta) != meta:
                clash.add(rel)
    return {rel: meta for rel, meta in out.items() if rel not in clash}
