"""A rank's checkpoint writer: a process of its own that writes the tensor files of a snapshot held in shared memory.

Serialising with ``torch.save`` or safetensors' ``save_file`` holds the Python interpreter's lock for tens of
milliseconds a tensor (measured here: 33-98 ms for a 200 MB tensor with ``torch.save`` to a path, 75 ms with
``save_file``), so a thread of the rank that writes them stalls the training thread's Python between its
operators, and a thread at a lower CPU priority that holds the lock while it waits for a core stalls it longer.
A process of its own, at the lowest CPU priority, writes instead: the snapshot's tensors live in memfd segments
(``cluster.checkpoint.snapshot``) which it maps by the rank's descriptors (no copy), and nothing it does takes the
training thread's interpreter. The rank starts it on its first background save, from the training thread, and it
ends with that thread (``PR_SET_PDEATHSIG``) or when the rank closes its pipe. Imports nothing from Ray (of
raylaunch, ``cluster.checksums`` only).

Protocol, on the writer's stdin and stdout: length-prefixed pickles. A request is ``(pid, writes, hash, durable,
zip_crc)``; a write is ``(path, obj, safetensors, kwargs)`` whose tensors are persistent ids ``(fd, dtype, size,
stride, nbytes)`` naming the rank's memfd descriptors, or ``(path, fd, None, {})``: the rank's open file ``fd``
copied to ``path`` by the kernel (``copy_file``: a save's files from its snapshot in the node's memory, hashed from
the snapshot's pages, ``describe_copied``); ``hash`` is False (no checksums), True or ``"sha256"``, or a snapshot's
``cluster.checksums.SNAPSHOT_CHECKSUM`` (a snapshot's ``torch.save`` files are then written without the zip
format's own CRC-32 of each record, which its checksum covers; ``zip_crc``, None or a bool, says otherwise). The
answer is ``{"files": {path: {"size",
<hash>}}, "cpu_s": float}`` (each file's checksum under the name of its kind, when asked, after a flush to the disk
when ``durable``; ``cpu_s``: the CPU seconds, user and system, this process spent on the request, which ``auto``
snapshots budget:
``cluster.checkpoint.memory``) or ``{"error": str, "errno": int | None, "cpu_s": float}`` (``{"error": str,
"errno": None, "unmapped": True}`` when it could not map the segments).
"""

from __future__ import annotations

import contextlib
import io
import mmap
import os
import pickle
import struct
import subprocess
import sys
import threading
import time
from typing import Any, BinaryIO

from cluster.checksums import hasher

__all__ = ["CheckpointWriter", "WriteRequest", "WriterGone", "copy_file", "describe_copied", "describe_written"]

# The writer's niceness: it uses the cores training leaves, and yields them at once when training wants them.
WRITER_NICE = 19
_LEN = struct.Struct("<Q")

# (path, obj, safetensors, kwargs): one file, as ``cluster.checkpoint.snapshot`` keeps it.
WriteRequest = tuple[str, Any, bool, dict]


# (the project's root first on its path: ``cluster.checksums``, the one shared leaf it imports)
_BOOT = ("import importlib.util, os, sys; sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname("
         "os.path.abspath(sys.argv[1]))))); spec = importlib.util.spec_from_file_location('raylaunch_ckptwriter', "
         "sys.argv[1]); module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); module.main()")


def describe_written(path: str, durable: bool = False, checksum: str = "sha256") -> dict[str, Any]:
    """``{"size", checksum}`` of a file this process just wrote, hashed from the page cache (``checksum``: one of
    ``cluster.checksums.CHECKSUMS``). ``durable``: first flushed to its disk from this process, so the kernel's
    write-back of it runs here, at this process's priority and within the save's time, rather than in the kernel's
    flusher threads beside training up to 30 s later; its pages then leave the page cache (the next checkpoint does not
    evict the project's own files to make room)."""
    h = hasher(checksum)
    fd = os.open(path, os.O_RDONLY)
    size = 0
    # Read in pieces into one buffer that stays in the CPU's cache, not mapped: some of save_state's files are
    # written by every rank to one shared path (dl_state_dict.bin), so another rank may rewrite this file while
    # it is hashed; a mapping then failed ("mmap length is greater than file size") or would fault (SIGBUS).
    # What is read is hashed; ranks that disagree on a file leave it to the commit (``jobs.driver.routing._agreed``).
    # A file of a snapshot in the node's memory is this rank's alone (the shared ones are rank 0's there,
    # ``cluster.checkpoint.staged``): mapped, its pages are hashed where they are (576 MiB: 0.16 s read, 0.06 mapped).
    try:
        if not durable and checksum == "xxh3":
            return {"size": _hash_mapped(fd, h), checksum: h.hexdigest()}
        # (sized to the file, up to 1 MiB: a new buffer's pages are zeroed as they are touched, and a whole MiB for a
        # file of a few KB was most of its hash: 0.1 ms of each small file of a snapshot, #59)
        buf = bytearray(max(1, min(os.fstat(fd).st_size, 1 << 20)))
        view = memoryview(buf)
        if durable:
            os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while n := os.readv(fd, [buf]):
            h.update(view[:n])
            size += n
        if durable:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return {"size": size, checksum: h.hexdigest()}


def _hash_mapped(fd: int, h: Any) -> int:
    """Hash the whole of the open file ``fd`` through a read-only mapping of it (its size read once); returns that
    size. For a file no one truncates meanwhile (unlinked is fine): a mapping past its end faults."""
    size = os.fstat(fd).st_size
    if size:
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # (its pages mapped at once, not one fault each)
        with mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ) as mapped:
            h.update(mapped)
    return size


def describe_copied(source: int, path: str, durable: bool = False, checksum: str = "sha256") -> dict[str, Any]:
    """``describe_written`` of a file ``copy_file`` just made from ``source`` (a snapshot's file in the node's memory,
    which no one truncates): the hash of the source's pages, where they are, rather than of the copy read back (the
    same bytes, copied by the kernel); ``durable``: the copy flushed to its disk first, then out of the page cache."""
    if durable:
        out = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(out)
            os.posix_fadvise(out, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(out)
    h = hasher(checksum)
    return {"size": _hash_mapped(source, h), checksum: h.hexdigest()}


def copy_file(source: int, path: str) -> None:
    """The whole of the open file ``source`` (read from its start, whatever its offset) into a new file at ``path``,
    by the kernel (``sendfile``: no copy through this process's memory, no serialising again)."""
    size = os.fstat(source).st_size
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        offset = 0
        while offset < size:
            sent = os.sendfile(out, source, offset, min(size - offset, 1 << 30))
            if sent == 0:
                raise OSError(f"{path}: its source ended at {offset} of {size} bytes")
            offset += sent
    finally:
        os.close(out)


class WriterGone(RuntimeError):
    """The writer process is not there to answer (killed, out of memory): the rank's thread writes instead."""


class _SegmentPickler(pickle.Pickler):
    """Pickles a request with its tensors as persistent ids naming the rank's memfd segments (``segments``: id(tensor)
    -> (fd, nbytes, ...)); one class, not one made for every request."""

    def __init__(self, file: BinaryIO, segments: dict[int, tuple]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.segments = segments

    def persistent_id(self, obj: Any) -> Any:
        seg = self.segments.get(id(obj))
        if seg is None:
            return None
        return (seg[0], str(obj.dtype).removeprefix("torch."), tuple(obj.shape), tuple(obj.stride()), seg[1])


def _send(stream: BinaryIO, obj: Any, segments: dict[int, tuple] | None = None) -> None:
    buf = io.BytesIO()
    (_SegmentPickler(buf, segments) if segments else pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)).dump(obj)
    data = buf.getvalue()
    stream.write(_LEN.pack(len(data)) + data)
    stream.flush()


def _receive(stream: BinaryIO, unpickler: Any = None) -> Any:
    head = stream.read(_LEN.size)
    if len(head) < _LEN.size:
        raise EOFError("the other end closed the pipe")
    data = stream.read(_LEN.unpack(head)[0])
    return (unpickler or pickle.Unpickler)(io.BytesIO(data)).load()


class CheckpointWriter:
    """The rank's side: one writer process, started on the training thread, used by one write at a time."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()  # one request at a time (one save in flight a rank, but be plain about it)
        self.broken: str | None = None  # why the writer cannot be used (the rank's thread writes instead)
        self._ready = False  # the writer said it is ready
        self._spent = threading.local()  # the writer's CPU seconds for the requests of the calling thread

    def take_cpu_s(self) -> float:
        """The writer's CPU seconds (its answers' ``cpu_s``) for the calling thread's requests since it last asked."""
        spent, self._spent.value = getattr(self._spent, "value", 0.0), 0.0
        return spent

    def ensure(self) -> bool:
        """Start the writer if it is not running; False (and ``broken`` says why) if it cannot be."""
        if self._proc is not None and self._proc.poll() is None:
            return True
        if self.broken is not None:
            return False
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        try:
            # Loaded from this file, not as ``cluster.checkpoint.writer``: a project's own ``cluster`` package may come
            # first on its path (this module imports nothing of raylaunch's).
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _BOOT, __file__, str(os.getpid())], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, env=env, close_fds=True)
        except OSError as exc:
            self.broken = f"the checkpoint writer process could not start ({exc})"
            return False
        self._ready = False
        return True

    def ready(self) -> bool:
        """Whether the writer has its torch imported and answers (it says so once, first): until then a save is
        written by the rank's thread, so the first checkpoint is not held back by the writer's start."""
        if self._ready:
            return True
        proc = self._proc
        if proc is None or proc.stdout is None or proc.poll() is not None:
            return False
        import select

        if select.select([proc.stdout], [], [], 0)[0]:
            try:
                self._ready = _receive(proc.stdout) == {"ready": True}
            except (OSError, EOFError):
                return False
        return self._ready

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def write(self, writes: list[WriteRequest], segments: dict[int, tuple], *, hash_files: bool | str,
              durable: bool = False, zip_crc: bool | None = None) -> dict[str, dict]:
        """Write ``writes`` (tensors in ``segments``: id(tensor) -> (fd, nbytes, ...)) and return what it hashed
        (``describe_written``: ``durable``, flushed to the disk first; ``hash_files``: False, True for sha256, or the
        name of one of ``cluster.checksums.CHECKSUMS``). The writer's CPU for it adds to the calling thread's
        ``take_cpu_s``."""
        proc = self._proc
        if proc is None or proc.stdin is None or proc.stdout is None:
            raise WriterGone("the checkpoint writer is not running")

        with self._lock:
            try:
                if not self._ready:  # its first word: it is ready
                    self._ready = _receive(proc.stdout) == {"ready": True}
                _send(proc.stdin, (os.getpid(), writes, hash_files, durable, zip_crc), segments)
                answer = _receive(proc.stdout)
            except (OSError, EOFError) as exc:
                code = proc.poll()
                raise WriterGone(f"the checkpoint writer (pid {proc.pid}) ended"
                                   f"{f' with exit code {code}' if code is not None else ''}: {exc}") from exc
        self._spent.value = getattr(self._spent, "value", 0.0) + float(answer.get("cpu_s", 0.0))
        if "error" in answer:
            if answer.get("unmapped"):
                raise WriterGone(f"the checkpoint writer cannot read this rank's memory ({answer['error']})")
            if answer.get("errno") is not None:
                raise OSError(answer["errno"], answer["error"])
            raise RuntimeError(f"the checkpoint writer failed: {answer['error']}")
        return answer["files"]

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            if proc.stdin is not None:
                proc.stdin.close()  # the writer ends at the end of its input
            proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


# ---------------------------------------------------------------- the writer process


def _die_with_parent(parent: int) -> None:
    """Killed when the rank's training thread ends (Linux); a writer whose rank is already gone ends now."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(0)


def _serve(parent: int) -> None:
    import torch
    from safetensors.torch import save_file
    from torch.serialization import set_crc32_options

    torch.set_num_threads(1)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but answers on the pipe
    _send(stdout, {"ready": True})

    def tensor(pid: tuple) -> Any:
        fd, dtype, size, stride, nbytes = pid
        storage = torch.UntypedStorage.from_file(f"/proc/{parent}/fd/{fd}", shared=True, nbytes=nbytes)
        return torch.empty(0, dtype=getattr(torch, dtype)).set_(storage, 0, size, stride)

    class Unpickler(pickle.Unpickler):
        def persistent_load(self, pid: Any) -> Any:
            return tensor(pid)

    def handle(writes: list[WriteRequest], hash_files: bool | str, durable: bool, zip_crc: bool | None) -> dict:
        checksum = "sha256" if hash_files is True else hash_files
        # A snapshot's files: the zip's CRC-32 of each record left out of torch.save's (its own checksum covers them:
        # 16.8 MB of optimizer state 11.6 -> 5.0 ms of CPU); a committed checkpoint's files keep theirs, and so do
        # those of a snapshot a commit is copied from (``zip_crc``)
        set_crc32_options(checksum in ("sha256", False) if zip_crc is None else zip_crc)
        files = {}
        for path, obj, safetensors, kwargs in writes:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            if safetensors is None:  # a file of the rank's, by its descriptor
                source = os.open(f"/proc/{parent}/fd/{obj}", os.O_RDONLY)
                try:
                    copy_file(source, path)
                    if checksum:
                        files[path] = describe_copied(source, path, durable, checksum)
                finally:
                    os.close(source)
                continue
            if safetensors:
                save_file(obj, path, **kwargs)
            else:
                torch.save(obj, path, **kwargs)
            if checksum:
                files[path] = describe_written(path, durable, checksum)
        return {"files": files}  # the segments are unmapped on return, before the rank closes them

    while True:
        try:
            _pid, writes, hash_files, durable, zip_crc = _receive(stdin, Unpickler)
        except EOFError:
            return
        except Exception as exc:  # the rank's segments cannot be mapped here: its own thread writes instead
            _send(stdout, {"error": f"{type(exc).__name__}: {exc}", "errno": None, "unmapped": True})
            continue
        began = time.process_time()  # this process's CPU, user and system: the answer says what the request cost
        try:
            answer = handle(writes, hash_files, durable, zip_crc)
        except Exception as exc:  # said to the rank, which fails this save and keeps the previous checkpoint
            answer = {"error": f"{type(exc).__name__}: {exc}", "errno": getattr(exc, "errno", None)}
        del writes
        answer["cpu_s"] = time.process_time() - began
        _send(stdout, answer)


def main() -> None:
    parent = int(sys.argv[-1])
    os.setpriority(os.PRIO_PROCESS, 0, WRITER_NICE)  # before torch starts any thread: they all inherit it
    with contextlib.suppress(AttributeError, OSError):  # and Linux's idle class: a core only when no one else wants it
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    _die_with_parent(parent)
    _serve(parent)


if __name__ == "__main__":
    main()
