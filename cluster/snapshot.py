"""A checkpoint held in host memory: Accelerate's ``save_state`` run with its file writes captured.

``save_state`` decides what goes in a checkpoint (model, optimizers, schedulers, samplers, RNG states,
registered objects; which process writes which file) and writes each part with ``torch.save`` or
safetensors' ``save_file``. :func:`capture` runs it with those two replaced: each write to a path keeps
a copy of its object in host memory (tensors copied off the device, into pinned memory on GPUs) and
writes nothing. Training goes on as soon as the copy is made; :meth:`Snapshot.write` writes the files,
exactly as ``save_state`` would have, later, in another thread.

What does not go through those two (PyTorch distributed checkpointing's sharded FSDP files, which are
a collective) is written by ``save_state`` itself, during the capture. Imports nothing from Ray.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

__all__ = ["Snapshot", "capture"]

_CAPTURING = threading.local()
_REAL_SAVE: list = [None]  # torch.save itself, while it is replaced


@dataclass
class _Write:
    path: str
    obj: Any
    safetensors: bool
    kwargs: dict


@dataclass
class Snapshot:
    """The files one rank's ``save_state`` would have written, held in memory."""

    writes: list[_Write] = field(default_factory=list)
    nbytes: int = 0  # host memory its tensors hold

    def write(self) -> list[str]:
        """Write every file as ``save_state`` would have; returns their paths."""
        import torch
        from safetensors.torch import save_file

        for w in self.writes:
            Path(w.path).parent.mkdir(parents=True, exist_ok=True)
            if isinstance(w.obj, _Serialised):
                Path(w.path).write_bytes(w.obj.data)
            elif w.safetensors:
                save_file(w.obj, w.path, **w.kwargs)
            else:
                torch.save(w.obj, w.path, **w.kwargs)
        return [w.path for w in self.writes]

    def release(self) -> None:
        self.writes.clear()
        self.nbytes = 0


def _copy(obj: Any, snap: Snapshot, cuda: list) -> Any:
    """``obj`` with every tensor copied into host memory (pinned when it was on a GPU)."""
    import torch

    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if t.is_cuda:
            out = torch.empty_like(t, device="cpu", pin_memory=True)
            out.copy_(t, non_blocking=True)
            cuda.append(True)
        else:
            out = t.clone()
        snap.nbytes += out.numel() * out.element_size()
        return out
    if isinstance(obj, (dict, OrderedDict)):
        out = type(obj)() if type(obj) in (dict, OrderedDict) else {}
        for k, v in obj.items():
            out[k] = _copy(v, snap, cuda)
        return out
    if isinstance(obj, list):
        return [_copy(v, snap, cuda) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_copy(v, snap, cuda) for v in obj)
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return obj
    import numpy as np

    if isinstance(obj, np.ndarray):  # NumPy's RNG state
        return obj.copy()
    return _Serialised(obj)  # anything else (a sampler, an object's own state) as the bytes torch.save makes now


class _Serialised:
    """An object pickled now, as ``torch.save`` would: a deep copy could take far more (a sampler's dataset)."""

    def __init__(self, obj: Any) -> None:
        import io

        import torch

        buf = io.BytesIO()
        _REAL_SAVE[0](obj, buf)
        self.data = buf.getvalue()


def _holds_objects(value: Any) -> bool:
    if isinstance(value, _Serialised):
        return True
    if isinstance(value, dict):
        return any(_holds_objects(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_objects(v) for v in value)
    return False


@contextlib.contextmanager
def _captured(snap: Snapshot) -> Iterator[None]:
    import torch
    from accelerate.utils import other

    save, safe_save = torch.save, other.safe_save_file
    _REAL_SAVE[0] = save
    cuda: list = []

    def is_path(f: Any) -> bool:
        return isinstance(f, (str, os.PathLike))

    def torch_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if not is_path(f) or args or threading.current_thread() is not _CAPTURING.thread:
            return save(obj, f, *args, **kwargs)  # a stream (DCP's own writes), or another thread's save
        kept = _copy(obj, snap, cuda)
        if not isinstance(kept, _Serialised) and _holds_objects(kept):
            kept = _Serialised(obj)  # a container with objects inside: its bytes, once
        snap.writes.append(_Write(os.fspath(f), kept, False, kwargs))

    def safe_save_file(tensors: dict, filename: Any, metadata: dict | None = None) -> None:
        if threading.current_thread() is not _CAPTURING.thread:
            return safe_save(tensors, filename, metadata=metadata)
        snap.writes.append(_Write(os.fspath(filename), _copy(tensors, snap, cuda), True,
                                  {"metadata": metadata} if metadata is not None else {}))

    _CAPTURING.thread = threading.current_thread()
    torch.save, other.safe_save_file = torch_save, safe_save_file
    try:
        yield
        if cuda:
            torch.cuda.synchronize()  # the non-blocking copies are done before training changes the tensors
    finally:
        torch.save, other.safe_save_file = save, safe_save
        _CAPTURING.thread = None


def capture(save: Callable[[], Any]) -> Snapshot:
    """Run ``save`` (a ``save_state`` and what goes with it) with its file writes kept in memory."""
    snap = Snapshot()
    with _captured(snap):
        save()
    return snap
