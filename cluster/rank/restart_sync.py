"""A restarted attempt's DDP models skip DDP's first broadcast: every rank loads the same checkpoint right after.

DDP broadcasts rank 0's parameters and buffers as it wraps a model, so that every rank starts from the same values.
In an attempt that resumes (from a commit or a snapshot in memory), every rank then loads the same state over them,
and the broadcast was wasted: 0.2-0.9 s of a restart for the recovery bench's 192 MiB of parameters over gloo on this
project's 2-core machine (``bench/recovery.py``; over a cluster's network, the model's size at its bandwidth).

So while such an attempt prepares a model, DDP wraps it with ``init_sync=False`` (given through the Accelerator's DDP
arguments, ``ddp_handler``, for that one ``prepare``); raylaunch still checks that every rank's parameters have the
same shapes (the error DDP gives, at the same place), and nothing is broadcast. Once the code has restored (every
rank at once: after ``session.restore``, a script's ``load_state`` of its resume folder, Trainer's resume), or else at
the model's first forward, the ranks compare a fingerprint of their parameters and buffers (each tensor's sum, in
float64: one small all-reduce), and broadcast rank 0's as DDP would have only where any differ: a function or script
that did not restore, or one that loaded only part of the state over a model each rank had initialised its own way.
Training therefore starts from the same values on every rank, as under DDP's own rule, whatever the code does. (The
one thing asked of code that does not restore: its first call of the prepared model is on every rank, as a
training step's is; a main-process-only evaluation before it would wait for the other ranks there.)

Left as DDP makes it: a first attempt, an Accelerator given DDP arguments of a class of the code's own, and one that
compiles its models (``torch.compile`` around the DDP model would trace the first forward's check).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import weakref
from collections.abc import Iterator
from typing import Any

from cluster.rank.prepared import around_prepare

__all__ = ["install", "restored"]


def install(restoring: bool) -> None:
    """In a rank: where its attempt resumes (``restoring``), every ``prepare`` wraps its DDP models without DDP's
    first broadcast; the ranks' values are compared when the code has restored (``restored``), or else at each
    model's first forward."""
    if restoring:
        around_prepare("restart_sync", _without_first_broadcast)


@contextlib.contextmanager
def _without_first_broadcast(accelerator: Any) -> Iterator[list[Any]]:
    """Around one ``prepare``: the Accelerator's DDP arguments (``ddp_handler``: the code's
    ``DistributedDataParallelKwargs``, or none) with ``init_sync=False`` added, put back after; each DDP model it
    returned then gets DDP's shape check, and its comparison is pending (``_checked_later``)."""
    from accelerate.utils import DistributedDataParallelKwargs
    from torch.nn.parallel import DistributedDataParallel

    plugin = getattr(getattr(accelerator, "state", None), "dynamo_plugin", None)
    handler = getattr(accelerator, "ddp_handler", None)
    made: list[Any] = []
    if (str(getattr(plugin, "backend", "NO")).rsplit(".", 1)[-1].upper() != "NO"  # compiled
            or (handler is not None and type(handler) is not DistributedDataParallelKwargs)):  # a subclass of the code's
        yield made
        return
    fields = {f.name: getattr(handler, f.name) for f in dataclasses.fields(handler)} if handler is not None else {}
    accelerator.ddp_handler = _restart_arguments()(**{**fields, "init_sync": False})
    try:
        yield made
    finally:
        accelerator.ddp_handler = handler
    buffers = fields.get("broadcast_buffers", True) is not False  # what DDP's init_sync would have broadcast
    for model in made:
        if isinstance(model, DistributedDataParallel):
            _checked_later(model, buffers)


@functools.cache
def _restart_arguments() -> type:
    from accelerate.utils import DistributedDataParallelKwargs

    @dataclasses.dataclass
    class RestartArguments(DistributedDataParallelKwargs):
        """Accelerate's DDP arguments and DDP's ``init_sync`` (``to_kwargs`` passes it where it is not DDP's default)."""

        init_sync: bool = True

    return RestartArguments


def _checked_later(ddp: Any, buffers: bool) -> None:
    """What DDP's init_sync does first, now: the same shapes on every rank, or DDP's own error. The rest of it (rank
    0's values broadcast where the ranks' differ) when the code has restored (``restored``: every rank at once), or
    else at the model's first forward."""
    from torch.distributed.utils import _verify_param_shape_across_processes

    ignored = ddp.parameters_to_ignore
    _verify_param_shape_across_processes(
        ddp.process_group, [p for n, p in ddp.module.named_parameters() if n not in ignored and p.requires_grad])
    _PENDING[ddp] = (buffers, ddp.register_forward_pre_hook(_first_forward))


# DDP models wrapped without DDP's first broadcast and not compared yet -> (buffers too, their first forward's hook)
_PENDING: weakref.WeakKeyDictionary[Any, tuple[bool, Any]] = weakref.WeakKeyDictionary()


def restored() -> None:
    """The code has loaded the checkpoint (every rank calls this, after ``session.restore``, a script's
    ``load_state`` of its resume folder or Trainer's resume): the DDP models wrapped so far are compared now, where
    every rank is, rather than at their first forward, which code may call on some ranks only (an evaluation on the
    main process)."""
    for ddp in list(_PENDING):
        _sync_if_they_differ(ddp)


def _first_forward(ddp: Any, inputs: Any) -> None:
    _sync_if_they_differ(ddp)


def _sync_if_they_differ(ddp: Any) -> None:
    """Once a model (its hook removed): rank 0's parameters (and buffers) broadcast where any rank's differ from
    another's."""
    import torch
    from torch.distributed.utils import _sync_module_states

    pending = _PENDING.pop(ddp, None)
    if pending is None:  # (compared already; or a copy of the model, which shares its hook)
        return
    buffers, handle = pending
    handle.remove()
    if not _differ(ddp, buffers):
        return
    with torch.no_grad():
        _sync_module_states(module=ddp.module, process_group=ddp.process_group,
                            broadcast_bucket_size=ddp.broadcast_bucket_size, src=0,
                            params_and_buffers_to_ignore=ddp.parameters_to_ignore, broadcast_buffers=buffers)


def _differ(ddp: Any, buffers: bool) -> bool:
    """Whether any rank's parameters (and buffers) differ from another's: each tensor's sum in float64 (a NaN as
    infinity both ways: the largest of a NaN and a number depends on the backend), the largest and the smallest over
    the ranks (one all-reduce of both) compared."""
    import torch
    import torch.distributed as dist

    ignored = ddp.parameters_to_ignore
    named = list(ddp.module.named_parameters()) + (list(ddp.module.named_buffers()) if buffers else [])
    tensors = [t for n, t in named if n not in ignored and t.device.type != "meta"]
    if not tensors:
        return False
    with torch.no_grad():
        device = getattr(ddp, "device", None) or tensors[0].device  # (the collective's: a GPU's under NCCL)
        sums = torch.stack([(torch.view_as_real(t) if t.is_complex() else t).detach().sum(dtype=torch.float64)
                            .to(device) for t in tensors])
        inf = torch.full_like(sums, math.inf)
        both = torch.cat([torch.where(sums.isnan(), inf, sums), torch.where(sums.isnan(), inf, -sums)])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=ddp.process_group)
        high, low = both[:len(tensors)], -both[len(tensors):]
        return not bool(torch.equal(high, low))
