"""The session inside a rank: what ``cluster.runtime`` (the public face a training function imports) hands out.

Under the runner its calls reach the driver and the run directory; outside it (plain ``python`` or ``accelerate
launch``) metrics go to ``./raylaunch-local/metrics-rank<R>.jsonl`` and checkpoints to
``./raylaunch-local/checkpoints`` (``RAYLAUNCH_LOCAL_DIR`` moves that folder). Saving, uploading and restoring under
the runner is ``cluster.checkpoint.staged``'s; the worker entry point (``cluster.rank.worker``) drives the session's
runner side (``install``, ``emit``, ``handle_sigterm``, ``stopped_for_preemption``).
"""

from __future__ import annotations

import collections
import json
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from accelerate.tracking import GeneralTracker

from cluster.checkpoint.resume import init_optimizers_for_load, load_loader_states, save_loader_states
from cluster.checkpoint.staged import CheckpointError, CheckpointSaveError, ScriptSave, StagedCheckpoints
from cluster.context import RECORD_KEYS, WorkerContext
from cluster.layout import CHECKPOINTS, LOCAL_LATEST, checkpoint_name, checkpoint_step
from cluster.protocol import (
    SAID_ONCE, CheckpointInterval, CheckpointPart, Metrics, PreemptNotice, RankEvent, RestoredPart, WorkerPayload,
    metrics_rows_line,
)
from cluster.rank import restart_sync
from cluster.rank.metric_caps import MAX_KEY_CHARS, MAX_KEYS, capped
from cluster.rank.stops import StopCheck
from cluster.strategy import Resolved

__all__ = ["CheckpointError", "CheckpointSaveError", "RunnerTracker", "Session", "StoppedAtSnapshot", "WorkerPayload",
           "get_session"]


# Outside the runner, the same defaults as the spec's, so a function gives the
# same data order under ``accelerate launch`` as under the runner.
_LOCAL_ACCELERATE = {"dataloader": {"even_batches": True, "use_seedable_sampler": True}}


class RunnerTracker(GeneralTracker):
    """An Accelerate tracker that logs on every rank, not only the main one."""

    name = "raylaunch"
    requires_logging_directory = False
    main_process_only = False

    def __init__(self, session: "Session") -> None:
        super().__init__()
        self._session = session

    @property
    def tracker(self) -> "Session":
        return self._session

    def store_init_configuration(self, values: dict) -> None:
        """The run's configuration is its spec.yaml already: nothing more is recorded."""

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        # Accelerate calls this on the main process only; Session.log is per rank.
        self._session.log(values, step)


_RECORD_KEYS = frozenset(RECORD_KEYS)


def _plain_row(values: Any) -> dict | None:
    """A log call's ``values`` as its row, when it is the common one: a dict of at most ``MAX_KEYS`` names of the
    user's own (a str of at most ``MAX_KEY_CHARS``, none a row's own key) to plain numbers (a float, an int within the
    caps, a bool, None) or one-element tensors on the CPU (read now); None for any other (the caps' walk, or the
    device's thread, takes it). A copy: the caller may change its dict after the call. Walking every value through
    the caps cost a ``session.log`` on a 0.26 ms step more than the rest of it (``bench/step_costs.py``, #58).

    >>> _plain_row({"loss": 0.5, "epoch": 1, "lr": None}), _plain_row({"step": 1}), _plain_row({"text": "a"})
    ({'loss': 0.5, 'epoch': 1, 'lr': None}, None, None)
    """
    if type(values) is not dict or len(values) > MAX_KEYS:
        return None
    row = {}
    for key, value in values.items():
        if type(key) is not str or len(key) > MAX_KEY_CHARS or key in _RECORD_KEYS:
            return None
        kind = type(value)
        if kind is torch.Tensor and value.is_cpu and value.numel() == 1:
            value = value.item()
            kind = type(value)
        if not (kind is float or kind is bool or value is None or (kind is int and -2**63 <= value <= 2**63)):
            return None
        row[key] = value
    return row


def _holds_device_values(values: Any) -> bool:
    """Whether a log call's values hold a tensor on a device other than the CPU (reading it waits for the device)."""
    return isinstance(values, dict) and any(
        getattr(getattr(v, "device", None), "type", "cpu") != "cpu" and callable(getattr(v, "item", None))
        for v in values.values())


class _DeviceRows:
    """Rows whose values are read off the device by a thread of their own, in the order they were logged; one the
    thread cannot write (a value that fails to read) is written as far as it can be, by the same caps as any."""

    def __init__(self, write: Any) -> None:
        import queue

        self._write = write
        self._rows: Any = queue.Queue()
        threading.Thread(target=self._run, daemon=True, name="raylaunch-device-metrics").start()

    def put(self, values: dict, step: int | None, at: float) -> None:
        self._rows.put((values, step, at))

    def flush(self) -> None:
        self._rows.join()

    def _run(self) -> None:
        while True:
            values, step, at = self._rows.get()
            try:
                self._write(values, step, at)
            except Exception as exc:  # noqa: BLE001 - a metric never fails the rank
                print(f"raylaunch: metrics of step {step} not written: {exc}", file=sys.stderr, flush=True)
            finally:
                self._rows.task_done()


# A metrics row is written to the rank's events file by a thread of the session's, with the rows logged in the same
# this many seconds: the row's line (its JSON) and its write were 22 of the 43 us a ``session.log`` took on a 0.3 ms
# step (``bench/step_costs.py``, #58), in cache-cold code between the step's kernels. Any other event is written at
# once, after the rows logged before it.
METRICS_BATCH_S = 0.25


class StoppedAtSnapshot(BaseException):
    """Raised out of a function's loop (its loader, asked for the next batch) once every rank agreed on a stop notice
    and the snapshot of that step is written: the rest is the restart's, from there; the worker reports the rank as
    preempted. A BaseException, as SystemExit is: the training code's ``except Exception`` does not take it."""


# A rank told to stop whose loop never asks for another batch (it was in its evaluation, or past its last step) ends
# as SIGTERM ends a process after this many seconds.
STOP_GRACE_S = 10.0


class Session:
    """This process's link to the runner (or to a local folder outside it)."""

    def __init__(self, payload: WorkerPayload | None, local_dir: Path | None = None) -> None:
        self.payload = payload
        self._pid = os.getpid()  # the rank's (``emit``: a process it forks reports nothing)
        self._local_dir = local_dir
        if payload is not None:
            self._events_path = Path(payload.events_path)
        else:
            assert local_dir is not None
            rank = int(os.environ.get("RANK", "0"))
            self._events_path = local_dir / f"metrics-rank{rank}.jsonl"
        self._events_path.parent.mkdir(parents=True, exist_ok=True)
        self._events = open(self._events_path, "a")
        # Reentrant: the SIGTERM handler emits, and may run on the main thread while it is inside emit.
        self._lock = threading.RLock()
        # Metrics rows not written yet ((step, values, time)), and the thread's signal that one waits
        self._rows: collections.deque[tuple[int | None, dict, float]] = collections.deque()
        self._rows_due = threading.Event()
        self._row_writer: threading.Thread | None = None
        self._cooperative = False  # the function calls preempted()
        # checkpoint_due(): when the last save returned (or training began), how long the last save held
        # training (None before the first), and the interval last announced
        self._since_save: float | None = None
        self._save_s: float | None = None
        self._interval_said: float | None = None
        self._stop_requested = False  # this rank got SIGTERM
        self._stopped_for_preemption = False  # every rank agreed to stop
        self._checkpoints = (StagedCheckpoints(payload.staging_uri, payload.restore_uri, self._saved,
                                               context=payload.context, node_dir=str(Path(payload.events_path).parent),
                                               background=payload.checkpoint_async, log=self.log,
                                               snapshot_dir=payload.snapshot_dir)
                             if payload is not None else None)
        self._said: set[str] = set()  # what _clean has said about the values (once each)
        self._device_rows: _DeviceRows | None = None  # from the first row with a value on a GPU: the thread reading
        self.strategy: Resolved | None = None  # set by the worker (cluster.rank.sharding.install)
        self.resumed_step: int | None = None  # the committed checkpoint's step, once handed to a script or Trainer
        self._waits: list[Any] = []  # more writes to wait for before the rank is done (Trainer's checkpoints)
        self.snapshots: Any = None  # this rank's snapshots in memory (``start_snapshots``), when taken
        self._agreement: StopCheck | None = None  # with snapshots: where the ranks agree on a stop notice
        self._stopping = False  # every rank agreed to stop: this one is writing its snapshot
        self._meter: Any = None  # the rank's pace meter: the optimizer steps it took

    @property
    def under_runner(self) -> bool:
        return self.payload is not None

    @property
    def context(self) -> WorkerContext | None:
        return self.payload.context if self.payload else None

    def accelerator_kwargs(self, **overrides: Any) -> dict:
        """Keyword arguments for ``Accelerator(...)`` that apply the spec's ``accelerate`` section.

        ``Accelerator(**session.accelerator_kwargs())`` gets the runner's
        tracker, mixed precision, gradient accumulation and dataloader
        configuration; ``overrides`` win over all of them.
        """
        from accelerate import DataLoaderConfiguration

        opts = self.payload.accelerate if self.payload else _LOCAL_ACCELERATE
        kwargs: dict[str, Any] = {
            "log_with": [self.tracker()],
            # "auto" in the spec is Accelerate's None: its own default.
            "dataloader_config": DataLoaderConfiguration(
                **{k: None if v == "auto" else v for k, v in opts.get("dataloader", {}).items()}),
        }
        if self.strategy is not None:  # the spec merged over its accelerate config file
            kwargs["mixed_precision"] = self.strategy.mixed_precision
            if self.strategy.distributed_type != "DEEPSPEED":  # DeepSpeed takes it from its own config
                kwargs["gradient_accumulation_steps"] = self.strategy.gradient_accumulation_steps
        kwargs.update(overrides)
        return kwargs

    def _clean(self, values: Any, what: str) -> dict:
        """``values`` within the caps, metric names apart from a row's own keys; each change said once."""
        notes: list[str] = []
        if not isinstance(values, dict):
            notes.append(f"a {type(values).__name__} instead of a dict, logged as {{'value': ...}}")
            values = {"value": values}
        out = capped(values, notes)
        if what == "metrics":
            for key in [k for k in out if k in RECORD_KEYS]:
                out[f"logged_{key}"] = out.pop(key)
                notes.append(f"'{key}' is a key of every metrics row: stored as 'logged_{key}'")
        for note in dict.fromkeys(notes):
            if note not in self._said:
                self._said.add(note)
                print(f"raylaunch: {what}: {note} {SAID_ONCE}", file=sys.stderr, flush=True)
        return out

    def log(self, values: dict, step: int | None = None) -> None:
        """Metrics of this rank; unlike ``accelerator.log`` this runs on every rank.

        A value still on a GPU (a tensor such as ``loss``, not ``loss.item()``) is read by a thread of the rank's
        own, which waits for the GPU in its stead: the training thread never synchronizes with the device to log. From
        the first such call on, every row of the rank goes through that thread, in order; the worker waits for the
        rows in it when the function returns (``flush_metrics``)."""
        at = time.time()
        row = _plain_row(values) if self._device_rows is None else None
        if row is None and self._device_rows is None and not _holds_device_values(values):
            row = self._clean(values, "metrics")  # (its values read now: the caps copy them)
        if row is not None:
            if self.payload is None:  # outside the runner, each row at once: a script may end with os._exit (CI's
                self.emit(Metrics(step=step, values=row), at=at)  # test_runner lost 135)
                return
            self._rows.append((step, row, at))
            if not self._rows_due.is_set():
                if self._row_writer is None:
                    self._start_row_writer()
                self._rows_due.set()
            return
        if self._device_rows is None:
            self._device_rows = _DeviceRows(
                lambda v, s, t: self.emit(Metrics(step=s, values=self._clean(v, "metrics")), at=t))
        self._device_rows.put(values, step, at)

    def flush_metrics(self) -> None:
        """Wait until every row logged so far is written (those with values a thread reads off the device too)."""
        if self._device_rows is not None:
            self._device_rows.flush()
        self.write_rows()

    def write_rows(self) -> None:
        """The metrics rows logged so far (but those a thread still reads off the device) written now."""
        with self._lock:
            self._write_rows()
            self._events.flush()

    def _start_row_writer(self) -> None:
        self._row_writer = threading.Thread(target=self._write_rows_in_batches, daemon=True,
                                            name="raylaunch-metrics")
        self._row_writer.start()

    def _write_rows_in_batches(self) -> None:
        while True:
            self._rows_due.wait()
            time.sleep(METRICS_BATCH_S)
            self._rows_due.clear()  # before the rows are taken: one logged from here on sets it again
            try:
                self.write_rows()
            except (OSError, ValueError) as exc:  # the file closed or the disk full: a metric never fails the rank
                print(f"raylaunch: metrics rows not written: {exc}", file=sys.stderr, flush=True)

    def _write_rows(self) -> None:
        """Under ``_lock``: the rows logged so far, in order, as ``emit`` writes an event's line."""
        rows = self._rows
        batch = []
        while rows:
            step, values, at = rows.popleft()
            batch.append((step, at, values))
        if batch:
            self._events.write(metrics_rows_line(batch, self.payload.context.world_rank if self.payload else 0))

    def start_snapshots(self, meter: Any) -> None:
        """Snapshots in memory every few optimizer steps (``cluster.checkpoint.memory``), taken from the prepared
        loaders' iteration (``cluster.rank.pace``); ``meter``: the rank's pace meter, which counts its optimizer steps.
        A function's are restored by ``restore``; a script's and a Trainer's are written in their own checkpoint
        format and handed to their own resume (``snapshot_script``, ``cluster.rank.trainer.snapshots_of``)."""
        p = self.payload
        if p is None or p.snapshot_dir is None or self._checkpoints is None:
            return
        from cluster.checkpoint.memory import MemorySnapshots
        from cluster.snapshots import node_budget_bytes
        from cluster.protocol import SnapshotEvery, SnapshotHeld, SnapshotWriting
        from cluster.rank import pace
        from cluster.rank.prepared import after_prepare

        checkpoints = self._checkpoints
        snaps = MemorySnapshots(
            p.snapshot_dir, p.context.world_rank, p.snapshot_every,
            node_budget_bytes(p.snapshot_memory_mb, p.snapshot_dir), save=checkpoints.hold_in_memory,
            say=lambda line: print(line, file=sys.stderr, flush=True),
            report=lambda step, nbytes, every, taken, peer=True: self.emit(SnapshotHeld(
                step=step, nbytes=nbytes, every=every, held_s=checkpoints.last_snapshot_hold_s, taken=taken,
                peer=peer)),
            start=p.snapshot_start, writing=lambda step: self.emit(SnapshotWriting(step=step)),
            peers=p.context.num_nodes > 1, every_changed=lambda every: self.emit(SnapshotEvery(every=every)))
        self.snapshots, self._meter = snaps, meter

        def prepared(accelerator: Any, models: list[Any]) -> None:
            from cluster.rank.trainer import made_by_trainer, snapshots_of, trainer_unsnapshotted

            why = None
            trainer = made_by_trainer(12)
            if trainer is not None and (why := trainer_unsnapshotted(trainer)) is not None:
                why += "; its committed checkpoints are restored"
            elif str(getattr(accelerator, "distributed_type", "")).endswith(("FSDP", "DEEPSPEED", "MEGATRON_LM")):
                # FSDP's save is a collective (DCP), which ranks deciding on their own could leave one rank in
                why = "FSDP's, DeepSpeed's and Megatron-LM's states are not snapshotted yet; commits are restored"
            elif str(getattr(accelerator, "mixed_precision", "no")) == "fp16":
                # fp16's loss scaler skips the optimizer's step on an overflow: the steps would not be the function's
                why = "with fp16 the loss scaler skips steps, which snapshots would not count; commits are restored"
            if why is not None:
                snaps.stop(why)
                self._agree_no_more()  # (every rank alike) a stop notice ends the rank, or the code agrees itself
                return
            if trainer is not None and (snaps.code is None or snaps.code.step is None):
                snaps.code, snaps.confirmed = snapshots_of(trainer), True  # named by Trainer's own global_step
                self._agree_no_more()  # Trainer agrees on stop notices itself (cluster.rank.trainer: it saves there)
            if models:
                snaps.accelerator = accelerator

        def take(steps: int) -> None:
            agreement = self._agreement
            if agreement is not None and steps >= agreement.next_check(steps - 1):
                try:
                    stop = agreement.agreed(self._stop_requested)
                except Exception as exc:  # noqa: BLE001 - its group could not form: a notice ends the rank, as before
                    print(f"raylaunch: rank {p.context.world_rank}: stop notices are not agreed on ({type(exc).__name__}:"
                          f" {exc}); a SIGTERM ends the rank", file=sys.stderr, flush=True)
                    self._agree_no_more()
                    stop = False
                if stop:
                    self._stop_at_snapshot(steps)
            try:
                if steps >= snaps.next_due(steps - 1):
                    snaps.take(steps, lambda: checkpoints.last_snapshot_hold_s)
                elif steps >= snaps.mark_at:  # half way to the next: ``auto`` reads the clock
                    snaps.mark(steps)
            except Exception as exc:  # noqa: BLE001 - never the function's failure: storage's checkpoints remain
                snaps.stop(f"{type(exc).__name__}: {exc}")
            due = min(snaps.next_due(steps), snaps.mark_at)
            if self._agreement is not None:
                due = min(due, self._agreement.next_check(steps))
            pace.SNAPSHOT_AT[0] = due

        after_prepare("snapshots", prepared)
        pace.SNAPSHOT[:] = [take]
        pace.SNAPSHOT_AT[0] = 1
        # A stop notice (SIGTERM: a spot node's, or the driver's for a node Ray drains) is agreed by every rank at a
        # step, whose snapshot every rank writes before it stops: the restart resumes there.
        self._agreement = StopCheck()

    def _agree_no_more(self) -> None:
        """No more agreement on stop notices here (every rank decides this at the same step): SIGTERM ends the rank
        again, and one that came meanwhile ends it now (unless the function agrees itself: ``preempted``)."""
        self._agreement = None
        if self._stop_requested and not self._cooperative and not self._stopped_for_preemption:
            import signal

            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    def _stop_at_snapshot(self, steps: int) -> None:
        """Every rank agreed to stop at this step: its snapshot, taken and written now, then the function ends
        (``StoppedAtSnapshot``) and the rank is reported preempted."""
        snaps, checkpoints = self.snapshots, self._checkpoints
        self._stopping = True  # (the grace timer leaves a rank that is writing its stop's snapshot alone)
        try:
            checkpoints.wait_for_upload()  # a write in flight first: this snapshot is not skipped for it
            snaps.take(steps, lambda: checkpoints.last_snapshot_hold_s, stopping=True)
            checkpoints.wait_for_upload()  # written, and reported, before the rank ends
        except Exception as exc:  # noqa: BLE001 - stopping all the same: the restart resumes from what is there
            print(f"raylaunch: rank {self.payload.context.world_rank}: the snapshot of the stop notice's step was "
                  f"not written: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        self._stopped_for_preemption = True
        raise StoppedAtSnapshot()

    def snapshot_script(self, inside: Any) -> None:
        """A script's snapshots: its Accelerator's ``save_state`` run within ``inside()`` (the script hooks' own scope,
        where save_state is Accelerate's), named as the script names its folders once it saved one
        (``script_saved``)."""
        if self.snapshots is None:
            return
        from cluster.checkpoint.memory import CodeSave

        def save(folder: str, default: Any) -> None:
            with inside():
                default()

        self.snapshots.code = CodeSave(save)

    def script_saved(self, step: int, folder: str) -> None:
        """A script's ``save_state`` into ``folder`` (its name) at ``step``: its snapshots are named like it from
        here, if the name ends in the optimizer steps taken (``step_48``); a script that names them otherwise
        (``epoch_3``, a count of saves) would resume a snapshot at another step, so it gets none."""
        snaps = self.snapshots
        if snaps is None or snaps.code is None or snaps.code.step is not None or snaps.off is not None:
            return
        taken = snaps.base + self._meter.steps
        m = re.search(r"\d+$", folder)
        if m is None or int(m.group()) != taken:
            snaps.stop(f"the script named its save_state folder {folder!r} after {taken} optimizer steps: snapshots are "
                       "handed to its resume under a name ending in their optimizer step (step_<n>, checkpoint-<n>), "
                       "which this script's names do not give (an epoch, a count of saves or batches). Name its "
                       "save_state folders by optimizer steps to have them")
            self._agree_no_more()
            return
        snaps.confirmed, snaps.code.name = True, folder

    def _steps_agree(self, step: int) -> None:
        """A save's ``step`` against the optimizer steps taken: a function that numbers its saves otherwise (batches,
        epochs) would be handed a snapshot's step it does not count in, so it gets no snapshots."""
        snaps = self.snapshots
        if snaps is None:
            return
        taken = snaps.base + self._meter.steps
        if step == taken:
            snaps.confirmed = True  # from here this attempt's snapshots may be resumed from
            return
        snaps.stop(f"the function saved step {step} after {taken} optimizer steps: snapshots count optimizer steps "
                   "(what session.restore returns for one), and its steps count something else. Number saves by "
                   "optimizer steps to have them")
        self._agree_no_more()  # every rank saves the same steps: they all stop agreeing here

    def preempted(self, accelerator: Any) -> bool:
        """True on every rank once any rank was told to stop (SIGTERM: a spot node's notice).

        A collective: call it on every rank at the same point, after an optimizer
        step. A function that calls it opts in to checkpointing within the grace
        period: save with ``session.save`` and return; the runner then restarts the
        run from that checkpoint without using up ``failure.max_restarts``. Ranks of a
        function that never calls it simply end on SIGTERM.
        """
        import torch

        self._cooperative = True
        flag = torch.tensor([1.0 if self._stop_requested else 0.0], device=accelerator.device)
        if accelerator.reduce(flag, "sum").item() > 0:
            self._stopped_for_preemption = True
        return self._stopped_for_preemption

    def checkpoint_due(self, accelerator: Any) -> bool:
        """True on every rank when the spec's ``checkpoint.every`` says a save is due: that many seconds of
        training since the last save, or with ``auto`` Young and Daly's interval, about sqrt(2 x the time a save
        holds training x the time between failures), revised after each save as the cost is measured (before the
        first, a save is assumed to cost ``ASSUMED_SAVE_S``). Always False when ``checkpoint.every`` is unset.

        A collective when it is set: call it on every rank at the same point, when ``accelerator.sync_gradients``
        is true, and save with ``session.save`` when it answers True.
        """
        every = self.payload.checkpoint_every if self.payload is not None else None
        if every is None:
            return False
        now = time.monotonic()
        if self._since_save is None:
            self._since_save = now
        interval = float(every) if every != "auto" else None
        elapsed = now - self._since_save
        import torch

        # Every rank agrees: due if any rank's clock says so, and the cost of a save is the slowest rank's.
        facts = torch.tensor([elapsed, self._save_s if self._save_s is not None else -1.0], dtype=torch.float64,
                             device=accelerator.device)
        if accelerator.num_processes > 1:
            import torch.distributed as dist

            dist.all_reduce(facts, op=dist.ReduceOp.MAX)
        elapsed, save_s = float(facts[0]), float(facts[1])
        if interval is None:
            from cluster.interval import ASSUMED_SAVE_S, checkpoint_interval

            cost = save_s if save_s >= 0 else ASSUMED_SAVE_S
            interval = checkpoint_interval(max(cost, 1e-3), self.payload.mtbf_s)
            said = self._interval_said
            if self.payload.context.world_rank == 0 and (said is None or abs(interval - said) > 0.1 * said):
                self._interval_said = interval
                self.emit(CheckpointInterval(seconds=round(interval, 3), save_s=round(cost, 4), measured=save_s >= 0,
                                             mtbf_s=self.payload.mtbf_s))
        return elapsed >= interval

    def stops_cooperatively(self, on: bool = True) -> None:
        """From now on a SIGTERM asks this rank to stop at a step every rank agrees on (``stop_requested``), instead
        of ending it: what ``preempted`` opts into, for code that checks on its own (Trainer's callback, from its
        first step to its last). ``on`` False: a SIGTERM ends the rank again, and one that came meanwhile and was
        never agreed on ends it now."""
        self._cooperative = on
        if not on and self._stop_requested and not self._stopped_for_preemption:
            import signal

            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    @property
    def stop_requested(self) -> bool:
        """This rank got SIGTERM while stopping cooperatively."""
        return self._stop_requested

    def stop_for_preemption(self) -> None:
        """Every rank agreed to stop: the worker reports the rank as preempted when the code returns."""
        self._stopped_for_preemption = True

    @property
    def stopped_for_preemption(self) -> bool:
        """Every rank agreed to stop (``preempted`` answered True): the worker reports it."""
        return self._stopped_for_preemption

    def handle_sigterm(self, signum: int, frame: Any) -> None:
        """The rank's SIGTERM handler: a function that calls ``preempted`` checkpoints and stops;
        one that never does ends as SIGTERM ends a process."""
        import signal

        if not self._cooperative and self._agreement is None:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if not self._stop_requested and not self._cooperative:  # agreed at the next check; if none comes, ended
            timer = threading.Timer(STOP_GRACE_S, self._end_unless_stopped)
            timer.daemon = True
            timer.start()
        self._stop_requested = True
        self.emit(PreemptNotice())

    def _end_unless_stopped(self) -> None:
        """A stop notice no step agreed on within ``STOP_GRACE_S`` (the loop asked for no batch since): the rank ends
        as SIGTERM ends a process."""
        if not self._stopped_for_preemption and not self._stopping:
            import signal

            print(f"raylaunch: rank {self.payload.context.world_rank}: no step agreed on the stop notice within "
                  f"{STOP_GRACE_S:g} s; ending as SIGTERM ends a process", file=sys.stderr, flush=True)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    def tracker(self) -> RunnerTracker:
        """Pass to ``Accelerator(log_with=[...])``; ``accelerator.log`` then reaches the driver."""
        return RunnerTracker(self)

    # --- checkpoints ---------------------------------------------------------

    def save(self, accelerator: Any, step: int) -> str:
        """Save ``accelerator``'s state as the checkpoint of ``step``; every rank must call it.

        Call it only when ``accelerator.sync_gradients`` is true. Under the
        runner the checkpoint is written to staging and committed by the
        driver once every rank has reported its part; outside it, it is
        written to the local checkpoints folder.

        With ``checkpoint.async`` (the default) training waits only while the
        state is copied into host memory; writing it (on an object store, then
        uploading it) runs in the background, and the rank reports its part
        when that is done. The next ``save`` waits for the previous one (one in
        flight at a time: at most one copy of the state in memory), and the
        runner waits for the last one before the function counts as finished.
        Storage that is full fails the save (or the next one, or the end) with
        ``CheckpointSaveError``; the previous committed checkpoint is kept.
        """
        began = time.monotonic()
        self._steps_agree(step)
        try:
            return self._save(accelerator, step)
        finally:  # for checkpoint_due: the save's hold, and training starts again now
            self._save_s = time.monotonic() - began
            self._since_save = time.monotonic()

    def _save(self, accelerator: Any, step: int) -> str:
        if self._checkpoints is None:
            target = self._local_dir / CHECKPOINTS / checkpoint_name(step)
            accelerator.save_state(str(target), safe_serialization=True)
            save_loader_states(accelerator, str(target))
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                (self._local_dir / CHECKPOINTS / LOCAL_LATEST).write_text(target.name)
            return str(target)
        beside = None
        if self.snapshots is not None:  # where a snapshot is due at this step, the save's capture is that snapshot too
            try:
                beside = self.snapshots.beside_save(step)
            except Exception as exc:  # noqa: BLE001 - never the save's failure: storage's checkpoints remain
                self.snapshots.stop(f"{type(exc).__name__}: {exc}")
        try:
            return self._checkpoints.save(accelerator, step, beside=beside)
        except BaseException:
            if beside is not None:  # not taken (a no-op where the save said so already): never left in flight
                beside[1](step, beside[0], None)
            raise

    def save_script_state(self, accelerator: Any, step: int, mirror: str | None, folder: str,
                          safe_serialization: bool, kwargs: dict) -> str:
        """A script's ``save_state(mirror)`` under the runner: the checkpoint of ``step``, committed as ``save``'s
        are, and (``mirror`` not None) the script's folder filled with the same files."""
        assert self._checkpoints is not None, "scripts run only under the runner"
        self.script_saved(step, folder)
        return self._checkpoints.save(accelerator, step, ScriptSave(folder, mirror, safe_serialization, kwargs))

    def resume_folder(self) -> tuple[str, dict] | None:
        """For a script under the runner: the latest committed checkpoint in a folder of this node, and its
        manifest; None when the attempt starts from the beginning."""
        found = self._checkpoints.resume_folder() if self._checkpoints is not None else None
        if found is not None:
            self.resumed_step = int(found[1]["step"])
        return found

    def checkpoint_folder(self) -> str | None:
        """The latest committed checkpoint of the run, verified, as a folder on this node; None when the run starts
        from the beginning (and outside the runner). For a function that builds a transformers ``Trainer``:
        ``trainer.train(resume_from_checkpoint=get_session().checkpoint_folder())`` resumes it exactly."""
        found = self.resume_folder()
        return found[0] if found is not None else None

    def trainer_saved(self, step: int, uri: str, files: dict[str, dict], requested: float, blocked_s: float,
                      folder: str) -> None:
        """This rank's part of Trainer's ``folder`` (``checkpoint-<step>``) is staged at ``uri``."""
        self.emit(CheckpointPart(step=step, uri=uri, requested=requested, blocked_s=blocked_s, files=files,
                                 script_folder=folder, trainer=True))

    def also_wait(self, wait: Any) -> None:
        """``wait()`` too before the rank is done (``wait_for_upload``): another writer of checkpoints."""
        self._waits.append(wait)

    def wait_for_upload(self) -> None:
        """Block until this rank's last checkpoint is uploaded; raise if the upload failed.

        The runner calls it when the training function returns, so a run never
        finishes before its last checkpoint is committed.
        """
        if self._checkpoints is not None:
            self._checkpoints.wait_for_upload()
        for wait in self._waits:
            wait()

    def restore(self, accelerator: Any) -> int | None:
        """Load the latest committed checkpoint into ``accelerator``; its step, or None.

        Accelerate unpickles the RNG, sampler and registered states
        (``weights_only=False``), so nothing is loaded unless it is this run's
        committed checkpoint and every file matches its manifest's sha256; a mismatch
        raises ``CheckpointError``. From an object store the downloaded copy is checked
        and loaded; on a shared path the check and the load are two reads of the files.
        """
        if self.payload is None:  # outside the runner: the local folder this function wrote itself
            latest = self._local_dir / CHECKPOINTS / LOCAL_LATEST
            if not latest.exists():
                return None
            name = latest.read_text().strip()
            init_optimizers_for_load(accelerator)
            accelerator.load_state(str(self._local_dir / CHECKPOINTS / name))
            load_loader_states(accelerator, str(self._local_dir / CHECKPOINTS / name))
            return checkpoint_step(name)
        began = time.monotonic()
        step = self._checkpoints.restore(accelerator)
        if step is not None:
            self.restored(step, time.monotonic() - began)
        return step

    def restored(self, step: int, seconds: float) -> None:
        """This rank loaded the checkpoint of ``step`` in ``seconds`` (for the goodput ledger's ``restore``): a
        function's, a script's or a Trainer's."""
        if self.snapshots is not None:  # a snapshot's step: the one restored plus the optimizer steps from here
            self.snapshots.base = step - self._meter.steps
        restart_sync.restored()  # the DDP models wrapped without DDP's first broadcast: compared now, on every rank
        self.emit(RestoredPart(step=step, seconds=round(seconds, 4)))

    # --- events --------------------------------------------------------------

    def _saved(self, step: int, uri: str, files: dict[str, dict] | None, requested: float | None = None,
               blocked_s: float = 0.0, script_folder: str | None = None) -> None:
        """This rank's part of a checkpoint is on storage: the driver commits on the last rank's report.
        ``requested``: when the save was asked for; ``blocked_s``: how long it held training; ``script_folder``:
        the folder a script's ``save_state`` named."""
        self.emit(CheckpointPart(step=step, uri=uri, requested=requested, blocked_s=blocked_s, files=files,
                                 script_folder=script_folder))

    def emit(self, event: RankEvent, at: float | None = None) -> None:
        """Report an event to the runner (``cluster.protocol.RankEvent``); outside it, to the local file. ``at``:
        when it happened (now when not given)."""
        if os.getpid() != self._pid:  # a process the rank forked (a DataLoader worker): not the rank's to report
            return
        line = self._line(event, time.time() if at is None else at)
        with self._lock:
            self._write_rows()  # the metrics rows logged before it first
            self._events.write(line)
            self._events.flush()

    def _line(self, event: RankEvent, at: float) -> str:
        """The event's line in the events file: its fields, when it happened (``at``) and this rank."""
        # Its time and rank set on its line's object, not on a copy of the event (dataclasses.replace: #58)
        row = event.to_dict()
        row["time"], row["rank"] = at, self.payload.context.world_rank if self.payload is not None else 0
        return json.dumps(row) + "\n"


_SESSION: Session | None = None


def install(payload: WorkerPayload) -> Session:
    """Called once by the worker entry point in each rank process."""
    global _SESSION
    _SESSION = Session(payload)
    return _SESSION


def get_session() -> Session:
    """This process's session: the runner's, or a local one outside the runner."""
    global _SESSION
    if _SESSION is None:
        local = Path(os.environ.get("RAYLAUNCH_LOCAL_DIR", "raylaunch-local")).resolve()
        _SESSION = Session(None, local_dir=local)
    return _SESSION
