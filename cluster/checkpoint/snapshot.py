"""A checkpoint held in host memory: Accelerate's ``save_state`` run with its file writes captured.

``save_state`` decides what goes in a checkpoint (model, optimizers, schedulers, samplers, RNG states,
registered objects; which process writes which file) and writes each part with ``torch.save`` or
safetensors' ``save_file``. :func:`capture` runs it with those two replaced: each write to a path keeps
a copy of its object in host memory (tensors copied off the device, into pinned memory on GPUs) and
writes nothing. Training goes on as soon as the copy is made; :meth:`Snapshot.write` writes the files,
exactly as ``save_state`` would have, later, in another thread.

The copy itself can wait too. A CPU tensor that only an optimizer's step changes (a parameter of a prepared model,
an optimizer's state: ``defer``) is copied by the thread that writes (:meth:`Snapshot.copy_deferred`), beside the
next step's forward and backward, which only read it; the rank's next optimizer step waits for that copy
(``cluster.checkpoint.staged``). A tensor changed in place before its copy was made (a parameter clamped between the
save and the next step) is found by its version counter, and that snapshot is not written. Everything else
(buffers, which a forward changes; GPU tensors, whose copy is already asynchronous) is copied during the
capture.

FSDP's sharded state goes through PyTorch distributed checkpointing (DCP), whose ``save`` is a
collective: the ranks agree on a plan, each writes its shard, and rank 0 gathers what they wrote into
``.metadata``. :func:`capture` runs that ``save`` on the training thread, in step with the other
ranks, with a ``FileSystemWriter`` of ours in place of Accelerate's, writing into memory instead of files
(:class:`_MemoryFiles`): the
collectives stay where they were, the bytes of each file are what DCP would have written, and only
writing them to disk moves to the other thread. A DCP writer of another kind (a subclass, or not the
local file system) writes itself, during the capture. Imports nothing from Ray.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from cluster import patches
from cluster.checkpoint.writer import describe_written

__all__ = ["SegmentPool", "Snapshot", "capture", "close_fds"]

_CAPTURING = threading.local()
_REAL_SAVE: list = [None]  # torch.save itself, while it is replaced


@dataclass
class _Write:
    path: str
    obj: Any
    safetensors: bool
    kwargs: dict


class SegmentPool:
    """The memfd segments of a rank's last snapshot, kept for its next one: a save that copies into segments it
    used before touches pages that are already there, where new segments fault in and zero every page first
    (measured here: 576 MiB in 18 tensors copied in 0.09 s into kept segments, 0.26 s into new ones). It holds at
    most one snapshot's segments (those the next capture does not take are closed when its snapshot is released),
    so from its first save on a rank keeps one copy of its state's size in host memory. Thread-safe: the training
    thread takes, the background write gives back."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[int, list[tuple[int, Any]]] = {}  # nbytes -> [(fd, its mapped storage)]
        self.taken = 0  # segments a capture found here (prepared or kept)
        self.made = 0  # segments a capture had to make itself

    def take(self, nbytes: int) -> tuple[int, Any] | None:
        with self._lock:
            kept = self._free.get(nbytes)
            if kept:
                self.taken += 1
                return kept.pop()
            self.made += 1
            return None

    def prepare(self, sizes: list[int]) -> None:
        """Make segments of ``sizes`` (bytes) and fault in every page now, for the first snapshot to copy into (a
        thread of its own calls this once the state's size is known: the first save then costs what every later one
        does). The first snapshot's release keeps its own segments and closes these, as any kept before."""
        import torch

        for nbytes in sizes:
            fd, storage = _new_segment(nbytes)
            torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,), (1,)).zero_()
            with self._lock:
                self._free.setdefault(nbytes, []).append((fd, storage))

    def keep(self, segments: list[tuple[int, int, Any]]) -> None:
        """``segments`` ((fd, nbytes, storage)) are free for the next snapshot; any kept before are closed."""
        with self._lock:
            old, self._free = self._free, {}
            for fd, nbytes, storage in segments:
                self._free.setdefault(nbytes, []).append((fd, storage))
        close_fds(fd for kept in old.values() for fd, _ in kept)


def close_fds(fds: Any) -> None:
    """Close each of ``fds`` (descriptors), those closed already or never open passed over."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


@dataclass
class Snapshot:
    """The files one rank's ``save_state`` would have written, held in memory.

    ``shared``: its CPU tensors are copied into memfd segments (``segments``: id(tensor) -> (fd, nbytes, the
    storage mapping it)), which a
    writer process of the rank's (``cluster.checkpoint.writer``) maps and writes from without a copy."""

    writes: list[_Write] = field(default_factory=list)
    nbytes: int = 0  # host memory its tensors hold
    objects: int = 0  # objects kept as their bytes (``_Serialised``) so far
    shared: bool = False
    segments: dict[int, tuple[int, int, Any]] = field(default_factory=dict)
    pool: SegmentPool | None = None  # where its segments come from and go back to
    on_gpu: bool = False  # a tensor was copied off a GPU (into pinned memory: written by the rank's thread)
    defer: frozenset[int] = frozenset()  # storages (data_ptr) whose tensors are copied after the capture
    deferred: list[tuple[Any, Any, int, str]] = field(default_factory=list)  # (copy, tensor, its version, file)
    copied: threading.Event = field(default_factory=threading.Event)  # every deferred copy made (or given up)
    copied_at: float | None = None  # time.perf_counter() when they were

    def copy_deferred(self) -> list[str]:
        """Make the copies the capture left for later; returns the files of the tensors changed in place since the
        capture (whose copy may hold part of the change: the snapshot is then not to be written)."""
        import time

        changed: list[str] = []
        try:
            for out, t, version, path in self.deferred:
                out.copy_(t)
                if t._version != version:  # in-place ops bump it; an optimizer's step waits for this copy
                    changed.append(path)
        finally:
            self.deferred.clear()  # the tensors themselves are not held past their copy
            self.copied_at = time.perf_counter()
            self.copied.set()
        return sorted(set(changed))

    def write(self, writer: Any = None, hash_files: bool | str = False,
              durable: bool = False, zip_crc: bool | None = None) -> tuple[list[str], dict[str, dict]]:
        """Write every file as ``save_state`` would have; returns their paths, and ``{path: {size, <checksum>}}`` when
        ``hash_files`` (True: sha256, or a kind of ``cluster.checksums.CHECKSUMS``; ``durable``: each file
        flushed to its disk before it is hashed, ``describe_written``; ``zip_crc``: the writer process's
        ``torch.save`` files with the zip's CRC-32 of each record or not, None: as their checksum's kind says).
        ``writer`` (a started ``cluster.checkpoint.writer.CheckpointWriter``) writes the files that hold tensors,
        from the shared segments; this thread writes the files already in bytes (no interpreter lock held while they
        go to disk) and any file of a snapshot off a GPU."""
        import torch
        from safetensors.torch import save_file

        by_writer = [w for w in self.writes if not isinstance(w.obj, _Serialised)] if writer is not None else []
        files: dict[str, dict] = {}
        if by_writer:
            files.update(writer.write([(w.path, w.obj, w.safetensors, w.kwargs) for w in by_writer], self.segments,
                                      hash_files=hash_files, durable=durable, zip_crc=zip_crc))
        theirs = {id(w) for w in by_writer}
        for w in self.writes:
            if id(w) in theirs:
                continue
            Path(w.path).parent.mkdir(parents=True, exist_ok=True)
            if isinstance(w.obj, _Serialised):
                Path(w.path).write_bytes(w.obj.data)
            elif w.safetensors:
                save_file(w.obj, w.path, **w.kwargs)
            else:
                torch.save(w.obj, w.path, **w.kwargs)
            if hash_files:  # (True: sha256; or the kind's name, as the writer takes it)
                files[w.path] = describe_written(w.path, durable, "sha256" if hash_files is True else hash_files)
        return [w.path for w in self.writes], files

    def retargeted(self, source: str, target: str) -> "Snapshot":
        """The same files under ``target`` instead of ``source``, from the same copies (a view: never released)."""
        import copy
        import dataclasses

        view = copy.copy(self)
        view.writes = [dataclasses.replace(w, path=os.path.join(target, os.path.relpath(w.path, source)))
                       for w in self.writes]
        view.pool = None
        return view

    def release(self) -> None:
        if not self.copied.is_set():  # (a capture that failed, a write given up): nothing waits for these copies
            self.deferred.clear()
            self.copied.set()
        self.writes.clear()
        self.nbytes = 0
        segments, self.segments = self.segments, {}
        if self.pool is not None and segments:  # (released twice: the second time has nothing to give back)
            self.pool.keep(list(segments.values()))
        else:
            close_fds(fd for fd, _, _ in segments.values())


def _new_segment(nbytes: int) -> tuple[int, Any]:
    """A memfd segment of ``nbytes`` and the storage mapping it (its pages not yet touched)."""
    import torch

    fd = os.memfd_create("raylaunch-checkpoint", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        return fd, torch.UntypedStorage.from_file(f"/proc/self/fd/{fd}", shared=True, nbytes=nbytes)
    except BaseException:
        os.close(fd)
        raise


def _shared_empty(t: Any, snap: Snapshot) -> Any:
    """An uninitialised CPU tensor like ``t`` whose storage is a memfd segment of its own (kept in ``snap``): one of
    the pool's of the same size when it has one."""
    import torch

    # the strides a copy of ``t`` gets: its own where it is contiguous (every parameter and optimizer state but a
    # channels-last one's), else those ``empty_like`` gives (a meta tensor of its shape, which costs more)
    layout = t if t.is_contiguous() else torch.empty_like(t, device="meta")
    nbytes = t.numel() * t.element_size()
    kept = snap.pool.take(nbytes) if snap.pool is not None else None
    fd, storage = kept if kept is not None else _new_segment(nbytes)
    out = torch.empty(0, dtype=t.dtype).set_(storage, 0, layout.size(), layout.stride())
    snap.segments[id(out)] = (fd, nbytes, storage)
    return out


# Values a snapshot keeps as they are (immutable, and pickled as themselves).
_ATOMS = (type(None), bool, int, float, str, bytes)
_ATOM_TYPES = frozenset(_ATOMS)


def _atoms_only(values: Any) -> bool:
    """Every item of a list or tuple is an atom: one pass in C (Python's RNG state is 625 ints)."""
    return _ATOM_TYPES.issuperset(map(type, values))


def _copy(obj: Any, snap: Snapshot, cuda: list, path: str) -> Any:
    """``obj`` with every tensor copied into host memory (pinned when it was on a GPU), or to be copied there by
    :meth:`Snapshot.copy_deferred` (``snap.defer``); ``path``: the file it is for."""
    import torch

    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if t.is_cuda:
            out = torch.empty_like(t, device="cpu", pin_memory=True)
            out.copy_(t, non_blocking=True)
            cuda.append(True)
        elif t.numel() == 0:
            out = t.clone()
        else:
            out = _shared_empty(t, snap) if snap.shared else torch.empty_like(t)
            if snap.defer and t.untyped_storage().data_ptr() in snap.defer:
                snap.deferred.append((out, t, t._version, path))
            else:
                out.copy_(t)
        snap.nbytes += out.numel() * out.element_size()
        return out
    if isinstance(obj, (dict, OrderedDict)):
        out = type(obj)() if type(obj) in (dict, OrderedDict) else {}
        for k, v in obj.items():
            out[k] = _copy(v, snap, cuda, path)
        return out
    if isinstance(obj, list):
        if _atoms_only(obj):  # (Python's RNG state is 625 ints: one pass, not 625 calls)
            return list(obj)
        return [_copy(v, snap, cuda, path) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        if _atoms_only(obj):  # immutable all through: kept as it is
            return obj
        return tuple(_copy(v, snap, cuda, path) for v in obj)
    if obj is None or isinstance(obj, _ATOMS):
        return obj
    import numpy as np

    if isinstance(obj, np.ndarray):  # NumPy's RNG state
        return obj.copy()
    snap.objects += 1
    return _Serialised(obj)  # anything else (a sampler, an object's own state) as the bytes torch.save makes now


class _Serialised:
    """An object pickled now, as ``torch.save`` would: a deep copy could take far more (a sampler's dataset)."""

    def __init__(self, obj: Any) -> None:
        import io

        buf = io.BytesIO()
        _REAL_SAVE[0](obj, buf)
        self.data = buf.getvalue()


class _Bytes(_Serialised):
    """A file's bytes as DCP wrote them into memory."""

    def __init__(self, data: bytes) -> None:
        self.data = data


class _MemoryFiles:
    """DCP's ``FileSystemBase`` for one ``save`` on the training thread: every file it creates is kept, whole, as
    bytes in the snapshot (``.metadata`` written as ``.metadata.tmp`` then renamed, as on disk). DCP's own write
    threads (``thread_count`` > 1) may create files at once."""

    def __init__(self, snap: Snapshot) -> None:
        self._snap, self._lock = snap, threading.Lock()

    def _find(self, path: Any) -> _Write | None:
        return next((w for w in self._snap.writes if w.path == os.fspath(path)), None)

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        import io

        if "w" not in mode:
            raise OSError(f"{path}: not readable while its checkpoint is held in memory")

        class Stream(io.BytesIO):
            def close(self) -> None:  # DCP closes its stream before the block ends: the bytes are taken after it
                pass

        stream = Stream()
        yield stream
        data = stream.getvalue()
        io.BytesIO.close(stream)
        with self._lock:
            self._snap.writes.append(_Write(os.fspath(path), _Bytes(data), False, {}))
            self._snap.nbytes += len(data)

    def concat_path(self, path: Any, suffix: str) -> Path:
        return Path(path) / suffix

    def init_path(self, path: Any) -> Path:
        return Path(path)

    def rename(self, path: Any, new_path: Any) -> None:
        with self._lock:
            self._find(path).path = os.fspath(new_path)

    def mkdir(self, path: Any) -> None:
        pass  # made when the files are written

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True

    def exists(self, path: Any) -> bool:
        return self._find(path) is not None

    def rm_file(self, path: Any) -> None:
        with self._lock:
            self._snap.writes.remove(self._find(path))

    def ls(self, path: Any) -> list[str]:
        return [w.path for w in self._snap.writes if Path(w.path).parent == Path(path)]


def _memory_writer(like: Any, snap: Snapshot) -> Any:
    """A DCP ``FileSystemWriter`` built as ``like`` (a plain one, as Accelerate makes) was, from its path and public
    options, writing into ``snap``: torch's own way to give a writer another file system (its ``FsspecWriter`` sets
    ``fs`` the same way). Nothing to sync in memory (DCP would sync the whole machine instead)."""
    from torch.distributed.checkpoint import FileSystemWriter

    options = {"serialization_format": like.serialization_format} if hasattr(like, "serialization_format") else {}

    class _MemoryWriter(FileSystemWriter):
        def __init__(self) -> None:
            super().__init__(like.path, single_file_per_rank=like.single_file_per_rank, sync_files=False,
                             thread_count=like.thread_count, per_thread_copy_ahead=like.per_thread_copy_ahead,
                             overwrite=like.overwrite, **options)
            self.fs = _MemoryFiles(snap)

    return _MemoryWriter()


@contextlib.contextmanager
def _captured(snap: Snapshot, distributed: bool) -> Iterator[None]:
    import torch
    from accelerate.utils import other

    if distributed:  # (imported only then: its import took 0.09 s of the first save of every rank)
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.filesystem import FileSystemWriter
    else:
        dcp = FileSystemWriter = None

    save, safe_save = torch.save, other.safe_save_file
    dcp_save = dcp.save if dcp is not None else None
    _REAL_SAVE[0] = save
    cuda: list = []

    def is_path(f: Any) -> bool:
        return isinstance(f, (str, os.PathLike))

    def torch_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if not is_path(f) or args or threading.current_thread() is not _CAPTURING.thread:
            return save(obj, f, *args, **kwargs)  # a stream (DCP's own writes), or another thread's save
        before, held, later, objects = set(snap.segments), snap.nbytes, len(snap.deferred), snap.objects
        kept = _copy(obj, snap, cuda, os.fspath(f))
        if not isinstance(kept, _Serialised) and snap.objects > objects:  # (no walk of the copy to find them)
            kept = _Serialised(obj)  # a container with objects inside: its bytes, once
            for key in set(snap.segments) - before:  # the copies made on the way are not kept
                os.close(snap.segments.pop(key)[0])
            del snap.deferred[later:]
            snap.nbytes = held + len(kept.data)
        snap.writes.append(_Write(os.fspath(f), kept, False, kwargs))

    def safe_save_file(tensors: dict, filename: Any, metadata: dict | None = None) -> None:
        if threading.current_thread() is not _CAPTURING.thread:
            return safe_save(tensors, filename, metadata=metadata)
        snap.writes.append(_Write(os.fspath(filename), _copy(tensors, snap, cuda, os.fspath(filename)), True,
                                  {"metadata": metadata} if metadata is not None else {}))

    def distributed_save(state_dict: Any, *args: Any, storage_writer: Any = None, **kwargs: Any) -> Any:
        # The collectives run here, now, in step with the other ranks; only the local file system's writes are kept:
        # a writer of our own, built like the one Accelerate made, stands in for it.
        if threading.current_thread() is _CAPTURING.thread and type(storage_writer) is FileSystemWriter:
            storage_writer = _memory_writer(storage_writer, snap)
        return dcp_save(state_dict, *args, storage_writer=storage_writer, **kwargs)

    _CAPTURING.thread = threading.current_thread()
    try:
        with contextlib.ExitStack() as replaced:
            replaced.enter_context(patches.scoped(torch, "save", torch_save, "torch.save"))
            replaced.enter_context(patches.scoped(other, "safe_save_file", safe_save_file,
                                                  "accelerate.utils.other.safe_save_file"))
            # transformers' save_pretrained (a Trainer's snapshot, cluster.rank.trainer) writes safetensors through
            # its own import of save_file; a Trainer's plain nn.Module, through safetensors' module
            for module, name in (("safetensors.torch", "save_file"), ("transformers.modeling_utils", "safe_save_file")):
                if (holder := sys.modules.get(module)) is not None and hasattr(holder, name):
                    replaced.enter_context(patches.scoped(holder, name, safe_save_file, f"{module}.{name}"))
            if dcp is not None:
                replaced.enter_context(patches.scoped(dcp, "save", distributed_save,
                                                      "torch.distributed.checkpoint.save"))
            yield
            snap.on_gpu = bool(cuda)
            if cuda:
                torch.cuda.synchronize()  # the non-blocking copies are done before training changes the tensors
    finally:
        _CAPTURING.thread = None


def capture(save: Callable[[], Any], shared: bool = False, pool: SegmentPool | None = None, *,
            defer: frozenset[int] = frozenset(), distributed: bool = True) -> Snapshot:
    """Run ``save`` (a ``save_state`` and what goes with it) with its file writes kept in memory; ``shared``: CPU
    tensors in memfd segments, for a writer process (from ``pool``'s, and back to it on release, when given).
    ``defer``: the storages (``untyped_storage().data_ptr()``) of CPU tensors that only an optimizer's step changes,
    copied by :meth:`Snapshot.copy_deferred` after this returns. ``distributed``: the state may go through DCP (FSDP's
    sharded state), whose ``save`` is then captured too."""
    snap = Snapshot(shared=shared and hasattr(os, "memfd_create"), pool=pool, defer=defer)
    try:
        with _captured(snap, distributed):
            save()
    except BaseException:
        snap.release()
        raise
    if not snap.deferred:
        snap.copy_deferred()  # nothing left: marked copied
    return snap
