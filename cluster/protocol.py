"""What crosses a process boundary: the payload a rank gets, the events it reports, a node's poll, states.

Every process of a run speaks through these types: the driver hands each rank a
``WorkerPayload``; a rank writes ``EventKind`` events to a node-local file; the node
actor answers the driver's poll with a ``NodePoll`` (its ``NodeState``, the ranks'
events, logs, ``RankFailure`` s and return values); the driver records a ``RunStatus``
in ``result.json`` and prints ``Progress`` lines that ``jobs.progress`` reads back.
Nothing here imports Ray or torch.
"""

from __future__ import annotations

import dataclasses
import json
import signal as _signal
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, ClassVar

from cluster.context import WorkerContext

if TYPE_CHECKING:
    from cluster.metric_rows import RowBatch

__all__ = [
    "Arrived", "CheckpointInterval", "CheckpointPart", "EventKind", "FailureCause", "Joined", "Metrics", "NodePoll",
    "NodeState", "Pace", "Preempted", "PreemptNotice", "Progress", "RankEvent", "RankFailure", "Resources",
    "RestoredPart", "RunStatus", "SAID_ONCE", "ScriptCall", "SnapshotEvery", "SnapshotHeld", "SnapshotWriting",
    "WorkerPayload",
    "METRICS_ROWS", "decode_kind", "decode_rank_event", "metrics_line", "metrics_lines", "metrics_rows_line",
]

# The end of a rank's line that every rank says once (a metrics key renamed, say): the driver prints it once a run.
SAID_ONCE = "(said once)"


@dataclass(frozen=True)
class ScriptCall:
    """A script run in each rank as ``python path *args`` would run it (``accelerate launch``'s way)."""

    path: str  # relative to the job's working directory
    args: tuple[str, ...] = ()
    resume_arg: str | None = "--resume_from_checkpoint"
    # The job's working directory on the node; None: the rank's own current folder (a Ray job's working_dir).
    workdir: str | None = None
    # The runner's gradient accumulation at this world size and at the full one (they differ in an elastic
    # run below num_nodes): the accumulation a script sets in code is scaled by their ratio.
    accumulation: int = 1
    full_accumulation: int = 1


@dataclass(frozen=True)
class WorkerPayload:
    """Everything one rank needs from the driver, passed as a pickled argument."""

    context: WorkerContext
    attempt: int
    train_fn: str | None  # "module:function"; None when ``script`` is set
    config: dict
    events_path: str  # node-local file the node actor tails (``cluster.layout.NodeScratch``)
    staging_uri: str  # where this attempt's checkpoints are written before commit
    restore_uri: str | None  # the committed checkpoint to resume from, if any
    backend: str
    collective_timeout_s: float = 600.0
    # The spec's ``accelerate`` section: mixed_precision,
    # gradient_accumulation_steps, dataloader {even_batches, ...}.
    accelerate: dict = field(default_factory=dict)
    # Set instead of ``train_fn``: the script to run.
    script: ScriptCall | None = None
    # checkpoint.async: a save holds training only while the state is copied into memory.
    checkpoint_async: bool = True
    # checkpoint.every (seconds, "auto" or None) and the time between failures "auto" assumes: the spec's
    # checkpoint.mtbf_s, or the run's own (its books' wall clock per failed attempt) once it has failed.
    checkpoint_every: float | str | None = None
    mtbf_s: float = 86400.0
    # Snapshots in memory (cluster/checkpoint/memory.py): this node's folder of the run's snapshots (None: none are
    # taken), the optimizer steps between them (None: auto) and the MiB the node's snapshots may hold (None: auto).
    snapshot_dir: str | None = None
    snapshot_every: int | None = None
    snapshot_memory_mb: float | None = None
    # auto's interval to start from: the last attempt's (the largest of its ranks'), 1 at a run's first (a restart
    # took one a step again until measured, at 576 MiB a rank a second's write every step: make bench-recovery)
    snapshot_start: int = 1
    # The rank's whole environment, set when it forks from a warm rank host (``cluster.hosting.rankhost``), whose own
    # environment is not the job's. Not shown: it holds the job's secrets.
    environ: dict[str, str] | None = field(default=None, repr=False)


class EventKind(StrEnum):
    """What a rank reports on its events file (one JSON object a line, with ``time`` and ``rank``)."""

    ARRIVED = "arrived"  # at the rendezvous
    JOINED = "joined"  # in the process group
    METRICS = "metrics"  # ``step``, ``values``: one log call
    RESOURCES = "resources"  # ``peak_*``: the rank's peak memory
    # ``data_wait``, ``sync_wait``, ``batch_s``: where its step time went (cluster/rank/pace.py); ``span_s`` and
    # ``batches``: the window's length and batches; ``first_batch`` (once) and ``last_batch``: when its first
    # batch was asked for and its latest handed over
    PACE = "pace"
    RESTORED = "restored"  # ``step``, ``seconds``: it loaded the checkpoint an attempt resumes from
    # rank 0: ``seconds`` between saves that checkpoint.every chose, from ``save_s`` (a save's hold) and ``mtbf_s``
    CHECKPOINT_INTERVAL = "checkpoint_interval"
    CHECKPOINT = "checkpoint"  # ``step``, ``uri``, ``files``: its part of a checkpoint is written
    PREEMPT_NOTICE = "preempt_notice"  # it got SIGTERM and will checkpoint at the next step
    PREEMPTED = "preempted"  # every rank agreed to stop, and this one returned after checkpointing
    SNAPSHOT = "snapshot"  # ``step``: its part of a snapshot in memory is on its node (cluster/checkpoint/memory.py)
    SNAPSHOT_WRITING = "snapshot_writing"  # ``step``: its part of that snapshot is taken and being written, slowly
    SNAPSHOT_EVERY = "snapshot_every"  # ``every``: ``auto`` changed its interval, before a part said so


class NodeState(StrEnum):
    """The life of one node's ranks, as its actor (or, for ``LOST``, the driver) sees it."""

    IDLE = "idle"  # no ranks started yet
    RUNNING = "running"
    SUCCEEDED = "succeeded"  # every local rank returned
    FAILED = "failed"  # a local rank failed; torch's launcher ended the others
    STOPPED = "stopped"  # the driver stopped them
    LOST = "lost"  # the actor died, or stopped answering for timeouts.heartbeat_s

    @property
    def is_terminal(self) -> bool:
        return self is not NodeState.RUNNING and self is not NodeState.IDLE


class RunStatus(StrEnum):
    """A run's status in ``result.json`` (and what ``raylaunch run`` prints at the end)."""

    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"  # Ctrl-C, SIGTERM or `raylaunch stop`

    @property
    def is_terminal(self) -> bool:
        """The run has ended (succeeded, failed or stopped)."""
        return self is not RunStatus.RUNNING

    @classmethod
    def of(cls, result: dict | None, missing: RunStatus | None = None) -> RunStatus | None:
        """The status a ``result.json`` read back holds: ``missing`` when there is none (no file, no ``status``);
        None for a spelling this version does not know.

        >>> RunStatus.of({"status": "running"}) is RunStatus.RUNNING, RunStatus.of({"status": "?"}), RunStatus.of(None)
        (True, None, None)
        """
        value = (result or {}).get("status")
        if value is None:
            return missing
        try:
            return cls(value)
        except ValueError:
            return None


class FailureCause(StrEnum):
    """Why a rank failed, set where the fact first enters (the rank's error file, its exit, the driver's clock);
    what the driver does with a failure is decided by this, never by its message."""

    EXCEPTION = "exception"  # the function raised
    COLLECTIVE_TIMEOUT = "collective_timeout"  # it raised because a collective outlived the group's timeout
    EXITED = "exited"  # it exited with a code, no Python exception
    SIGNAL = "signal"  # a signal ended it (``RankFailure.signal`` says which)
    SILENT = "silent"  # no heartbeat for ``timeouts.heartbeat_s``: stopped or frozen
    NODE_LOST = "node_lost"  # its node (actor, raylet, host or link) is gone
    # it raised because a peer of its collective went away (its connection reset or closed): what another rank's
    # end does to the ranks that were waiting for it, a consequence and not a cause of its own
    PEER_LOST = "peer_lost"

    @property
    def is_hang(self) -> bool:
        """A rank that hung (stopped, frozen, or stuck in a collective) rather than crashed."""
        return self in (FailureCause.SILENT, FailureCause.COLLECTIVE_TIMEOUT)


# What torch says when a collective outlives the process group's timeout: gloo, then NCCL's watchdog. Torch's
# own text, read once where a rank's exception enters (``RankFailure.raised``).
_COLLECTIVE_TIMEOUTS = ("Timed out waiting", "collective operation timeout")
# What torch says when a collective's peer went away: gloo (a connection reset or closed; its Python name for the
# backend, to say which), then NCCL's remote error.
_PEER_LOST = ("Connection reset by peer", "Connection closed by peer",
                    "remote process exited or there was a network error")
# ... said by torch's collectives, not by the user's own sockets (a hub download's ConnectionResetError is the code's)
_BACKEND_MARKS = ("gloo", "NCCL", "DistBackendError", "ProcessGroup")


@dataclass(frozen=True)
class RankFailure:
    """A rank that ended badly: its exception (grouped by ``message`` across ranks), or the signal that ended it.
    Every one is built by one of its constructors below (the rank's end on its node, the driver's clock), each
    setting its ``cause``."""

    rank: int
    exitcode: int
    message: str  # the exception line, or the signal that ended the process
    traceback: str
    signal: str | None = None  # "SIGTERM", "SIGKILL", ... when a signal ended the process
    cause: FailureCause = FailureCause.EXCEPTION

    @property
    def preempted(self) -> bool:
        """Ended by SIGTERM (a spot node's notice, an orchestrator's stop): the one signal that means preemption."""
        return self.cause is FailureCause.SIGNAL and self.exitcode == -_signal.SIGTERM

    @property
    def peer_loss(self) -> str:
        """A collective's lost peer in torch's words, short, for the line of the ranks that failed after another
        ("gloo: Connection reset by peer"); "" for any other failure.

        >>> RankFailure.raised(0, 1, "RuntimeError: [../gloo/transport/tcp/pair.cc:598] Connection closed by peer "
        ...                    "[127.0.0.1]:3291", "").peer_loss
        'gloo: Connection closed by peer'
        >>> RankFailure.raised(0, 1, "ConnectionResetError: [Errno 104] Connection reset by peer", "").peer_loss
        ''
        """
        if self.cause is not FailureCause.PEER_LOST:
            return ""
        said = next((m for m in _PEER_LOST if m in self.message), "")
        backend = next((b for b in ("gloo", "NCCL") if b.lower() in self.message.lower()), "")
        return f"{backend}: {said}" if backend else said

    @classmethod
    def killed(cls, rank: int, exitcode: int, signal: str) -> "RankFailure":
        return cls(rank, exitcode, f"killed by signal {signal}", "", signal, FailureCause.SIGNAL)

    @classmethod
    def raised(cls, rank: int, exitcode: int, message: str, traceback: str) -> "RankFailure":
        """The function raised: a collective's timeout, and a collective whose peer went away, are told apart here,
        from torch's message."""
        cause = (FailureCause.COLLECTIVE_TIMEOUT if any(m in message for m in _COLLECTIVE_TIMEOUTS)
                 else FailureCause.PEER_LOST if (any(m in message for m in _PEER_LOST)
                                                 and any(b in message for b in _BACKEND_MARKS))
                 else FailureCause.EXCEPTION)
        return cls(rank, exitcode, message, traceback, cause=cause)

    @classmethod
    def exited(cls, rank: int, exitcode: int) -> "RankFailure":
        """The process exited with a code and left no Python exception."""
        return cls(rank, exitcode, f"exited with code {exitcode} (no Python exception)", "", cause=FailureCause.EXITED)

    @classmethod
    def silent(cls, rank: int, age_s: float, heartbeat_s: float) -> "RankFailure":
        """No heartbeat from the rank for ``age_s``, past ``timeouts.heartbeat_s``."""
        return cls(rank, -1, f"no heartbeat for {age_s:.0f} s (timeouts.heartbeat_s is {heartbeat_s:g}): the process "
                             "is stopped or frozen", "", cause=FailureCause.SILENT)

    @classmethod
    def node_lost(cls, rank: int, node: str, why: str) -> "RankFailure":
        """The rank's node is gone: ``node`` names it, ``why`` says how it was seen to go."""
        return cls(rank, -9, f"{node} {why}", "", cause=FailureCause.NODE_LOST)


@dataclass
class NodePoll:
    """What happened on a node since the previous poll."""

    events: list[dict] = field(default_factory=list)
    logs: list[tuple[int, str, str]] = field(default_factory=list)  # (rank, stream, line)
    state: NodeState = NodeState.IDLE
    failures: list[RankFailure] = field(default_factory=list)
    returns: dict[int, Any] = field(default_factory=dict)  # world rank -> return value
    # world rank -> seconds since the rank's heartbeat (absent before it started beating)
    beat_age_s: dict[int, float] = field(default_factory=dict)
    # how long the node's poll has waited unanswered, once the node answered since its ranks started (None: it
    # answered, has not yet, or its actor was seen to die); the driver's attempt decides when that is a lost node
    silent_s: float | None = None
    # the metrics rows among the events, rendered on the node (``cluster.metric_rows``), in the order read
    rows: list[RowBatch] = field(default_factory=list)


@dataclass(frozen=True)
class Progress:
    """Where training is, as the driver prints it and ``jobs.progress`` shows it.

    The driver hands it to a progress view (``jobs.progress``) inside a ``ProgressShown`` run event, or
    prints it as a line when no view follows.

    >>> p = Progress(step=5, values={"loss": "0.5"})
    >>> p.line()
    'raylaunch: step 5 loss=0.5'
    """

    step: int | None  # None: a record logged without a step
    values: dict[str, str] = field(default_factory=dict)  # metric -> as printed

    def line(self) -> str:
        shown = " ".join(f"{k}={v}" for k, v in self.values.items())
        return f"raylaunch: step {self.step} {shown}"

    @classmethod
    def of(cls, step: Any, values: dict) -> "Progress":
        """From a metrics record's step and values (floats shown with 4 significant digits)."""
        return cls(step, {k: f"{v:.4g}" if isinstance(v, float) else f"{v}" for k, v in values.items()})



# --- what a rank reports (its events file: one JSON object a line) --------------------


@dataclass(frozen=True)
class RankEvent:
    """One fact a rank reports, typed where it is written and where the driver reads it (``decode_rank_event``);
    ``time`` and ``rank`` are filled in by the session that emits it."""

    kind: ClassVar[EventKind]
    time: float = 0.0
    rank: int = 0

    def to_dict(self) -> dict[str, Any]:
        """The event as its line's object: ``kind``, then every field in order, each value as it is (not copied: a
        rank event holds plain data, and ``dataclasses.asdict``'s deep copy was half of what a ``session.log`` cost,
        #58)."""
        row: dict[str, Any] = {"kind": str(self.kind)}
        for name in _field_order(type(self)):
            row[name] = getattr(self, name)
        return row


@dataclass(frozen=True)
class Arrived(RankEvent):
    """The rank reached the rendezvous; ``pid``: its process (named with its node by ``show --per-rank``,
    ``status`` and ``stacks``)."""

    kind: ClassVar[EventKind] = EventKind.ARRIVED
    pid: int = 0


@dataclass(frozen=True)
class Joined(RankEvent):
    kind: ClassVar[EventKind] = EventKind.JOINED


@dataclass(frozen=True)
class Metrics(RankEvent):
    """One log call: ``values`` at ``step`` (None: logged without one)."""

    kind: ClassVar[EventKind] = EventKind.METRICS
    step: int | None = None
    values: dict = field(default_factory=dict)


def metrics_line(step: int | None, values: dict, at: float, rank: int) -> dict[str, Any]:
    """A ``Metrics`` event's line object with its time and rank set, as ``Metrics(step, values).to_dict()`` gives
    it, built without the event: a row a step is written, and the event and its walk of the fields were half of a
    row's write (``bench/step_costs.py``, #58).

    >>> metrics_line(3, {"loss": 0.5}, 1.5, 2) == {**Metrics(step=3, values={"loss": 0.5}).to_dict(), "time": 1.5,
    ...                                              "rank": 2}
    True
    >>> list(metrics_line(3, {}, 1.5, 2)) == list(Metrics().to_dict())
    True
    """
    return {"kind": _METRICS, "time": at, "rank": rank, "step": step, "values": values}


# A line of a rank's events file holding the rows it logged since its last write (``metrics_rows_line``).
METRICS_ROWS = "metrics_rows"


def metrics_rows_line(rows: list[tuple[int | None, float, dict]], rank: int) -> str:
    """The metrics rows a rank logged since its last write (``(step, time, values)`` each), as one line of its events
    file: one ``json.dumps`` of a batch of 100 rows cost 1.0 us a row where a line a row (``metrics_line``) cost 2.7
    us, on the training process's cores (#58). ``metrics_lines`` reads it back as ``metrics_line``'s objects.

    >>> line = metrics_rows_line([(3, 1.5, {"loss": 0.5}), (None, 2.0, {})], 2)
    >>> metrics_lines(json.loads(line)) == [metrics_line(3, {"loss": 0.5}, 1.5, 2), metrics_line(None, {}, 2.0, 2)]
    True
    """
    return json.dumps({"kind": METRICS_ROWS, "rank": rank, "rows": rows}) + "\n"


def metrics_lines(line: dict) -> list[dict[str, Any]]:
    """A ``metrics_rows_line``'s rows as ``metrics_line``'s objects (a row not of its shape is left out)."""
    rank, rows = line.get("rank", 0), line.get("rows")
    return [metrics_line(row[0], row[2], row[1], rank) for row in (rows if isinstance(rows, list) else ())
            if isinstance(row, list) and len(row) == 3 and isinstance(row[2], dict)]


@dataclass(frozen=True)
class Resources(RankEvent):
    """The rank's peak memory so far, in MiB (GPU where CUDA is in use)."""

    kind: ClassVar[EventKind] = EventKind.RESOURCES
    peak_rss_mb: float | None = None
    peak_gpu_mb: float | None = None

    def peaks(self) -> dict[str, float]:
        return {k: v for k, v in (("peak_rss_mb", self.peak_rss_mb), ("peak_gpu_mb", self.peak_gpu_mb))
                if v is not None}


@dataclass(frozen=True)
class Pace(RankEvent):
    """Where a window of the rank's step time went (``cluster.rank.pace``): shares waiting for data and for the other
    ranks, the window's length and batches, and when its batches were asked for and handed over (Unix times)."""

    kind: ClassVar[EventKind] = EventKind.PACE
    data_wait: float = 0.0
    sync_wait: float = 0.0
    batch_s: float = 0.0
    span_s: float = 0.0
    batches: int = 0
    optimizer_steps: int = 0  # the optimizer steps the rank took in the window (any optimizer's)
    last_batch: float | None = None
    first_batch: float | None = None  # in the rank's first window only


@dataclass(frozen=True)
class CheckpointPart(RankEvent):
    """The rank's part of the checkpoint of ``step`` is on storage (``files``: {rel: {size, sha256}} on an object
    store); ``requested``: when the save was asked for; ``blocked_s``: how long it held training; ``script_folder``:
    the folder a script gave ``save_state`` (its name alone when Accelerate named it), or Trainer's ``checkpoint-<n>``
    (``trainer``), None for a function's save."""

    kind: ClassVar[EventKind] = EventKind.CHECKPOINT
    step: int = 0
    uri: str = ""
    requested: float | None = None
    blocked_s: float = 0.0
    files: dict | None = None
    script_folder: str | None = None
    trainer: bool = False  # the folder is a transformers Trainer's checkpoint-<n>, not a save_state's


@dataclass(frozen=True)
class PreemptNotice(RankEvent):
    kind: ClassVar[EventKind] = EventKind.PREEMPT_NOTICE


@dataclass(frozen=True)
class Preempted(RankEvent):
    kind: ClassVar[EventKind] = EventKind.PREEMPTED


@dataclass(frozen=True)
class RestoredPart(RankEvent):
    """The rank loaded the checkpoint of ``step`` in ``seconds``."""

    kind: ClassVar[EventKind] = EventKind.RESTORED
    step: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class CheckpointInterval(RankEvent):
    """Rank 0: ``checkpoint.every`` chose a save every ``seconds``, from a save's hold ``save_s`` (``measured``, or
    assumed before the first) and ``mtbf_s``."""

    kind: ClassVar[EventKind] = EventKind.CHECKPOINT_INTERVAL
    seconds: float = 0.0
    save_s: float = 0.0
    measured: bool = False
    mtbf_s: float = 0.0


@dataclass(frozen=True)
class SnapshotHeld(RankEvent):
    """The rank's part of the snapshot of ``step`` is in its node's memory (``nbytes``); ``every``: the optimizer
    steps between its snapshots now; ``held_s``: how long its previous snapshot held training."""

    kind: ClassVar[EventKind] = EventKind.SNAPSHOT
    step: int = 0
    nbytes: int = 0
    every: int = 1
    held_s: float | None = None
    taken: float | None = None  # when its state was captured (Unix time)
    peer: bool = True  # copied to a peer node (False: a save's snapshot between due steps, kept on its node alone)


@dataclass(frozen=True)
class SnapshotWriting(RankEvent):
    """The rank took its part of the snapshot of ``step`` and is writing it, which takes it long (its recent writes
    took a second or more): the nodes keep the other ranks' parts of that step meanwhile (``cluster.snapshots.pin``),
    for the snapshot to be whole once this part is written."""

    kind: ClassVar[EventKind] = EventKind.SNAPSHOT_WRITING
    step: int = 0


@dataclass(frozen=True)
class SnapshotEvery(RankEvent):
    """``every: auto`` changed the optimizer steps between the rank's snapshots to ``every``, said at once (a part's
    ``SnapshotHeld`` says it too, but a snapshot due then may not be taken): a restart's ranks start from it."""

    kind: ClassVar[EventKind] = EventKind.SNAPSHOT_EVERY
    every: int = 1


_RANK_EVENTS: dict[str, type[RankEvent]] = {
    str(c.kind): c for c in (Arrived, Joined, Metrics, Resources, Pace, CheckpointPart, PreemptNotice, Preempted,
                             RestoredPart, CheckpointInterval, SnapshotHeld, SnapshotWriting, SnapshotEvery)
}


def decode_rank_event(row: Any) -> RankEvent | None:
    """A rank's event from its line's object; None for a kind this version does not know or fields that do not fit.

    >>> decode_rank_event({"kind": "metrics", "time": 1.0, "rank": 1, "step": 3, "values": {"loss": 0.5}})
    Metrics(time=1.0, rank=1, step=3, values={'loss': 0.5})
    >>> decode_rank_event(Pace(data_wait=0.5, batches=4).to_dict()) == Pace(data_wait=0.5, batches=4)
    True
    """
    return decode_kind(_RANK_EVENTS, row)


def decode_kind(kinds: dict[str, type], row: Any) -> Any:
    """The dataclass of ``kinds`` that ``row["kind"]`` names, from the row's fields it has (fields a newer version
    added are left out); None for an unknown kind or fields that do not fit."""
    cls = kinds.get(row.get("kind")) if isinstance(row, dict) else None
    if cls is None:
        return None
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = frozenset(f.name for f in dataclasses.fields(cls))
    fields = row.copy()  # (the driver decodes every rank's every row: the common case without a comprehension)
    del fields["kind"]
    if not fields.keys() <= names:  # fields a newer version added
        fields = {k: v for k, v in fields.items() if k in names}
    try:
        return cls(**fields)
    except TypeError:
        return None


_METRICS = str(EventKind.METRICS)
_FIELDS: dict[type, frozenset[str]] = {}  # each event class's field names (decoding runs for every event)
_ORDER: dict[type, tuple[str, ...]] = {}  # the same, in order (encoding runs for every event too)


def _field_order(cls: type) -> tuple[str, ...]:
    names = _ORDER.get(cls)
    if names is None:
        names = _ORDER[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names
