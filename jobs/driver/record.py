"""What a run did, written down: ``result.json``, metrics and logs, TensorBoard, the timeline, the progress line
and the driver's messages, every one with ``env.secrets`` masked.

The driver (``jobs.driver.driver``) decides; a ``Recorder`` writes. Storage that fails while
ranks train (full, say) is said once and the run goes on: the ranks' own errors say more.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, TextIO

from cluster.metric_rows import RowBatch
from cluster.protocol import SAID_ONCE, Progress, RunStatus
from jobs.driver.policy import WorldSize, resize_note
from jobs.run.board import Board
from jobs.run.events import (AttemptEnded, ProgressShown, Reserved, RunEvent, SessionStarted, Waiting,
                             decode)
from jobs.run.ledger import Ledger, ledger
from jobs.run.storage import RECORD_KEYS, RunDir
from jobs.spec.environment import Secrets

if TYPE_CHECKING:
    from cluster.nodes.group import NodeGroup

# How long a final result.json (succeeded, failed, stopped) is retried on storage that refuses it (a disk full for
# a moment): the last word of a run must reach storage; one that says running is written again soon anyway.
FINAL_RESULT_RETRY_S = 30.0

__all__ = ["Recorder", "RunResult"]


@dataclass
class RunResult:
    """The run as ``result.json`` holds it, written when each attempt starts and at the end."""

    status: RunStatus
    run_dir: str
    attempts: int = 0
    restarts: int = 0  # restarts after a failed attempt (preemptions apart)
    preemptions: int = 0
    infra_restarts: int = 0  # of the restarts, those after a failure outside the code (failure.max_infra_restarts)
    num_nodes: int = 0
    world_size: int = 0
    last_step: int | None = None
    last_metrics: dict = field(default_factory=dict)
    checkpoints: list[str] = field(default_factory=list)
    start_time: float = 0.0
    end_time: float = 0.0
    error: str | None = None
    return_value: Any = None  # rank 0's
    rank_results: dict = field(default_factory=dict)  # every rank's return value
    nodes: list[dict] = field(default_factory=list)
    # Each change of world size of an elastic run: attempt, step (the checkpoint it resumed from),
    # old_world_size, new_world_size, reason, and the gradient accumulation before and after.
    resizes: list[dict] = field(default_factory=list)
    # When the first attempt got where (Unix times): process_start, driver_ready (imports and
    # ray.init done), reserved, ranks_started, arrived, joined (last rank), first_step (rank 0).
    timeline: dict = field(default_factory=dict)
    # While the run runs: how `raylaunch stacks` reaches its node actors (ray_address,
    # namespace, node_actors: their names in node order, ranks: each node's world ranks).
    live: dict = field(default_factory=dict)
    # Where the wall clock went, every command that drove the run together (jobs/run/ledger.py):
    # wall_s, seconds (category -> seconds), ratio (training / wall_s).
    goodput: dict = field(default_factory=dict)
    # The process that drove the run (the last command, on the head for a submitted job): peak_rss_mb, cpu_s.
    driver: dict = field(default_factory=dict)


def _this_process() -> dict:
    """This process's peak resident memory and CPU time so far (the driver's, for result.json)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"peak_rss_mb": round(usage.ru_maxrss / 1024, 1), "cpu_s": round(usage.ru_utime + usage.ru_stime, 2)}


class Recorder:
    """Writes one run's outcome, metrics, logs and messages into its run directory and onto ``out``."""

    def __init__(self, run_dir: RunDir, out: TextIO | None = None,
                 on_event: Callable[[RunEvent], None] | None = None) -> None:
        self.run_dir = run_dir
        self.out = out
        self.on_event = on_event  # a progress view: every run event, stored or not
        self.events: list[RunEvent] = []  # the run's stored events, every session's (the ledger's books)
        self.attempt = 0  # the attempt begun latest (``begin_attempt``): its reservation's events carry it
        self._waiting = False  # a Waiting was said for this attempt's reservation
        self.secrets = Secrets()  # env.secrets' values, read in the driver's preflight
        self.result = RunResult(status=RunStatus.FAILED, run_dir=run_dir.uri)
        self.board: Board | None = None
        self._last_print = 0.0
        # What rank 0 reported since the last progress line (held back by the one-a-second limit): its newest step
        # and each metric's newest value, shown with the next line or when the attempt ends.
        self._unshown: tuple[Any, dict, dict, float | None] | None = None
        self._store_errors: set[str] = set()
        self._said_once: set[str] = set()  # a rank's "(said once)" line, printed for the first rank that says it

    # --- messages -----------------------------------------------------------------

    def say(self, text: str) -> None:
        self._print(self.secrets.mask(text))

    def _print(self, masked: str) -> None:
        print(masked, file=self.out or sys.stdout, flush=True)

    def mask(self, value: Any) -> Any:
        """``value`` with every secret masked in its strings, however deep."""
        if isinstance(value, str):
            return self.secrets.mask(value)
        if isinstance(value, (list, tuple)):
            return type(value)(self.mask(v) for v in value)
        if isinstance(value, dict):
            return {k: self.mask(v) for k, v in value.items()}
        return value

    # --- the run directory ----------------------------------------------------------

    def open_board(self) -> None:
        self.board = Board(self.run_dir)

    def mark(self, phase: str, at: float | None = None) -> None:
        """The first time the run got to ``phase`` (the first attempt's start-up, for `show` and the bench)."""
        self.result.timeline.setdefault(phase, at or time.time())

    # --- run events (jobs/run/events.py) --------------------------------------------------

    def begin_session(self, started: float) -> None:
        """Read the run's earlier events (a rerun continues the books), then say that this command drives it."""
        try:
            rows = self.run_dir.read_events()
        except OSError as exc:
            self.say(f"raylaunch: could not read the run's earlier events: {exc}; the books start now")
            rows = []
        self.events = [e for e in map(decode, rows) if e is not None]
        self.event(SessionStarted(time=started, pid=os.getpid()))

    def event(self, e: RunEvent) -> None:
        """Store ``e`` (if it is kept) and hand it to the view."""
        if isinstance(e, AttemptEnded):
            self._show_unshown()
        if e.stored:
            self.events.append(e)
            self._store(self.run_dir.append_events, [e.to_dict()])
        if self.on_event is not None:
            self.on_event(e)

    def begin_attempt(self, number: int) -> None:
        """Attempt ``number`` begins: the events of its reservation (``waiting``, ``reserved``) carry it; its own
        ``AttemptStarted`` comes once where it resumes from is final."""
        self.attempt, self._waiting = number, False

    def reserved(self, group: "NodeGroup", live: dict) -> None:
        """The attempt holds its nodes: result.json names them (and how `raylaunch stacks` reaches them), the
        books' wait ends, each node's interface is said."""
        self.mark("reserved")
        self.event(Reserved(time=time.time(), attempt=self.attempt, world_size=group.placement.world_size))
        r = self.result
        r.live = live
        r.nodes = [{"node_rank": i, "node_id": info.node_id, "ip": info.ip, "hostname": info.hostname,
                    "socket_ifname": socket.name, "rank_host_pid": info.rank_host_pid}
                   for i, (info, socket) in enumerate(zip(group.infos, group.sockets))]
        for i, (info, socket) in enumerate(zip(group.infos, group.sockets)):
            self.say(f"raylaunch: node {i} ({info.ip}, {info.hostname}): {socket.describe()}; {info.rank_host}")

    def resized(self, old: WorldSize, new: WorldSize, attempt: int, why: str) -> None:
        """Record and say a change of world size (its step, the checkpoint the attempt resumes from, comes later)."""
        self.result.resizes.append({
            "attempt": attempt, "step": None, "old_world_size": old.world_size, "new_world_size": new.world_size,
            "reason": why, "old_accumulation": old.accumulation, "new_accumulation": new.accumulation,
            "global_batch_kept": old.nodes * old.accumulation == new.nodes * new.accumulation,
        })
        self.say(f"raylaunch: attempt {attempt}: {resize_note(old, new, why)}")

    def waiting(self, at: float | None = None) -> None:
        """The attempt being reserved waits for nodes since ``at`` (now by default); said once per attempt."""
        if not self._waiting:
            self._waiting = True
            self.event(Waiting(time=at or time.time(), attempt=self.attempt))

    def ledger(self) -> Ledger:
        """The run's books as they stand (an attempt running now counts as running, not failed)."""
        return ledger(self.events, live=True)

    def write_result(self) -> None:
        """``result.json`` as the run stands: written when each attempt starts and ends, and at the end; the
        books go to TensorBoard too."""
        self.result.goodput = self.ledger().as_result()
        self.result.driver = _this_process()
        if self.board is not None:
            self.board.goodput(self.result.goodput, self.result.last_step or 0)
        try:
            self.result.checkpoints = [c.uri for c in self.run_dir.checkpoints.committed()]
        except OSError as exc:  # the outcome is still recorded, with the checkpoints last seen
            self.say(f"raylaunch: could not list the committed checkpoints: {exc}")
        data = dataclasses.asdict(self.result)
        # Storage that refuses a write for a moment (a full disk: bench/chaos.py's disk_full, inside a recovery)
        # must not fail the run: a result.json of a run still going is said and skipped (the next attempt's or the
        # end's replaces it); a final one is retried for FINAL_RESULT_RETRY_S, then the caller hears the error.
        deadline = time.monotonic() + FINAL_RESULT_RETRY_S
        while True:
            try:
                self.run_dir.write_result(data)
                return
            except OSError as exc:
                if self.result.status == RunStatus.RUNNING:
                    self._store_failed(exc)
                    return
                if time.monotonic() > deadline:
                    raise
                self._store_failed(exc)
                time.sleep(1.0)

    def logs(self, node_rank: int, logs: list[tuple[int, str, str]]) -> None:
        """Print one node's rank output and append it to each rank's log, masked once."""
        if not logs:
            return
        by_rank: dict[int, list[str]] = defaultdict(list)
        shown = []
        for rank, _, line in logs:
            line = self.secrets.mask(line)  # before it is stored too
            by_rank[rank].append(line)
            if line.endswith(SAID_ONCE):  # every rank says it once: the terminal shows it once (each rank's log keeps it)
                if line in self._said_once:
                    continue
                self._said_once.add(line)
            shown.append(f"[node {node_rank} rank {rank}] {line}")
        if shown:
            self._print("\n".join(shown))  # one write for the node's lines
        for rank, lines in by_rank.items():
            self._store(self.run_dir.append_log, rank, lines)

    def metrics(self, records: list[dict]) -> None:
        """Rows the driver built (its measurements: pace, peak memory)."""
        if records:
            self.rows(RowBatch.of(records))

    def rows(self, batch: RowBatch) -> None:
        """Rows as a batch (``cluster.metric_rows``: a node's, rendered and summed there): their lines appended to
        metrics.jsonl, their sums to TensorBoard's."""
        self._store(self.run_dir.append_metric_text, batch.text)
        self.board.add(batch)

    def _store(self, write, *args) -> None:
        """Write metrics or logs; storage that fails (full, say) is reported, and the driver
        keeps supervising the ranks, whose own errors say more."""
        try:
            write(*args)
        except OSError as exc:
            self._store_failed(exc)

    def _store_failed(self, exc: OSError) -> None:
        """Say once per distinct error that the run directory refused a write."""
        if str(exc) not in self._store_errors:
            self._store_errors.add(str(exc))
            self.say(f"raylaunch: could not write to the run directory {self.run_dir.uri}: {exc}")

    # --- progress --------------------------------------------------------------------

    def progress(self, record: dict, pace: dict[str, str] | None = None) -> None:
        """Rank 0's metrics record: the result's last step and metrics, and at most one progress
        line a second (never dropping an evaluation)."""
        r = self.result
        if record.get("step") is not None:
            r.last_step = max(r.last_step or 0, int(record["step"]))
        values = {k: v for k, v in record.items() if k not in RECORD_KEYS}
        r.last_metrics.update(values)
        # The ranks' pace verdict (jobs/driver/pace.py) rides along while it holds: straggler=1 starved=1
        extra = {**(pace or {}), **({"world_size": record["world_size"]} if "world_size" in record else {})}
        if self._unshown is not None:  # a line held back: its newer metrics show with this one (a loss with the eval)
            values = {**self._unshown[1], **values}
            self._unshown = None
        now = time.monotonic()
        if now - self._last_print < 1.0 and not any("eval" in k for k in values):
            if record.get("step") is not None:
                self._unshown = (record["step"], values, extra, record.get("time"))
            return
        self._last_print = now
        self._show(record.get("step"), {**values, **extra}, record.get("time"))

    def _show(self, step: Any, values: dict, at: float | None) -> None:
        shown = Progress.of(step, values)
        if self.on_event is None or shown.step is None:  # a step of None is a plain line to a view too
            self.say(shown.line())
        else:
            self.on_event(ProgressShown(time=at or time.time(), step=shown.step,
                                        values={self.secrets.mask(k): self.secrets.mask(v)
                                                for k, v in shown.values.items()}))

    def _show_unshown(self) -> None:
        """The newest progress the one-a-second limit held back, so the attempt's last line is its last step."""
        if self._unshown is not None:
            step, values, extra, at = self._unshown
            self._unshown = None
            self._show(step, {**values, **extra}, at)
