"""What the ranks of one attempt reported: events routed to the recorder and to checkpoint commits.

``jobs.driver.attempt`` hands every node's poll to an ``AttemptRouter``; it keeps the attempt's
state (who arrived, joined, checkpointed, was preempted) and asks ``jobs.run.storage`` to
commit a checkpoint once every rank reported its part. What ends the attempt is the attempt's.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

from cluster.layout import checkpoint_name
from cluster.metric_rows import RowBatch, RowBatcher, keep_latest, metrics_row
from cluster.protocol import (
    Arrived, CheckpointInterval, CheckpointPart, FailureCause, Joined, NodePoll, Pace, PreemptNotice, Preempted, RankFailure,
    Resources, RestoredPart, SnapshotEvery, SnapshotHeld, SnapshotWriting, decode_rank_event,
)
from cluster.storage_io import join_uri
from jobs.driver.memory import SnapshotBook
from jobs.driver.pace import PACE_KEYS, PaceTracker
from jobs.driver.record import Recorder
from jobs.run.events import Committed, FirstStep, RanksPlaced, Restored, Saved, Work
from jobs.run.storage import RunDir

__all__ = ["AttemptRouter", "AttemptState", "group_failures"]

# How long measurements wait for a first logged step before they are stored at the batches read instead.
PENDING_S = 30.0


@dataclass
class AttemptState:
    """What the driver tracks while one attempt runs."""

    number: int
    staging: str
    node_of: dict[int, int]  # world rank -> node rank
    arrived: set[int] = field(default_factory=set)  # ranks at the rendezvous
    pids: dict[int, int] = field(default_factory=dict)  # world rank -> its process, as it arrived
    joined: set[int] = field(default_factory=set)  # ranks in the process group
    joined_at: float | None = None  # when the last of them joined
    failed_at: float | None = None  # when the driver first saw a rank fail
    preempted: set[int] = field(default_factory=set)  # ranks that checkpointed in a grace period and stopped
    # step -> rank -> the files of its saved part it reported ({rel: {size, sha256}}; empty on a local path)
    parts: dict[int, dict[int, dict]] = field(default_factory=lambda: defaultdict(dict))
    # step -> rank -> (when the save was asked for, how long it held training)
    save_times: dict[int, dict[int, tuple[float, float]]] = field(default_factory=lambda: defaultdict(dict))
    steps: dict[int, int] = field(default_factory=dict)  # rank -> the latest step it logged
    batches: dict[int, int] = field(default_factory=dict)  # rank -> the batches it read (its pace reports')
    optimizer_steps: dict[int, int] = field(default_factory=dict)  # rank -> the optimizer steps it took (the same)
    last_commit: tuple[int, float] | None = None  # (step, time) of this attempt's latest committed checkpoint
    notice_at: float | None = None  # when a rank first got a stop notice (SIGTERM)
    # For the goodput ledger: when training began and was last seen, each rank's seconds waiting for input,
    # and each rank's restore (when it reported it, seconds, step).
    first_step: float | None = None
    last_work: float | None = None
    data_wait_s: dict[int, float] = field(default_factory=dict)
    restored: dict[int, tuple[float, float, int]] = field(default_factory=dict)
    resume_step: int = 0  # the checkpoint the attempt resumed from (0: the beginning)
    # Measurements (pace, peak memory) made before any step was logged: (rank, time, values, its progress by then)
    pending: list[tuple[int, float, dict, int]] = field(default_factory=list)

    def progress(self, rank: int) -> int:
        """How far a rank that logs no step got in this attempt: its optimizer steps, or (an optimizer torch's hooks
        do not see) the batches it read."""
        return self.optimizer_steps.get(rank) or self.batches.get(rank, 0)

    @property
    def world(self) -> int:
        return len(self.node_of)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def group_failures(failures: list[RankFailure]) -> str:
    """The cause first, ``[ranks 0, 1] ValueError: ...`` once per distinct error with one traceback each; then, in
    one line, the ranks that only lost their peer to it (their collective's connection reset or closed: a
    consequence, whenever it was reported). When nothing but lost peers was seen, they are the cause.

    >>> print(group_failures([RankFailure.raised(0, 1, "RuntimeError: [gloo/pair.cc:534] Read error: Connection "
    ...                                          "reset by peer", "Traceback ..."), RankFailure.killed(1, -9, "SIGKILL")]))
    [rank 1] killed by signal SIGKILL
    [rank 0] failed after it: lost its peer (gloo: Connection reset by peer)
    """
    causes = [f for f in failures if f.cause is not FailureCause.PEER_LOST]
    after = [f for f in failures if f.cause is FailureCause.PEER_LOST] if causes else []
    groups: dict[str, list[RankFailure]] = defaultdict(list)
    for f in causes or failures:
        groups[f.message].append(f)
    parts = []
    for message, fs in groups.items():
        tb = next((f.traceback for f in fs if f.traceback), "")
        parts.append(f"[{_ranks(sorted(f.rank for f in fs))}] {message}" + (f"\n{tb.rstrip()}" if tb else ""))
    if after:
        ranks = sorted({f.rank for f in after})
        said = ", ".join(dict.fromkeys(f.peer_loss for f in after))
        parts.append(f"[{_ranks(ranks)}] failed after {'it' if len(groups) == 1 else 'them'}: lost "
                     f"{'its' if len(ranks) == 1 else 'their'} peer ({said})")
    return "\n".join(parts)


class AttemptRouter:
    """Routes one attempt's polls: logs and metrics to the recorder, checkpoint parts to a commit."""

    def __init__(self, state: AttemptState, recorder: Recorder, run_dir: RunDir, keep: int,
                 hosts: dict[int, tuple[str, str]] | None = None, snapshots: SnapshotBook | None = None) -> None:
        self.a = state
        self.snapshots = snapshots  # the run's snapshots in memory: each part a rank wrote, copied to its node's peer
        self.hosts = hosts or {}  # node rank -> (hostname, ip)
        self.recorder = recorder
        self.run_dir = run_dir
        self.keep = keep  # checkpoint.keep
        self.pace_tracker = PaceTracker()  # who starves for data, who the others wait for, this attempt
        self._work_said: Work | None = None
        self._batcher = RowBatcher(state.number, state.world, state.node_of)  # metrics rows that come one by one

    def forward(self, node_rank: int, p: NodePoll) -> None:
        """Print and store one node's logs; store its metrics rows; handle its events."""
        self.recorder.logs(node_rank, p.logs)
        for batch in p.rows:
            self.rows(batch)
        self.events(p.events)

    def rows(self, batch: RowBatch) -> None:
        """Metrics rows (a node's, rendered there): stored; each rank's latest step and when training was seen noted;
        rank 0's on the progress line. They are stored before the events that came with them: a checkpoint part's
        commit then covers the rows its rank logged before the save (a driver killed after the commit loses nothing
        of the steps it covers: a rerun resumes past them and never logs them again)."""
        a, rec = self.a, self.recorder
        if not batch:
            return
        rec.rows(batch)
        keep_latest(a.steps, batch.steps)
        if batch.steps and a.pending:
            rec.metrics(self._pending(final=False))  # measured before the first step: now at it
        if batch.first is not None:
            self._worked(batch.first, batch.last)
        for row in batch.lead:
            rec.mark("first_step", row["time"])
            rec.progress(row, self.pace_tracker.verdict.values())

    def events(self, events: list[dict]) -> None:
        """One node's events, typed (``cluster.protocol.decode_rank_event``; a kind this version does not know is
        left out), each handled by its kind; metrics rows among them go first, as a node's batch does."""
        a, rec = self.a, self.recorder
        events, batch = self._batcher.take(events)
        self.rows(batch)
        records: list[dict] = []
        for e in filter(None, map(decode_rank_event, events)):
            rank = e.rank
            match e:
                case Arrived():
                    a.arrived.add(rank)
                    a.pids[rank] = e.pid
                    if len(a.arrived) == a.world:
                        rec.mark("arrived", e.time)
                        rec.event(self.placed(e.time))
                case Joined():
                    a.joined.add(rank)
                    if len(a.joined) == a.world:
                        a.joined_at = e.time
                        rec.mark("joined", e.time)
                case Preempted():
                    a.preempted.add(rank)
                case PreemptNotice():
                    a.notice_at = min(a.notice_at or e.time, e.time)
                    rec.say(f"raylaunch: rank {rank} got a stop notice (SIGTERM): checkpointing at the next step")
                case Resources():  # peak memory, beside the rank's metrics
                    records += self._measured(rank, e.time, e.peaks())
                case Pace():
                    records += self.pace(e)
                case RestoredPart():
                    a.restored[rank] = (e.time, e.seconds, e.step)
                    if len(a.restored) == a.world:
                        rec.event(Restored(time=max(t for t, _, _ in a.restored.values()), attempt=a.number,
                                           step=max(s for _, _, s in a.restored.values()),
                                           seconds=round(max(s for _, s, _ in a.restored.values()), 4)))
                case CheckpointPart():
                    # The measurements read before it go to storage first, as the metrics rows did (``rows``)
                    if records:
                        rec.metrics(records)
                        records = []
                    self.checkpoint(e)
                case SnapshotHeld():
                    if self.snapshots is not None:
                        self.snapshots.held_part(e.step, rank, a.node_of[rank], e.nbytes, e.every, e.taken or e.time,
                                                 peer=e.peer)
                        if line := self.snapshots.news():
                            rec.say(line)
                case SnapshotWriting():
                    if self.snapshots is not None:
                        self.snapshots.writing_part(e.step, rank)
                case SnapshotEvery():
                    if self.snapshots is not None:
                        self.snapshots.every[rank] = e.every
                case CheckpointInterval():
                    cost = (f"a save holds training {e.save_s:.2f} s" if e.measured else
                            f"a save assumed to hold training {e.save_s:.2f} s until one is measured")
                    rec.say(f"raylaunch: checkpoint.every auto: a save every {e.seconds:.1f} s ({cost}; a failure "
                            f"every {e.mtbf_s:.0f} s)")
        if self.snapshots is not None:
            self.snapshots.poll()  # copies to the peers done, the next ones started
        if a.pending and a.joined_at is not None and time.time() - a.pending[0][1] > PENDING_S:
            records += self._pending(final=True)  # a function that logs no step at all
        rec.metrics(records)

    def row(self, rank: int, at: float, step: int | None, values: dict) -> dict:
        """A metrics.jsonl row of this attempt (``cluster.metric_rows.metrics_row``)."""
        a = self.a
        return metrics_row(step, rank, a.node_of.get(rank), a.number, a.world, at, values)

    def _measured(self, rank: int, at: float, values: dict) -> list[dict]:
        """A rank's measurement (pace, peak memory) as a row at its step; held while no step is known yet."""
        step = self.step_of(rank)
        if step is None:
            self.a.pending.append((rank, at, values, self.a.progress(rank)))
            return []
        return [self.row(rank, at, step, values)]

    def _pending(self, final: bool) -> list[dict]:
        """The held measurements: at their rank's step once one is known; ``final`` (the attempt ends, or none came
        for ``PENDING_S``) the rest at the step the attempt resumed from plus the optimizer steps the rank had taken. An
        attempt whose ranks never formed their group trained nothing: what they measured is dropped."""
        a = self.a
        if final and a.joined_at is None:
            a.pending = []
            return []
        out, keep = [], []
        for rank, at, values, progress in a.pending:
            step = self.step_of(rank)
            if step is None and final:
                step = a.resume_step + progress
            if step is None:
                keep.append((rank, at, values, progress))
            else:
                out.append(self.row(rank, at, step, values))
        a.pending = keep
        return out

    def finish(self) -> None:
        """The attempt ended: what it measured before any step was known is stored, and where its training stood
        is said. When no step was seen at all, the ranks' rendezvous is said as a first step not seen and the failure
        (or now) as the last moment known: the books count it as training only if the attempt succeeded (a function
        that neither logs nor reads a prepared dataloader), as start-up otherwise (#56.9: a rank killed before its
        first pace report made the whole start-up of its attempt recompute)."""
        a, rec = self.a, self.recorder
        rec.metrics(self._pending(final=True))
        if a.first_step is None and a.joined_at is not None:
            now = time.time()
            rec.event(FirstStep(time=a.joined_at, attempt=a.number, seen=False))
            rec.event(Work(time=now, attempt=a.number, last=min(a.failed_at or now, now), first=None))
            return
        if w := self.work():
            rec.event(w)

    def step_of(self, rank: int) -> int | None:
        """The step a rank's measurements are stored at: its latest logged step, else rank 0's; None before any."""
        a = self.a
        return a.steps.get(rank, a.steps.get(0))

    def _worked(self, began: float, seen: float) -> None:
        """Training was seen from ``began`` (a step's first batch, or a step logged) to ``seen``."""
        a = self.a
        a.last_work = max(a.last_work or seen, seen)
        if a.first_step is None:
            self.recorder.event(FirstStep(time=began, attempt=a.number))
        a.first_step = min(a.first_step or began, began)  # a rank's earlier first batch, reported later: in Work

    def placed(self, at: float) -> RanksPlaced:
        """Where every rank of the attempt runs: its node, the node's host and address, its process."""
        a, ranks = self.a, []
        for rank in sorted(a.node_of):
            hostname, ip = self.hosts.get(a.node_of[rank], ("", ""))
            ranks.append({"rank": rank, "node": a.node_of[rank], "hostname": hostname, "ip": ip,
                          "pid": a.pids.get(rank, 0)})
        return RanksPlaced(time=at, attempt=a.number, ranks=ranks)

    def checkpoint(self, e: CheckpointPart) -> None:
        """A rank's part of a checkpoint is on storage: commit once every rank's is."""
        a, rec = self.a, self.recorder
        step = e.step
        a.parts[step][e.rank] = e.files or {}
        a.save_times[step][e.rank] = (e.requested if e.requested is not None else e.time, e.blocked_s)
        if len(a.parts[step]) < a.world:
            return
        times = a.save_times.pop(step).values()
        asked = min(t for t, _ in times)
        timing = {"blocked_s": round(max(b for _, b in times), 4), "to_commit_s": round(time.time() - asked, 4)}
        rec.event(Saved(time=asked, attempt=a.number, step=step, held_s=timing["blocked_s"]))
        c = self.run_dir.checkpoints.commit(
            join_uri(a.staging, checkpoint_name(step)), step, a.number, a.world,
            self.keep, reported=_agreed(a.parts.pop(step).values()), timing=timing,
        )
        timing["to_commit_s"] = round(time.time() - asked, 4)
        if self.snapshots is not None:  # the pace a snapshot's commit after a stop notice is estimated at
            self.snapshots.commit_took(c.nbytes, timing["to_commit_s"])
        # A script's log names the staging folder its save_state wrote (Accelerate's "Saving current state to ..."):
        # this line names the folder it asked for, which holds the same files
        mine = (f"Trainer's {e.script_folder}; " if e.trainer else
                f"the script's save_state({e.script_folder!r}); " if e.script_folder else "")
        rec.say(f"raylaunch: committed checkpoint of step {step}: {c.uri} ({mine}training held "
                f"{timing['blocked_s']:.2f} s, committed {timing['to_commit_s']:.2f} s after the save)")
        a.last_commit = (step, time.time())
        rec.event(Committed(time=a.last_commit[1], attempt=a.number, step=step, state_time=asked))

    def pace(self, e: Pace) -> list[dict]:
        """A rank's data_wait and sync_wait, at its step (``_measured``); said when the ranks starved for data or
        waited for change; the seconds it waited for data, for the goodput ledger."""
        a, rank = self.a, e.rank
        values = {k: getattr(e, k) for k in PACE_KEYS}
        if verdict := self.pace_tracker.add(rank, values):
            for line in verdict.lines or ["no rank is starved for data or waited for any more"]:
                self.recorder.say(f"raylaunch: {line}")
        a.batches[rank] = a.batches.get(rank, 0) + e.batches
        a.optimizer_steps[rank] = a.optimizer_steps.get(rank, 0) + e.optimizer_steps
        a.data_wait_s[rank] = a.data_wait_s.get(rank, 0.0) + e.data_wait * e.span_s
        seen = e.last_batch if e.last_batch is not None else e.time
        self._worked(e.first_batch if e.first_batch is not None else seen - e.span_s, seen)
        return self._measured(rank, e.time, values)

    def work(self) -> Work | None:
        """Where this attempt's training stands, as a ``Work`` event, when it changed since the last one."""
        a = self.a
        if a.last_work is None:
            return None
        w = Work(time=time.time(), attempt=a.number, last=a.last_work, first=a.first_step,
                 data_wait_s=round(max(a.data_wait_s.values(), default=0.0), 3), step=a.steps.get(0))
        said = self._work_said
        if said is not None and (said.first, said.last, said.data_wait_s, said.step) == (w.first, w.last,
                                                                                           w.data_wait_s, w.step):
            return None
        self._work_said = w
        return w


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
