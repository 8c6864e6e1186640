"""Where a rank's step time goes: waiting for its next batch, waiting for the other ranks, its own work.

Measured inside each rank process with no change to the training function:

- ``data_wait``: the time spent in ``next()`` on a dataloader that ``accelerator.prepare``
  returned (the batch being read, collated and moved to the device), as a fraction of the
  time between batches. A rank whose input pipeline cannot keep up waits here.
- ``sync_wait``: the time from this rank's last gradient being computed (a hook on every
  parameter) to the end of the backward pass (a callback of torch's autograd engine, run after
  DDP's and FSDP's own, which wait for the reduction), as a fraction of the same time: what the
  backward waits for once its own work is done, the gradients' reduction across ranks (DDP's
  all-reduce of its last bucket, FSDP's reduce-scatter). A backward of ``loss.backward()`` is
  measured as one of ``accelerator.backward`` is. In synchronous training every rank
  steps at the pace of the slowest, so step rates are equal everywhere; what differs is this
  wait: the ranks that wait long wait *for* the one that does not.

The two fractions over each window of a few seconds are reported as a ``pace`` event,
which the driver stores beside the rank's metrics and judges (``jobs/driver/pace.py``).

Costs per batch: two clock reads and a few additions; per backward: one hook that counts it in C (on a parameter
whose gradient is computed last) and, on the backwards that are timed, a mark at each of the last gradients and one
when the backward ends. Which parameters' gradients come last is learned over the first backwards (the hooks of the
others are then removed). Where backwards come more often than ``SYNC_SAMPLE_S`` apart, a share of them is timed
(about one each ``SYNC_SAMPLE_S``, drawn at random so that a period of the code's own, gradient accumulation's
micro-batches, is never aliased), each standing for the backwards since the last one timed: a timed backward costs
about 20 us of Python on a 0.3 ms step, cache-cold between its kernels, and one that is not costs what a no-op hook
does, about 1 us (``bench/step_costs.py``, #58). DDP's communication itself is untouched (no communication hook: torch's
Python ``allreduce_hook`` alone made a 2.1M-parameter MLP's step 5-20% slower on CPU).

On a GPU the CPU clock cannot see the wait: the backward ends once kernels are queued, and the reduction runs
later on the stream. There the two marks are CUDA events recorded on the current stream (``CudaTimer``): the time
between them is the stream's wait for the reduction, read a window later, when the events have completed, without
ever synchronizing the host. A ``Timer`` is the seam: ``tests/test_pace.py`` gives the meter one with GPU-like
delayed readings.
"""

from __future__ import annotations

import collections
import functools
import itertools
import math
import random
import sys
import threading
import time
import weakref
from typing import Any, Callable, Iterator

from cluster import patches
from cluster.checkpoint.resume import NEXT_BATCH, epoch_begins, next_batch
from cluster.rank.prepared import after_prepare

__all__ = ["CpuTimer", "CudaTimer", "PaceMeter", "Timer", "install"]

# How often a rank reports its pace (seconds).
REPORT_EVERY_S = 3.0
# The fewest batches a report covers (a window with fewer goes on).
MIN_BATCHES = 5
# The mean seconds between two timed backwards where they come faster (every backward is timed where they do not).
SYNC_SAMPLE_S = 0.02


class Timer:
    """Marks on a timeline and the seconds between two of them, once both are read: the CPU's clock, or a GPU's
    stream. ``elapsed`` returns None while a mark is not yet reached (a GPU still working), and never waits."""

    # Every mark is reached when it is made (the CPU's clock): the time between two is read at once, without a lock.
    immediate = False

    def mark(self) -> Any:
        raise NotImplementedError

    def elapsed(self, start: Any, end: Any) -> float | None:
        raise NotImplementedError


class CpuTimer(Timer):
    """``time.perf_counter``: every mark is reached when it is made."""

    immediate = True
    mark = staticmethod(time.perf_counter)

    def elapsed(self, start: float, end: float) -> float:
        return end - start


class CudaTimer(Timer):
    """CUDA events recorded on the current stream (of the device current when marked); events come from a pool and
    go back to it once read, so a step allocates none."""

    def __init__(self) -> None:
        import torch

        self._torch = torch
        self._free: list[Any] = []

    def mark(self) -> Any:
        event = self._free.pop() if self._free else self._torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def elapsed(self, start: Any, end: Any) -> float | None:
        if not end.query():  # the stream has not reached it: read it a window later
            return None
        seconds = start.elapsed_time(end) / 1000.0
        self._free += (start, end)
        return seconds


class _Fetched:
    """One window's batches and waits as the training thread counts them (``PaceMeter.fetched``, ``backward_ended``),
    without a lock: ``window`` swaps in a new one, so a batch or a wait counted into the old one after the window read
    it is left out of both (one, at most once a window), never counted twice."""

    __slots__ = ("span_s", "data_s", "batches", "sync_s")

    def __init__(self) -> None:
        self.span_s = 0.0  # time covered by batches: from one batch handed over to the next
        self.data_s = 0.0
        self.batches = 0
        self.sync_s = 0.0  # time waited for the other ranks (the timed backwards' waits, each times what it stands for)


class PaceMeter:
    """Sums of one window: batches fetched, time waiting for them, time waiting in DDP's all-reduce.

    >>> m = PaceMeter()
    >>> m.fetched(0.0, 0.1); m.fetched(1.0, 1.3); m.synced(0.2)
    >>> w = m.window()
    >>> {k: w[k] for k in ("data_wait", "sync_wait", "batch_s", "span_s", "batches")}
    {'data_wait': 0.3077, 'sync_wait': 0.1538, 'batch_s': 0.65, 'span_s': 1.3, 'batches': 2}
    >>> "first_batch" in w, "first_batch" in (m.fetched(2.0, 2.1) or m.window())   # said once: the first window
    (True, False)

    ``first_batch`` and ``last_batch`` are Unix times: when training began (the first batch was asked for)
    and when the window's last batch was handed over.
    >>> m.window() is None   # nothing since
    True
    """

    # Unread (last gradient, backward returned) mark pairs kept at most: past it the oldest are dropped unread.
    MAX_PENDING = 256

    def __init__(self, timer: Timer | None = None) -> None:
        self._lock = threading.Lock()
        self.timer: Timer = timer or CpuTimer()
        self._last: float | None = None  # when the previous batch was handed to the function
        self._grad_at: Any = None  # the timer's mark when this backward's latest gradient was computed
        self._pending: list[tuple[Any, Any]] = []  # marks whose time the timer could not read yet
        # When the first batch was asked for (perf_counter), until a window reports it: training began there.
        self._first: float | None = None
        self._first_said = False
        self.steps = 0  # optimizer steps taken in this process (``stepped``), for good
        self.timed = 0  # backwards whose wait was read, for good
        self._reset()

    def _reset(self) -> None:
        self._fetched = _Fetched()
        self.steps_seen = self.steps  # optimizer steps counted before this window

    def stepped(self, *_: Any) -> None:
        """An optimizer took a step (torch's global post hook, itself: one call a step): a step of training, whatever
        the batches were."""
        self.steps += 1

    def fetched(self, started: float, ended: float) -> None:
        """One batch was asked for at ``started`` and handed over at ``ended`` (perf_counter; made Unix times when a
        window reads them). No lock (``_Fetched``): taking the meter's lock for each batch cost a step a few
        microseconds, cache-cold between its kernels (``bench/step_costs.py``, #58)."""
        counted, last = self._fetched, self._last
        self._last = ended
        counted.data_s += ended - started
        counted.span_s += ended - (started if last is None else last)
        counted.batches += 1
        if self._first is None:
            self._first = started

    def gradient_ready(self, param: Any = None) -> None:
        """A parameter's gradient is computed (a hook on the parameters computed last): the latest mark wins."""
        self._grad_at = self.timer.mark()

    def backward_ended(self, at: Any = None, stands_for: int = 1) -> None:
        """The backward pass ended (``at``: the timer's mark then, made here when not given): since the last
        gradient, it waited for the gradients' reduction across ranks (DDP's all-reduce, FSDP's reduce-scatter).
        ``stands_for``: the backwards its wait is counted for (itself and those not timed since the last timed one)."""
        start = self._grad_at
        if start is None:
            return
        self._grad_at = None
        timer = self.timer
        end = timer.mark() if at is None else at
        # The CPU's clock: no lock, no list (a lock and a list cost a timed backward 6 us, #58)
        if getattr(timer, "immediate", False):
            self._fetched.sync_s += max(end - start, 0.0) * stands_for
            self.timed += 1
            return
        with self._lock:
            self._pending.append((start, end, stands_for))
            if len(self._pending) > self.MAX_PENDING:
                del self._pending[0]
        self._read()

    def _read(self) -> None:
        """Add the waits the timer can read now, in order; the first it cannot read, and those after it, wait."""
        waited = 0.0
        with self._lock:
            while self._pending:
                start, end, stands_for = self._pending[0]
                seconds = self.timer.elapsed(start, end)
                if seconds is None:
                    break
                self._pending.pop(0)
                waited += max(seconds, 0.0) * stands_for
                self.timed += 1
            if waited:  # (from the pace thread with nothing read: no write over one the training thread adds)
                self._fetched.sync_s += waited

    def synced(self, seconds: float) -> None:
        """A backward waited ``seconds`` for the other ranks."""
        self._fetched.sync_s += seconds

    @property
    def sync_s(self) -> float:
        """The seconds waited for the other ranks in this window so far."""
        return self._fetched.sync_s

    def window(self, min_batches: int = 1) -> dict[str, float] | None:
        """The fractions since the last window (and the mean time between batches); None, and the
        window goes on, while fewer than ``min_batches`` came."""
        self._read()
        with self._lock:
            counted = self._fetched
            span, data, sync, n = counted.span_s, counted.data_s, counted.sync_s, counted.batches
            if n < max(min_batches, 1) or span <= 0:
                return None
            stepped = self.steps - self.steps_seen
            self._reset()
            unix = time.time() - time.perf_counter()  # perf_counter to Unix time
            first = None if self._first_said or self._first is None else self._first + unix
            self._first_said = True
            last = 0.0 if self._last is None else self._last + unix
        window = {"data_wait": round(min(data / span, 1.0), 4), "sync_wait": round(min(sync / span, 1.0), 4),
                  "batch_s": round(span / n, 4), "span_s": round(span, 4), "batches": n, "optimizer_steps": stepped,
                  "last_batch": round(last, 4)}
        return window if first is None else {**window, "first_batch": round(first, 4)}


def install(emit: Callable[[dict], None]) -> "_Pace":
    """Measure this rank process's prepared dataloaders and backward passes; report through ``emit``.

    Patches Accelerate's dataloader classes, and hooks each prepared model's gradients (``cluster.rank.prepared``),
    in this process only (a rank is its own process, forked after the fork server imported Accelerate), before the
    training function runs (``cluster.patches`` says why each).
    """
    from torch.optim.optimizer import register_optimizer_step_post_hook

    meter = PaceMeter()
    _time_dataloaders(meter)
    _time_backward(meter)
    # A window's optimizer steps: where training stands for a rank that logs no step (evaluation batches and
    # accumulation's micro-batches are batches, not steps). A counter, on torch's own hook, once a step.
    register_optimizer_step_post_hook(meter.stepped)
    pace = _Pace(meter, emit)
    threading.Thread(target=pace._loop, daemon=True, name="raylaunch-pace").start()
    return pace


class _Pace:
    def __init__(self, meter: PaceMeter, emit: Callable[[dict], None]) -> None:
        self.meter, self._emit = meter, emit

    def report(self, min_batches: int = 1) -> None:
        """Emit the current window, once ``min_batches`` came in it."""
        window = self.meter.window(min_batches)
        if window is not None:
            self._emit(window)

    def _loop(self) -> None:
        while True:
            time.sleep(REPORT_EVERY_S)
            # A few batches at least: the first one alone (workers starting, files opening) is all wait.
            self.report(MIN_BATCHES)


def _time_dataloaders(meter: PaceMeter) -> None:
    from accelerate import data_loader

    patches.replace_all([(cls, "__iter__", lambda iterate: _timed_iter(iterate, meter),
                          f"accelerate.data_loader.{cls.__name__}.__iter__")
                         for cls in (data_loader.DataLoaderShard, data_loader.DataLoaderDispatcher,
                                     data_loader.SkipDataLoader)])


# Snapshots in memory (``cluster.checkpoint.memory``): the optimizer steps of this process at which the next is due
# (never, until the session starts them), and what takes it (called with the optimizer steps taken).
SNAPSHOT_AT: list[float] = [math.inf]
SNAPSHOT: list[Callable[[int], None]] = []


def _timed_iter(iterate: Callable[[Any], Iterator], meter: PaceMeter) -> Callable[[Any], Iterator]:
    @functools.wraps(iterate)
    def __iter__(self: Any) -> Iterator:
        epoch_begins(self)  # the order it draws now: kept for a save, or a resumed epoch's drawn again
        batches = iterate(self)
        clock = time.perf_counter
        handed = 0  # this epoch's batches handed over (read by a save: where a resume finds the epoch)
        # A snapshot is taken where a save at a step's end would be: the next batch asked of a loader that handed one
        # over before an optimizer step (not at an evaluation loader's first batch, which may come before the rest of
        # the step's code). Two reads a batch, no call, when none is due.
        seen = meter.steps
        try:
            while True:
                if meter.steps != seen:
                    seen = meter.steps
                    if seen >= SNAPSHOT_AT[0]:
                        SNAPSHOT[0](seen)
                started = clock()
                try:
                    batch = next(batches)
                except StopIteration:
                    return
                meter.fetched(started, clock())
                handed += 1
                self._raylaunch_handed = handed  # (cluster.checkpoint.resume.HANDED)
                if NEXT_BATCH:  # a resume's random states to put back
                    next_batch(self)
                yield batch
        finally:
            batches.close()  # a loop left early ends Accelerate's iterator now, as without us

    return __iter__


class _LastGradients:
    """The gradient hooks of one prepared model. Over its first ``LEARN`` backwards every parameter's hook marks the
    time and notes which parameter came last, and every one of them is timed. Then one parameter that came last keeps
    a hook that only counts backwards, in C (``functools.partial(next, ...)`` over ``itertools.repeat``: no Python
    frame, one call of the engine's, as a no-op hook costs); every ``k``-th count (``k`` about ``SYNC_SAMPLE_S`` of
    backwards at the recent pace, drawn at random) runs ``_begin`` instead, in Python: that backward is timed, and the
    other parameters that came last get a hook until it ends, so the latest gradient's mark wins. The timed backward
    stands for the ``k`` counted since the last one (a model's backwards run one at a time, as training runs them:
    two at once in two threads could meet the counter's round running, which ends the timing of that model). Its end
    is told by torch's autograd engine, which is asked to call ``_ended`` then: queued from a callback of the
    engine's, so it runs after every callback queued during the backward (DDP's and FSDP1's, which wait for the
    gradients' reduction). A Python hook on every backward, which returned at
    once on the backwards not timed, cost 6-10 us a step more than a no-op hook (``bench/step_costs.py``, #58).

    A backward is told from the next by the engine's graph task (a backward that raised never calls back, and the
    next is another task). One whose counting parameter gets no gradient (a branch not used) is not counted: the waits
    of the timed ones then stand for fewer backwards than there were, and ``sync_wait`` reads low by that share.

    The first hook of a backward comes from the parameters nearest the loss (a model's head), in the backward's own
    graph task. Were they inside a reentrant activation checkpoint (``use_reentrant=True``), their backward would be
    a nested task of its own, which ends first: ``sync_wait`` would read about 0 for that model."""

    LEARN = 3

    def __init__(self, meter: PaceMeter, model: Any, params: list[Any]) -> None:
        from torch._C import _current_graph_task_id

        self.meter = meter
        self._task_id = _current_graph_task_id  # (cluster.patches: a private read)
        self._params = [weakref.ref(p) for p in params]  # in the model's order
        self._handles = {id(p): p.register_post_accumulate_grad_hook(self._hook) for p in params}
        self._last: int | None = None  # the latest parameter hooked in this backward (while learning)
        self._lasts: collections.Counter = collections.Counter()  # parameter -> the learning backwards it came last
        self._others: list[Any] = []  # once learned: the other parameters that came last, hooked for a timed backward
        self._learned = 0
        self._task = -1  # the graph task of the last backward timed
        self._armed: list[Any] = []  # the hooks of the timed backward's other last parameters, until it ends
        self._timed_at: float | None = None  # (perf_counter) when the last timed one began
        self._span, self._count = 0.0, 0.0  # seconds and backwards of the recent pace
        self._stands_for = 1  # the backwards the timed one's wait is counted for (itself, those untimed before it)
        self._k = 1  # backwards from the timed one to the next (1 while learning: every one is timed)

    def _hook(self, param: Any) -> None:
        task = self._task_id()
        if self._learned < self.LEARN:
            self._last = id(param)
            if task != self._task:  # a backward's first hook
                self._begin(task)
                self._k = 1
                return
        elif task != self._task:
            return  # armed for a timed backward that raised (it never ended): disarmed at the next one
        self.meter.gradient_ready()

    def _begin(self, task: int) -> None:
        """The backward of graph task ``task`` is timed: its end is asked for, the next one drawn, this gradient
        marked."""
        self._task = task
        # The next timed one: about SYNC_SAMPLE_S of backwards on, at the pace of the last hundred or so, a count
        # drawn at random (uniform, its mean that), independent of what the backwards wait. A time drawn instead
        # timed the backward after a long wait more often (under accumulation's micro-batches, the one after the
        # reduction, which waits for nothing: sync_wait read 0.68 of what was waited), as did a pace read over the
        # last gap alone.
        now = time.perf_counter()
        if self._timed_at is not None:
            self._span += now - self._timed_at
            self._count += self._k
            if self._count > 128:  # the older half forgotten: a pace that changes is followed
                self._span, self._count = self._span / 2, self._count / 2
        self._timed_at = now
        every = max(1, round(SYNC_SAMPLE_S * self._count / self._span)) if self._span > 0 else 1
        self._stands_for, self._k = self._k, 1 + random.randrange(2 * every - 1)
        engine = _ENGINE[0] if _ENGINE else _engine()
        engine.queue_callback(lambda: engine.queue_callback(self._ended))
        self.meter.gradient_ready()

    def _rounds(self) -> Iterator[Iterator[None]]:
        """The counting hook's rounds (``itertools.chain.from_iterable`` reads the next when one is used up): each
        begins with a timed backward, whose hook call runs this, and counts the ``k - 1`` after it in C. Never raises
        into the backward: what fails stops the timing, said once."""
        while True:
            try:
                for handle in self._armed:  # left armed by a timed backward that raised
                    handle.remove()
                self._begin(self._task_id())
                if self._others:
                    self._armed = [p.register_post_accumulate_grad_hook(self._hook)
                                   for p in (ref() for ref in self._others) if p is not None]
            except Exception as exc:  # noqa: BLE001 (never the function's failure: unmeasured instead)
                print(f"raylaunch: sync_wait is no longer measured for a model: {exc!r}", file=sys.stderr, flush=True)
                yield itertools.repeat(None)
                return
            yield itertools.repeat(None, self._k)

    def _ended(self) -> None:
        self.meter.backward_ended(None, self._stands_for)
        if self._learned < self.LEARN:
            self.backward_done()
        elif self._armed:
            for handle in self._armed:
                handle.remove()
            self._armed = []

    def backward_done(self) -> None:
        if self._learned >= self.LEARN or self._last is None:
            return
        self._lasts[self._last] += 1
        self._last = None
        self._learned += 1
        if self._learned < self.LEARN:
            return
        for handle in self._handles.values():
            handle.remove()
        # One parameter of those that came last counts the backwards: the one that came last most often (the first in
        # the model's order of those); the others are hooked for the timed ones only (``_rounds``).
        lasts = [p for p in (ref() for ref in self._params) if p is not None and id(p) in self._lasts]
        counter = max(lasts, key=lambda p: self._lasts[id(p)])
        self._others = [weakref.ref(p) for p in lasts if p is not counter]
        rounds = itertools.chain.from_iterable(self._rounds())
        # A post-accumulate hook returns None: each count is the None of a round's repeat.
        self._handles = {id(counter): counter.register_post_accumulate_grad_hook(functools.partial(next, rounds))}


def _engine() -> Any:
    """torch's autograd engine, whose ``queue_callback`` runs a call when the current backward ends (as DDP and FSDP
    themselves use it; ``cluster.patches`` lists it)."""
    from torch.autograd import Variable

    _ENGINE[:] = [Variable._execution_engine]
    return _ENGINE[0]


_ENGINE: list[Any] = []  # torch's engine, once looked up (a step's backward asks for it)


def _time_backward(meter: PaceMeter) -> None:
    """The gradient hooks on each model ``prepare`` wraps as DDP, FSDP1 or alone (``prepare_model``'s: not FSDP2,
    DeepSpeed or Megatron-LM, whose engines hook their own), which time each backward to its end. A model given to
    ``accelerator.prepare_model`` directly, not through ``prepare``, has no hooks: its ``sync_wait`` reads 0."""
    from accelerate.utils import DistributedType

    # The parameters hooked (by id, with a weak reference: a tensor's == is elementwise, so no WeakSet): a model
    # prepared again (after free_memory, or in a second prepare) is not hooked twice.
    hooked: dict[int, weakref.ref] = {}

    def is_hooked(p: Any) -> bool:
        ref = hooked.get(id(p))
        return ref is not None and ref() is p

    def hook(accelerator: Any, prepared: list[Any]) -> None:
        if accelerator.num_processes <= 1 or getattr(accelerator, "is_fsdp2", False) or \
                accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
            return  # alone, a rank waits for nobody
        for model in prepared:
            try:
                params = [p for p in model.parameters() if p.requires_grad and not is_hooked(p)]
                if params and params[0].device.type == "cuda" and isinstance(meter.timer, CpuTimer):
                    meter.timer = CudaTimer()  # the stream's time, read without synchronizing the host
                if params:
                    hooked.update((id(p), weakref.ref(p)) for p in params)
                    _LastGradients(meter, model, params)  # kept by its hooks, on the model and its parameters
            except (AttributeError, RuntimeError) as exc:  # never the function's failure: unmeasured instead
                print(f"raylaunch: sync_wait is not measured for this model: {exc}", file=sys.stderr, flush=True)

    after_prepare("pace", hook)
