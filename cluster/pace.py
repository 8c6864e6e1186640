"""Where a rank's step time goes: waiting for its next batch, waiting for the other ranks, its own work.

Measured inside each rank process with no change to the training function:

- ``data_wait``: the time spent in ``next()`` on a dataloader that ``accelerator.prepare``
  returned (the batch being read, collated and moved to the device), as a fraction of the
  time between batches. A rank whose input pipeline cannot keep up waits here.
- ``sync_wait``: in DDP, the time from this rank's last gradient bucket being ready to the
  bucket's all-reduce completing, as a fraction of the same time. Measured with torch's
  own all-reduce communication hook (``default_hooks.allreduce_hook``, the same arithmetic as
  DDP without a hook), timed on the last bucket of each backward. In synchronous training
  every rank steps at the pace of the slowest, so step rates are equal everywhere; what
  differs is this wait: the ranks that wait long wait *for* the one that does not.

The two fractions over each window of a few seconds are reported as a ``pace`` event,
which the driver stores beside the rank's metrics and judges (``jobs/pace.py``).

Costs per batch: two clock reads and a few additions; per backward: one Python call
per gradient bucket and one future callback on the last.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from typing import Any, Callable, Iterator

__all__ = ["PaceMeter", "install"]

# How often a rank reports its pace (seconds).
REPORT_EVERY_S = 3.0
# The fewest batches a report covers (a window with fewer goes on).
MIN_BATCHES = 5


class PaceMeter:
    """Sums of one window: batches fetched, time waiting for them, time waiting in DDP's all-reduce.

    >>> m = PaceMeter()
    >>> m.fetched(0.0, 0.1); m.fetched(1.0, 1.3); m.synced(0.2)
    >>> m.window()
    {'data_wait': 0.3077, 'sync_wait': 0.1538, 'batch_s': 0.65}
    >>> m.window() is None   # nothing since
    True
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: float | None = None  # when the previous batch was handed to the function
        self._reset()

    def _reset(self) -> None:
        self.span_s = 0.0  # time covered by batches: from one batch handed over to the next
        self.data_s = 0.0
        self.sync_s = 0.0
        self.batches = 0

    def fetched(self, started: float, ended: float) -> None:
        """One batch was asked for at ``started`` and handed over at ``ended`` (perf_counter)."""
        with self._lock:
            self.span_s += ended - (started if self._last is None else self._last)
            self.data_s += ended - started
            self.batches += 1
            self._last = ended

    def synced(self, seconds: float) -> None:
        """A backward's last gradient bucket waited ``seconds`` for its all-reduce."""
        with self._lock:
            self.sync_s += seconds

    def window(self, min_batches: int = 1) -> dict[str, float] | None:
        """The fractions since the last window (and the mean time between batches); None, and the
        window goes on, while fewer than ``min_batches`` came."""
        with self._lock:
            span, data, sync, n = self.span_s, self.data_s, self.sync_s, self.batches
            if n < max(min_batches, 1) or span <= 0:
                return None
            self._reset()
        return {"data_wait": round(min(data / span, 1.0), 4), "sync_wait": round(min(sync / span, 1.0), 4),
                "batch_s": round(span / n, 4)}


def install(emit: Callable[[dict], None]) -> "_Pace":
    """Measure this rank process's prepared dataloaders and DDP models; report through ``emit``.

    Patches Accelerate's dataloader classes and ``Accelerator.prepare_model`` in this
    process only (a rank is its own process), before the training function runs.
    """
    meter = PaceMeter()
    _time_dataloaders(meter)
    _time_allreduce(meter)
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
            self._emit({"kind": "pace", **window})

    def _loop(self) -> None:
        while True:
            time.sleep(REPORT_EVERY_S)
            # A few batches at least: the first one alone (workers starting, files opening) is all wait.
            self.report(MIN_BATCHES)


def _time_dataloaders(meter: PaceMeter) -> None:
    from accelerate import data_loader

    for cls in (data_loader.DataLoaderShard, data_loader.DataLoaderDispatcher, data_loader.SkipDataLoader):
        if getattr(cls.__iter__, "_raylaunch_timed", False):
            continue
        cls.__iter__ = _timed_iter(cls.__iter__, meter)


def _timed_iter(iterate: Callable[[Any], Iterator], meter: PaceMeter) -> Callable[[Any], Iterator]:
    @functools.wraps(iterate)
    def __iter__(self: Any) -> Iterator:
        batches = iterate(self)
        clock = time.perf_counter
        try:
            while True:
                started = clock()
                try:
                    batch = next(batches)
                except StopIteration:
                    return
                meter.fetched(started, clock())
                yield batch
        finally:
            batches.close()  # a loop left early ends Accelerate's iterator now, as without us

    __iter__._raylaunch_timed = True  # type: ignore[attr-defined]
    return __iter__


def _time_allreduce(meter: PaceMeter) -> None:
    from accelerate import Accelerator

    prepare_model = Accelerator.prepare_model
    if getattr(prepare_model, "_raylaunch_timed", False):
        return

    @functools.wraps(prepare_model)
    def timed_prepare_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        model = prepare_model(self, *args, **kwargs)
        _hook_on_first_forward(model, meter)
        return model

    timed_prepare_model._raylaunch_timed = True  # type: ignore[attr-defined]
    Accelerator.prepare_model = timed_prepare_model


def _hook_on_first_forward(model: Any, meter: PaceMeter) -> None:
    """Register the timed all-reduce at the model's first forward, unless a hook is there by then.

    DDP takes one communication hook; waiting until the first forward leaves the
    function free to register its own after ``prepare`` (then ``sync_wait`` is not measured).
    """
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return
    handle = None

    def register(module: Any, args: Any) -> None:
        handle.remove()
        if getattr(module, "_comm_hooks", None):
            return  # the function's own hook
        try:
            module.register_comm_hook(module.process_group, _timed_allreduce_hook(meter))
        except (RuntimeError, ValueError) as exc:  # a built-in hook registered another way; never the step's failure
            print(f"raylaunch: sync_wait is not measured: {exc}", file=sys.stderr, flush=True)

    handle = model.register_forward_pre_hook(register)


def _timed_allreduce_hook(meter: PaceMeter) -> Callable:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    clock = time.perf_counter

    def timed_allreduce(process_group, bucket):  # no annotations: DDP checks them against its own types
        future = allreduce_hook(process_group, bucket)
        if not bucket.is_last():
            return future
        started = clock()

        def done(f: Any) -> Any:
            meter.synced(clock() - started)
            return f.value()

        return future.then(done)

    return timed_allreduce
