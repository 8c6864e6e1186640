"""One rank's checkpoints: Accelerate's state saved to staging (uploaded in the background on an object
store) and a committed checkpoint checked against its manifest and restored.

Under the runner ``cluster.runtime.Session`` hands ``save``, ``restore`` and
``wait_for_upload`` to a ``StagedCheckpoints``; the driver commits what every rank
staged (``jobs.run.storage.RunDir.checkpoints.commit``).
Imports nothing from Ray.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from pyarrow import fs as pafs

from cluster.checkpoint import lanes
from cluster.checkpoint.restore import node_copy, node_verified
from cluster.checkpoint.resume import (init_optimizers_for_load, keep_random_states_for_the_first_batch,
                                      load_loader_states, save_loader_states, seed_missing_rng)
from cluster.checkpoint.snapshot import SegmentPool, Snapshot, capture, close_fds
from cluster.checkpoint.writer import CheckpointWriter, WriterGone, copy_file, describe_copied
from cluster.checksums import SNAPSHOT_CHECKSUM
from cluster.context import WorkerContext
from cluster.errors import RaylaunchError
from cluster.layout import CHECKPOINTS, SCRIPT_FOLDER, checkpoint_name, run_of_staging
from cluster.storage_io import CheckpointError, describe_files, is_local, join_uri, open_uri, split_query

__all__ = ["CheckpointError", "CheckpointSaveError", "ScriptSave", "StagedCheckpoints"]

# Called when this rank's part of the checkpoint of ``step`` is on storage at ``uri``;
# ``files`` ({rel: {size, sha256}}) when it was hashed on local disk before an upload; keywords
# ``requested`` (the time the save was asked for) and ``blocked_s`` (how long it held training).
OnSaved = Callable[..., None]


# The most host memory a rank prepares ahead of its first save: this share of what its node has available when its
# first optimizer step ran, divided among the node's ranks.
PREPARE_SHARE = 0.5

# A save or snapshot whose parameters and optimizer state are fewer bytes than this copies them during its capture
# rather than beside the next forward and backward: at a few hundred KB the copy adds tens of microseconds to the
# hold, where deferring it held the snapshot's write back until the next optimizer step, a step longer in flight (a
# rank killed in that step lost one step more: the bar's case of ``make bench-recovery``, #59).
DEFER_FROM_BYTES = 4 << 20


def _on_first_optimizer_step(call: Callable[[Any], None]) -> Any:
    """``call(optimizer)`` once, after the first step of any optimizer in this process (torch's global step hook).
    The hook cannot remove itself (torch iterates over the hooks as it calls them): it does nothing after the first
    call, and the handle returned is removed by the caller, outside a step."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    fired: list[bool] = []

    def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        if not fired:
            fired.append(True)
            call(optimizer)

    return register_optimizer_step_post_hook(hook)


def _before_every_optimizer_step(owner: Any) -> Any:
    """``owner._before_optimizer_step()`` before the step of any optimizer in this process (torch's global pre-hook),
    for as long as ``owner`` lives; returns the hook's handle."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    ref = weakref.ref(owner)

    def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        me = ref()
        # Inline, what the owner's method would return at once for: nothing left to wait for (one call a step, #58)
        if me is not None and (me._copying is not None or me._first_step is not None and me._first_fired):
            me._before_optimizer_step()

    handle = register_optimizer_step_pre_hook(hook)
    weakref.finalize(owner, handle.remove)
    return handle


def _only_stepped(accelerator: Any) -> frozenset[int]:
    """The storages (``data_ptr``) of the CPU tensors that only an optimizer's step changes: the parameters of the
    prepared models and the state of the prepared optimizers. A save copies them after it returns, beside the next
    forward and backward (``cluster.checkpoint.snapshot``); none below ``DEFER_FROM_BYTES`` in all."""
    import torch

    tensors = [p for model in getattr(accelerator, "_models", []) for p in model.parameters()]
    for optimizer in getattr(accelerator, "_optimizers", []):
        inner = getattr(optimizer, "optimizer", optimizer)
        tensors += [v for state in inner.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    tensors = [t for t in tensors if type(t) in (torch.Tensor, torch.nn.Parameter) and not t.is_cuda and t.numel() > 0]
    if sum(t.numel() * t.element_size() for t in tensors) < DEFER_FROM_BYTES:  # copied during the capture
        return frozenset()
    return frozenset(t.untyped_storage().data_ptr() for t in tensors)


@dataclass
class _Hold:
    """How long one save held training: its call, and the wait of the next optimizer step for the copies the save
    left to its write (``cluster.checkpoint.snapshot``'s deferred copies)."""

    began: float  # time.perf_counter()
    step: int
    returned: float | None = None
    snap: Snapshot | None = None  # its deferred copies, when it left any
    step_from: float | None = None  # when the next optimizer step began to wait for them
    host_mb: float = 0.0
    snapshot: bool = False  # a snapshot in memory (``cluster.checkpoint.memory``): its hold is not logged

    def seconds(self) -> float:
        s = (self.returned or time.perf_counter()) - self.began
        copied = self.snap.copied_at if self.snap is not None else None
        if self.step_from is not None and copied is not None:
            s += max(0.0, copied - self.step_from)
        return s


def _state_sizes(optimizer: Any) -> tuple[list[int], bool]:
    """The bytes of each tensor of the optimizer's parameters and state, which a save copies; whether any is on a GPU.
    Sharded (``DTensor``) ones are left out: FSDP's sharded state goes through DCP, into memory of its own."""
    import torch

    tensors = [p for group in optimizer.param_groups for p in group["params"]]
    tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    sizes, cuda = [], False
    for t in tensors:
        if type(t).__name__ == "DTensor" or t.numel() == 0:
            continue
        sizes.append(t.numel() * t.element_size())
        cuda = cuda or t.is_cuda
    return sizes, cuda


def _available_bytes() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001 - no psutil: what the kernel calls free
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _prepare_pinned(sizes: list[int]) -> None:
    """Pinned host blocks of ``sizes``, allocated and freed: torch's caching host allocator keeps them, and the first
    save's copies off the GPU take them instead of asking the driver for new pinned memory."""
    import torch

    blocks = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for n in sizes]
    del blocks


class StagedCheckpoints:
    """Under the runner: save into the attempt's staging folder, restore the committed checkpoint it was given."""

    def __init__(self, staging_uri: str, restore_uri: str | None, on_saved: OnSaved, *,
                 context: WorkerContext, node_dir: str, background: bool = True,
                 log: Callable[[dict, int], None] | None = None, snapshot_dir: str | None = None) -> None:
        self.staging_uri, self.restore_uri = staging_uri, restore_uri
        self._snapshot_dir = snapshot_dir  # this node's snapshots in memory: a restart may resume from one here
        self._context, self._node_dir = context, node_dir  # the ranks of a node verify a restore once
        self._on_saved = on_saved
        self._background = background  # checkpoint.async
        self._log = log  # this rank's metrics: how long each save held training, and its memory
        self._upload: _Write | None = None  # this rank's checkpoint write or upload in flight
        self._writer = CheckpointWriter()  # the process that writes the tensors of a save in the background
        self._segments = SegmentPool()  # the last save's shared memory, copied into again by the next
        # A save's, while a snapshot's write it gave up still maps the segments above (``_abandon_snapshot``): made
        # at the first such save, kept for the next (one more copy of the state in host memory from then on)
        self._beside = SegmentPool()
        self._steps: set[int] = set()  # the steps this rank saved in this attempt
        self.prepared: threading.Thread | None = None  # the first save's host memory, being made
        self._first_fired = False  # the first optimizer step's hook ran (its handle goes at the next step)
        self._first_step = _on_first_optimizer_step(self._prepare_first_save) if background else None
        # A save's copies of what only an optimizer step changes are made after it returns; the next step waits for
        # them. Off (this rank, for good) once a save found such a tensor changed before its copy was made.
        self.defer_copies = background
        self._copying: _Hold | None = None  # the last save, until its deferred copies are known to be made
        self.last_hold_s: float | None = None  # how long the last save whose hold is known held training
        self.last_snapshot_hold_s: float | None = None  # the same, of the last snapshot in memory
        if background:
            _before_every_optimizer_step(self)

    def _prepare_first_save(self, optimizer: Any) -> None:
        """At the first optimizer step, when the state's size is known (parameters and optimizer state): in a thread
        of its own, prepare the host memory the first save copies into: memfd segments with every page faulted in on CPUs,
        pinned blocks in torch's caching host allocator on GPUs. Without it the first save held training 1.6 s for
        3 GiB of GPU state where later ones held 0.06 s. Skipped, said once, past ``PREPARE_SHARE`` of the memory
        available to each of the node's ranks."""
        self._first_fired = True
        if self._steps:
            return
        sizes, cuda = _state_sizes(optimizer)
        total = sum(sizes)
        bound = _available_bytes() * PREPARE_SHARE / max(1, self._context.local_world_size)
        if not total or total > bound:
            if total:
                print(f"raylaunch: rank {self._context.world_rank}: the first save's {total / 2**20:.1f} MiB of host memory "
                      f"is not prepared ahead (over {bound / 2**20:.1f} MiB, {PREPARE_SHARE:.0%} of what this node "
                      "has available, per rank): it is taken when the first save asks", file=sys.stderr, flush=True)
            return
        if not cuda and not hasattr(os, "memfd_create"):  # no shared segments here: the first save clones
            return
        # The writer process still starts at the first save: started here, its import of torch (0.4 cores over
        # make bench's steady steps) ran beside training, and a save it is not ready for is written by the rank's
        # thread anyway, from the same segments: it is the copy, not the writer, that holds training.

        def prepare() -> None:
            try:
                if cuda:
                    _prepare_pinned(sizes)
                else:
                    self._segments.prepare(sizes)
            except Exception as exc:  # noqa: BLE001 - never the function's failure: the first save makes its own
                print(f"raylaunch: the first save's host memory was not prepared ahead: {exc}", file=sys.stderr,
                      flush=True)

        self.prepared = threading.Thread(target=prepare, daemon=True, name="raylaunch-first-save")
        self.prepared.start()

    def save(self, accelerator: Any, step: int, script: ScriptSave | None = None,
             beside: tuple[str, Callable[..., None]] | None = None) -> str:
        """This rank's part of the checkpoint of ``step``, into staging; ``script``: a script's ``save_state``;
        ``beside``: where its capture is written into the node's memory too, as the snapshot of its step
        (``MemorySnapshots.beside_save``; only where the save is written in the background: else it is called with
        None)."""
        requested = time.time()
        began = time.perf_counter()
        if self._first_step is not None:  # the first step's hook has fired, or never will be needed now
            self._first_step.remove()
            self._first_step = None
        if step in self._steps:  # saved twice at one step (a script's step_100, then best): after the first's commit
            self.wait_for_upload()
            self._wait_for_commit(step)
        self._steps.add(step)
        uri = join_uri(self.staging_uri, checkpoint_name(step))
        hold = _Hold(began, step)

        def saved(files: dict[str, dict] | None) -> None:
            # A report made before the save returns (a shared path without async) is all within the hold; one made
            # after the next optimizer step waited for the save's copies counts that wait.
            self._on_saved(step, uri, files, requested=requested, blocked_s=hold.seconds(),
                           script_folder=None if script is None else script.mirror or script.folder)

        if self._background and _copies_in_memory(accelerator):
            hold.host_mb = self._save_in_background(accelerator, uri, step, script, saved, hold, beside)
        else:
            self._save_now(accelerator, uri, step, script, saved)
            if beside is not None:
                beside[1](step, beside[0], None)  # not taken: nothing in flight
        hold.returned = time.perf_counter()
        if hold.snap is not None and not hold.snap.copied.is_set():
            self._copying = hold  # its hold is known (and logged) once the next step has its copies
        else:
            self._log_hold(hold)
        return uri

    def _log_hold(self, hold: _Hold) -> None:
        if hold.snapshot:
            self.last_snapshot_hold_s = hold.seconds()
            return
        self.last_hold_s = hold.seconds()
        if self._log is not None:
            self._log({"checkpoint_blocked_s": self.last_hold_s, "checkpoint_host_mb": hold.host_mb}, hold.step)

    def _before_optimizer_step(self) -> None:
        """Before any optimizer's step: the last save's deferred copies are made before the step changes what they
        copy (waited for here, and counted in that save's hold). The first step's hook, once it fired, is removed
        here, outside the post hooks torch is iterating over (it was called on every later step, for nothing)."""
        if self._copying is not None:
            self._settle(at_step=True)
        if self._first_fired and self._first_step is not None:
            self._first_step.remove()
            self._first_step = None

    def _settle(self, at_step: bool) -> None:
        hold, self._copying = self._copying, None
        if hold is None:
            return
        if at_step:
            hold.step_from = time.perf_counter()
        hold.snap.copied.wait()
        self._log_hold(hold)

    def _save_in_background(self, accelerator: Any, uri: str, step: int, script: ScriptSave | None,
                            saved: Callable[[dict[str, dict] | None], None], hold: _Hold,
                            beside: tuple[str, Callable[..., None]] | None = None) -> float:
        """Copy this rank's state into memory (what only an optimizer step changes: by the write, before the next
        step) and return the MiB it holds; a thread writes (and uploads) it, then reports it."""
        fs, path = open_uri(uri)
        safe, kwargs = (script.safe_serialization, script.kwargs) if script else (True, {})
        behind = self._abandon_snapshot()  # a snapshot's write in flight never holds a save: it goes first
        self.wait_for_upload()  # at most one save in flight: one asked for meanwhile waits here
        target = path if is_local(fs) else self._upload_folder(step)

        def save() -> None:
            _save_state(accelerator, target, step, safe, kwargs)
            if script is not None:
                script.label(target, accelerator.is_main_process)

        # Started here, on the training thread (it ends with this thread), at the first save.
        on_cpu = getattr(getattr(accelerator, "device", None), "type", "cpu") == "cpu"  # a GPU's copy: pinned memory
        writer = self._writer if on_cpu and self._writer.ensure() else None
        # FSDP's state goes through DCP (captured, nothing deferred); DCP is imported only where it may be used.
        from accelerate.utils import DistributedType

        sharded = getattr(accelerator, "distributed_type", None) == DistributedType.FSDP
        defer = _only_stepped(accelerator) if on_cpu and self.defer_copies and not sharded else frozenset()
        try:
            snap = capture(save, shared=writer is not None, pool=self._segments if behind is None else self._beside,
                           defer=defer,
                           distributed=sharded or "torch.distributed.checkpoint" in sys.modules)
        except BaseException:
            if not is_local(fs):
                shutil.rmtree(target, ignore_errors=True)
            if beside is not None:
                beside[1](step, beside[0], None)  # not taken
            raise
        if script is None and not accelerator.is_main_process:
            # Accelerate has every rank write its stateful loaders' state to one shared path (dl_state_dict.bin,
            # the last writer wins; each rank's own is in dl_state_rank<R>.bin): only rank 0's is written, so no
            # two ranks rewrite one file while another hashes it. (A script's ranks each mirror their files into
            # its own folder, which then lacks none of save_state's.)
            snap.writes[:] = [w for w in snap.writes if not _EVERY_RANK_WRITES.fullmatch(os.path.basename(w.path))]
        if script is not None and script.mirror is not None:
            # Its files come from the background write, but the folder is there when save_state returns, as
            # Accelerate's own save_state leaves it: a script may write beside it at once (its result.json in
            # output_dir; tests/test_jobs.py's launch-script job failed so on a loaded machine).
            os.makedirs(script.mirror, exist_ok=True)
        hold.snap = snap
        self._upload = _Write(snap, target, None if is_local(fs) else uri, step,
                              mirror=script.mirror if script else None, on_done=saved,
                              writer=None if snap.on_gpu else writer, on_changed=self._changed_before_copied,
                              behind=behind, beside=beside)
        return snap.nbytes / 2**20

    def _abandon_snapshot(self) -> _Write | None:
        """A snapshot's write in flight when a save comes never holds the save: it is returned, for the save's write to
        start after it ends (one request at a time to the writer process), and the save holds training for its own copy
        only, where waiting held it for the rest of that write (0.49 s median at 576 MiB a rank, against 0.016 s
        without snapshots: ``make bench-recovery``). One whose write has not begun is given up (``_Write.abandon``:
        nothing of it is written or reported; the save's step is at least its step). One whose files are being
        written is kept and reported when written: the writer process cannot stop within a request, so one given up
        there was written whole all the same and then removed, and until the save is committed it is the newest state
        a restart can read (without it, the commit before).
        The save copies into segments of its own (``_beside``), kept for the next such save: the snapshot's are still
        mapped by the writer, and new ones, their pages faulted in by the copy, held the next step 0.2-0.5 s at 576 MiB
        on a loaded 2-core machine where kept ones held it 0.006 s."""
        upload = self._upload
        if upload is None or not upload.snapshot or not upload.busy():
            return None
        upload.abandon()  # (no-op once its files are being written)
        self._upload = None
        return upload

    def hold_in_memory(self, accelerator: Any, step: int, folder: str,
                       written: Callable[[int, str, dict[str, dict] | None, float, float], None],
                       save: Callable[[str, Callable[[], None]], None] | None = None, saved_too: bool = False) -> bool:
        """A snapshot (``cluster.checkpoint.memory``): this rank's part of the state of ``step`` copied as a save's
        is, written by the writer process into ``folder`` (on the node's memory) and never committed, its files
        checksummed with xxh3 (``cluster.checksums.SNAPSHOT_CHECKSUM``); ``written(step, folder, files, cpu_s,
        writer_cpu_s)`` once it is there, or given up (``files`` None: it failed, or a save came before its write
        began), with the CPU
        seconds its write took on the rank's thread and in the writer process (``_Write.cpu_s``, ``writer_cpu_s``).
        False, and nothing taken, at a step this rank saved (but ``saved_too``: a stop notice's, which the restart
        reads from memory), while a save or the previous snapshot is still
        being written (training never waits for a snapshot's write) or where a save cannot be held in memory
        (DeepSpeed's, Megatron-LM's). ``save(folder, default)`` runs the save under the capture in place of
        ``default()`` (the Accelerator's ``save_state`` into ``folder``): a script's within its own save_state's
        scope, a Trainer's its own writes."""
        if step in self._steps and not saved_too:  # this rank saved this step: its commit holds it
            return False
        upload = self._upload
        if upload is not None:
            if upload.busy() or (not upload.snapshot and upload.error is not None):
                return False  # a save's failure is the function's next save's (or its end's) to raise
            self._upload = None
            upload.wait(quiet=True)
        if not _copies_in_memory(accelerator):
            return False
        began = time.perf_counter()
        if self._first_step is not None:
            self._first_step.remove()
            self._first_step = None
        self._settle(at_step=False)
        hold = _Hold(began, step, snapshot=True)
        on_cpu = getattr(getattr(accelerator, "device", None), "type", "cpu") == "cpu"
        # Every size through the writer process, a few hundred KB too: written by the rank's write thread, a 307 KB
        # part held the interpreter's lock 1.6-2.4 ms a snapshot, and the step after it was 2.2-3.7 ms slower (the
        # training thread waits for the lock between its operators; paired steps, one process); through the writer
        # 1.0 ms (the rank's thread spends 0.4 ms on the request), and the writer's own CPU is at the lowest priority
        # (``auto`` counts it in the share of the node's cores that was busy).
        writer = self._writer if on_cpu and self._writer.ensure() else None
        from accelerate.utils import DistributedType

        sharded = getattr(accelerator, "distributed_type", None) == DistributedType.FSDP
        defer = _only_stepped(accelerator) if on_cpu and self.defer_copies and not sharded else frozenset()

        def default() -> None:
            _save_state(accelerator, folder, step)

        snap = capture(default if save is None else lambda: save(folder, default), shared=writer is not None,
                       pool=self._segments, defer=defer,
                       distributed=sharded or "torch.distributed.checkpoint" in sys.modules)
        if not accelerator.is_main_process:
            snap.writes[:] = [w for w in snap.writes if not _EVERY_RANK_WRITES.fullmatch(os.path.basename(w.path))]
        hold.snap = snap
        self._upload = _Write(snap, folder, None, step, mirror=None,
                              on_done=lambda files, *cpu: written(step, folder, files, *cpu),
                              writer=None if snap.on_gpu else writer, on_changed=self._snapshot_changed,
                              durable=False, snapshot=True)
        hold.returned = time.perf_counter()
        if not snap.copied.is_set():
            self._copying = hold
        else:
            self._log_hold(hold)
        return True

    def _snapshot_changed(self, step: int, files: list[str]) -> None:
        """A snapshot's deferred copy found its tensor changed before it was made: that snapshot is not kept, and
        every later save or snapshot of this rank copies before it returns."""
        self.defer_copies = False
        print(f"raylaunch: rank {self._context.world_rank}: the snapshot of step {step} is not kept: "
              f"{', '.join(os.path.basename(f) for f in files)} changed in place before the next optimizer step; "
              "from now on this rank's saves copy everything before they return", file=sys.stderr, flush=True)

    def _changed_before_copied(self, step: int, files: list[str]) -> None:
        """A save's deferred copy found its tensor changed in place before the copy was made: that checkpoint is not
        written (it could hold part of the change) and every later save of this rank copies before it returns."""
        self.defer_copies = False
        self._steps.discard(step)  # a save at this step again is not a second save waiting for this one's commit
        print(f"raylaunch: rank {self._context.world_rank}: the checkpoint of step {step} is not saved: a parameter "
              f"or optimizer state in {', '.join(os.path.basename(f) for f in files)} changed in place after "
              "session.save returned and before the next optimizer step (raylaunch copies them in that time). The "
              "previous committed checkpoint is kept; from now on this rank's saves copy everything before they "
              "return. Change parameters before saving, or in the optimizer's step.", file=sys.stderr, flush=True)

    def _save_now(self, accelerator: Any, uri: str, step: int, script: ScriptSave | None,
                  saved: Callable[[dict[str, dict] | None], None]) -> None:
        """checkpoint.async: false (or DeepSpeed): the state is written before training goes on."""
        fs, path = open_uri(uri)
        safe, kwargs = (script.safe_serialization, script.kwargs) if script else (True, {})
        if is_local(fs):
            _save_state(accelerator, path, step, safe, kwargs)
            if script is not None:
                script.label(path, accelerator.is_main_process)
            # Everyone has finished writing before anyone reports: the driver
            # commits on the last report and must see every rank's files.
            accelerator.wait_for_everyone()
            if script is not None and script.mirror is not None:
                if self._context.local_rank == 0:  # each node's folder gets the whole checkpoint, once
                    _mirror(path, script.mirror)
                accelerator.wait_for_everyone()  # before the commit moves the staging folder
            saved(None)
            return
        self.wait_for_upload()  # training that outruns uploads waits here, not later
        local = self._upload_folder(step)
        try:
            _save_state(accelerator, local, step, safe, kwargs)
            if script is not None:
                script.label(local, accelerator.is_main_process)
                if script.mirror is not None:
                    _mirror(local, script.mirror)  # this rank's files, as it wrote them
        except BaseException:
            shutil.rmtree(local, ignore_errors=True)
            raise
        self._upload = _Write(None, local, uri, step, mirror=None, on_done=saved)  # written: only the upload
        if script is not None and script.mirror is not None:
            accelerator.wait_for_everyone()  # every rank's files are in the script's folder when save_state returns

    def _upload_folder(self, step: int) -> str:
        """A folder for the files of ``step`` bound for an object store, until they are uploaded: in the node's
        folder of this attempt, which goes with the node actor's scratch folder (at the job's end, or when the next
        node actor on this machine finds its process gone), so a rank killed before its upload leaves nothing in the
        temporary folder."""
        return tempfile.mkdtemp(prefix=f"raylaunch-ckpt-{step:08d}-", dir=self._node_dir)

    def _wait_for_commit(self, step: int, timeout_s: float = 300.0) -> None:
        """Until the staging folder of ``step`` is gone: the driver committed it (moved or copied it away)."""
        fs, path = open_uri(join_uri(self.staging_uri, checkpoint_name(step)))
        deadline = time.monotonic() + timeout_s
        while fs.get_file_info(path).type != pafs.FileType.NotFound:
            if time.monotonic() > deadline:
                raise CheckpointSaveError(f"the checkpoint of step {step} was saved twice, and the first was not "
                                          f"committed within {timeout_s:g} s; save each step once")
            time.sleep(0.05)

    def wait_for_upload(self) -> None:
        self._settle(at_step=False)
        upload, self._upload = self._upload, None
        if upload is not None:
            upload.wait()  # a snapshot's failure is said, not raised

    def _committed(self) -> str | None:
        """The checkpoint to restore, once it is known to be a committed one of this run."""
        uri = self.restore_uri
        if uri is None:
            return None
        path = open_uri(uri)[1]
        run = run_of_staging(open_uri(self.staging_uri)[1])
        snapshots = self._snapshot_dir
        if snapshots is not None and os.path.dirname(path) == snapshots and \
                os.path.basename(path).startswith("restore-"):
            return uri  # a snapshot the node actor put together from this run's (cluster.checkpoint.memory)
        if not path.startswith(f"{run}/{CHECKPOINTS}/"):
            raise CheckpointError(f"{uri} is not a committed checkpoint of this run ({run}); refusing to load it")
        return uri

    def resume_folder(self) -> tuple[str, dict] | None:
        """For a script: the committed checkpoint, verified, in a folder on this node under the name the script
        gave ``save_state``; and its manifest. None when there is nothing to resume from."""
        uri = self._committed()
        if uri is None:
            return None
        return node_copy(uri, self._node_dir, self._context.local_world_size)

    def restore(self, accelerator: Any) -> int | None:
        uri = self._committed()
        if uri is None:
            return None
        # Read and verified (on object storage: downloaded) once per node, in the node's scratch folder.
        ctx = self._context
        with node_verified(uri, self._node_dir, ctx.local_world_size) as (ready, manifest):
            init_optimizers_for_load(accelerator)
            accelerator.load_state(ready)
            load_loader_states(accelerator, ready)
        # Saved by fewer ranks (another world size): this rank's RNGs get a defined state.
        seed_missing_rng(manifest["files"], ctx.world_rank, int(manifest["step"]))
        keep_random_states_for_the_first_batch()  # a resume mid-epoch draws what the uninterrupted run drew
        align_accumulation(accelerator)  # accumulation counts from the checkpoint's optimizer step
        return int(manifest["step"])


def align_accumulation(accelerator: Any) -> None:
    """Make the next ``gradient_accumulation_steps`` micro-batches one optimizer step.

    ``load_state`` restores Accelerate's micro-batch counter (``accelerator.step``), which
    ``accumulate`` syncs on when it is a multiple of the accumulation. A checkpoint is saved at
    an optimizer step, so the counter is a multiple of the accumulation it was saved with; when
    the runner resumes with another one (an elastic run that changed its world size), the
    counter is brought down to a multiple of the new one. Otherwise it is left as it is.
    """
    steps = getattr(accelerator, "gradient_accumulation_steps", 1) or 1
    if isinstance(getattr(accelerator, "step", None), int):
        accelerator.step -= accelerator.step % steps


class CheckpointSaveError(RaylaunchError, RuntimeError):
    """A checkpoint could not be written or uploaded; the previous committed one is kept."""


@dataclass(frozen=True)
class ScriptSave:
    """A script's ``save_state(output_dir, ...)``: how it asked to save, and the folder it named."""

    folder: str  # the name of the folder it gave (step_30): its resume folder gets the same name
    mirror: str | None  # the folder to fill with the checkpoint's files; None: the script's own save wrote it
    safe_serialization: bool = True
    kwargs: dict = field(default_factory=dict)

    def label(self, path: str, main: bool) -> None:
        if main:
            Path(path, SCRIPT_FOLDER).write_text(json.dumps({"folder": self.folder}))


def _mirror(source: str, target: str) -> None:
    """Copy every file of ``source`` into ``target``, each written whole (a temporary name, then renamed), so
    nodes that share ``target`` may copy the same files at once. Copies, never links: a script that later
    writes into its folder must not write into a committed checkpoint."""
    _mirror_files(source, [os.path.relpath(os.path.join(root, n), source)
                           for root, _, names in os.walk(source) for n in names], target)


def _mirror_files(source: str, files: list[str], target: str) -> None:
    """``files`` of ``source`` copied into ``target``, but raylaunch's own label of a script's checkpoint: that
    belongs to the run directory, not to the script's output."""
    _copy_files(source, [f for f in files if f != SCRIPT_FOLDER], target)


def _copy_files(source: str, files: list[str], target: str) -> None:
    for rel in files:
        dest = Path(target, rel)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.raylaunch-{os.getpid()}")
        shutil.copyfile(os.path.join(source, rel), tmp)
        os.replace(tmp, dest)


def _save_state(accelerator: Any, path: str, step: int, safe_serialization: bool = True,
                kwargs: dict | None = None) -> None:
    """``save_state`` (model weights as safetensors unless a script asked otherwise); a full disk is said in plain
    words."""
    try:
        with _into(accelerator, path):
            accelerator.save_state(path, safe_serialization=safe_serialization, **(kwargs or {}))
        save_loader_states(accelerator, path)  # each rank's own stream position
    except Exception as exc:
        if not _out_of_space(exc, path):
            raise
        shutil.rmtree(path, ignore_errors=True)  # a part no commit will ever count
        raise _no_space(path, step, exc) from exc


def _no_space(path: str, step: int, exc: BaseException) -> CheckpointSaveError:
    return CheckpointSaveError(
        f"no space left on the device holding {path}: the checkpoint of step {step} was not written "
        f"({exc}). The previous committed checkpoint is kept; free space there, or set `storage` "
        "(or the node's temporary folder, TMPDIR, for object storage) to a larger volume.")


@contextlib.contextmanager
def _into(accelerator: Any, path: str) -> Iterator[None]:
    """``save_state`` into ``path`` even with Accelerate's automatic checkpoint naming, which would write
    ``project_dir/checkpoints/checkpoint_<n>`` instead, prune the script's own folders and count the save."""
    config = getattr(accelerator, "project_configuration", None)
    if config is None or not getattr(config, "automatic_checkpoint_naming", False):
        yield
        return
    iteration = config.iteration
    config.automatic_checkpoint_naming = False
    try:
        yield
    finally:
        config.automatic_checkpoint_naming = True
        config.iteration = iteration


def _out_of_space(exc: BaseException, path: str) -> bool:
    """ENOSPC anywhere in the chain, or (torch.save says only "unexpected pos") a full filesystem."""
    seen: BaseException | None = exc
    while seen is not None:
        text = str(seen)
        if getattr(seen, "errno", None) == errno.ENOSPC or "No space left" in text or "os error 28" in text:
            return True
        seen = seen.__cause__ or seen.__context__
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).free < (1 << 20)
    except OSError:
        return False


# The files Accelerate's save_state has every rank write to the same path.
_EVERY_RANK_WRITES = re.compile(r"dl_state_dict(_\d+)?\.bin")

def _copies_in_memory(accelerator: Any) -> bool:
    """Whether this save's state can be held in memory and written later: not DeepSpeed's or Megatron-LM's (their
    engines write their own files). FSDP's sharded state is (``cluster.checkpoint.snapshot`` keeps DCP's writes)."""
    from accelerate.utils import DistributedType

    return getattr(accelerator, "distributed_type", None) not in (DistributedType.DEEPSPEED,
                                                                  DistributedType.MEGATRON_LM)


class _Write:
    """One rank's checkpoint part, written from memory (``snap``; None: on local disk already; the tensor files by
    the rank's writer process once it is ready) and, on an object store (``upload_uri``), uploaded, all waited on
    by the rank's checkpoint lanes (``cluster.checkpoint.lanes``); then reported."""

    def __init__(self, snap: Snapshot | None, target: str, upload_uri: str | None, step: int, *, mirror: str | None,
                 on_done: Callable[[dict[str, dict] | None], None], writer: CheckpointWriter | None = None,
                 on_changed: Callable[[int, list[str]], None] | None = None, durable: bool | None = None,
                 snapshot: bool = False, behind: _Write | None = None,
                 beside: tuple[str, Callable[..., None]] | None = None) -> None:
        self.snap, self.target, self.upload_uri, self.step, self.mirror = snap, target, upload_uri, step, mirror
        # A save's capture written into the node's memory too, before its own files, as the snapshot of its step
        # (``MemorySnapshots.beside_save``: the folder, and what is called once that part is written or failed)
        self.beside = beside
        # Files written into the run's storage are flushed before they are reported (their write-back at the
        # writer's priority, within the save); files bound for an upload, or a snapshot's in memory, are not.
        self.durable = upload_uri is None if durable is None else durable
        # A snapshot in memory: its failure is said, never raised; its files checksummed with crc32, and ``on_done``
        # called ``(files, cpu_s, writer_cpu_s)`` whatever became of it (``files`` None: not written, or given up).
        self.snapshot = snapshot
        self.behind = behind  # a snapshot's write in flight when this save came, which writes once it has ended
        self.cpu_s = 0.0  # CPU seconds of the write on the rank's own thread (its writing, the writer's requests)
        self.writer_cpu_s = 0.0  # and in the writer process, for it
        self._abandoned = threading.Event()
        self._started = False  # its files are being written (``abandon`` no longer gives it up)
        self._lock = threading.Lock()
        self._on_changed = on_changed  # a deferred copy's tensor changed before it was made: nothing is written
        self.writer = writer  # the rank's writer process, for the files holding tensors (None: this thread)
        self._own = [w.path for w in snap.writes] if snap is not None else []  # this rank's files in ``target``
        self.error: BaseException | None = None
        self._on_done = on_done
        self._done = threading.Event()  # written and reported, or given up, or failed
        lanes.COPY.submit(self._copy)

    def abandon(self) -> bool:
        """Give this snapshot's write up if it has not begun: nothing of it is written or reported. False once its
        files are being written: the writer process cannot stop within a request, so it is written and reported."""
        with self._lock:
            if self._started:
                return False
            self._abandoned.set()
            return True

    def _copy(self) -> None:
        """On the copy lane, at the rank's own priority: the copies the next optimizer step waits for; then the
        write, on the write lane (beside training, not ahead of it)."""
        changed: list[str] = []
        try:
            changed = self.snap.copy_deferred() if self.snap is not None else []
            if changed and self._on_changed is not None:
                self._on_changed(self.step, changed)
        except BaseException as exc:
            self._fail(exc)
            self._end(None)
            return
        if changed:
            self._end(None)  # never reported: the previous committed checkpoint stays the latest
        else:
            lanes.WRITE.submit(self._write)

    def _write(self) -> None:
        files: dict[str, dict] | None = None
        try:
            if self.behind is not None:  # (ahead of this one on the write lane: ended already)
                self.behind._done.wait()
                self.behind = None
            with self._lock:
                if self._abandoned.is_set():
                    self._remove_own_files()
                    return
                self._started = True
            sources = None
            if self.beside is not None and self.snap is not None:
                sources = self._write_beside(*self.beside)
            began = time.thread_time()
            if self.writer is not None:
                self.writer.take_cpu_s()  # (nothing of another write counts in this one's)
            try:
                written, hashed = self._write_files() if sources is None else self._commit_from(sources)
            finally:
                self.cpu_s = time.thread_time() - began
                self.writer_cpu_s = self.writer.take_cpu_s() if self.writer is not None else 0.0
            if self.mirror is not None:  # this rank's files, as it wrote them
                _mirror_files(self.target, [os.path.relpath(p, self.target) for p in written], self.mirror)
            # This rank's files, hashed as they were written (by the writer process, at the lowest priority), so
            # the driver's commit reads nothing back.
            files = {os.path.relpath(p, self.target): meta for p, meta in hashed.items()} or None
            if self.snapshot:
                files = files or {}
                return  # reported in ``_end``, with its cost
            if self.upload_uri is not None:  # and the rest of the folder (a script's label), here, on local disk
                files = describe_files(pafs.LocalFileSystem(), self.target, files)
                fs, path = open_uri(self.upload_uri)
                pafs.copy_files(self.target, path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)
            self._on_done(files)
        except BaseException as exc:  # handed to the training thread by wait()
            self._fail(exc)
            files = None
        finally:
            self._end(files)

    def _write_beside(self, folder: str, written: Callable[..., None]) -> dict[str, int] | None:
        """The snapshot of this save's step: the same copies written into ``folder`` on the node's memory (xxh3,
        not flushed), first: it is there within the time a small state's write takes, where the commit lands only
        once every rank's part is on storage. Its failure is said, never the save's. Returns its files, open (each
        of this save's own paths -> a descriptor of its twin in ``folder``: read whole even if the snapshot is
        pruned meanwhile), from which the commit is copied (``_commit_from``: not serialized a second time); the
        state's copies in host memory are then released. None where it was not written: the commit is written from
        those copies."""
        began = time.thread_time()
        if self.writer is not None:
            self.writer.take_cpu_s()
        files: dict[str, dict] | None = None
        sources: dict[str, int] = {}
        try:
            ready = self.writer is not None and self.writer.ready()
            view = self.snap.retargeted(self.target, folder)
            # (its torch.save files with the zip's CRC-32 of each record, as a committed checkpoint's: it is copied)
            _, hashed = view.write(self.writer if ready else None, hash_files=SNAPSHOT_CHECKSUM, durable=False,
                                   zip_crc=True)
            files = {os.path.relpath(p, folder): meta for p, meta in hashed.items()}
            for own, twin in zip(self.snap.writes, view.writes):
                sources[own.path] = os.open(twin.path, os.O_RDONLY)
        except Exception as exc:  # noqa: BLE001 - the commit goes on; its step has no snapshot
            print(f"raylaunch: the snapshot of step {self.step} beside its save was not written: {exc}",
                  file=sys.stderr, flush=True)
            close_fds(sources.values())
            sources = {}
        cpu_s = time.thread_time() - began
        writer_cpu_s = self.writer.take_cpu_s() if self.writer is not None else 0.0
        self._beside_written(files, cpu_s, writer_cpu_s)
        if files is None or not sources:
            return None
        self.snap.release()  # (back to the pool, for the next save)
        return sources

    def _commit_from(self, sources: dict[str, int]) -> tuple[list[str], dict[str, dict]]:
        """This save's files copied from its snapshot's (``_write_beside``: open), by the kernel, into ``target``;
        flushed as ``_write_files`` does and hashed (sha256) from the snapshot's pages. The writer process copies (the
        lowest priority, and nothing of it takes the training thread's interpreter); this thread where it has none, or
        it failed. Against writing the commit from the copies in host memory as well: its serializing and the zip's
        CRC-32s (0.45 s of the writer's CPU at 576 MiB) become one kernel copy (0.1 s), and nothing is read back."""
        hashed: dict[str, dict] = {}
        try:
            if self.writer is not None and self.writer.ready():
                try:
                    hashed = self.writer.write([(path, fd, None, {}) for path, fd in sources.items()], {},
                                               hash_files=self._checksum, durable=self.durable)
                    return list(sources), hashed
                except Exception as exc:  # noqa: BLE001 - the writer's failure, or the target's: this thread tries
                    if isinstance(exc, WriterGone):
                        self.writer.broken = str(exc)
                    print(f"raylaunch: the checkpoint writer did not copy the checkpoint of step {self.step} ({exc}); "
                          "this rank copies it", file=sys.stderr, flush=True)
            for path, fd in sources.items():
                copy_file(fd, path)
                hashed[path] = describe_copied(fd, path, self.durable, self._checksum)
            return list(sources), hashed
        finally:
            close_fds(sources.values())

    def _beside_written(self, files: dict[str, dict] | None, cpu_s: float = 0.0, writer_cpu_s: float = 0.0) -> None:
        """Say once what became of the snapshot beside this save (None: not written, or not begun)."""
        beside, self.beside = self.beside, None
        if beside is None:
            return
        try:
            beside[1](self.step, beside[0], files, cpu_s, writer_cpu_s)
        except Exception as exc:  # noqa: BLE001 - never the save's failure
            print(f"raylaunch: the snapshot of step {self.step} beside its save was not kept: {exc}", file=sys.stderr,
                  flush=True)

    def _fail(self, exc: BaseException) -> None:
        self.error = exc
        if self.upload_uri is None:  # (before an upload the folder is this rank's own: ``_end`` removes it)
            self._remove_own_files()

    def _end(self, files: dict[str, dict] | None) -> None:
        try:
            self._beside_written(None)  # (a save given up, failed or changed before its copy: none beside it)
            if self.snap is not None:
                self.snap.release()
            if self.upload_uri is not None:
                shutil.rmtree(self.target, ignore_errors=True)
            if self.snapshot:
                self._report_snapshot(files)
        finally:
            self._done.set()

    def _report_snapshot(self, files: dict[str, dict] | None) -> None:
        try:
            self._on_done(files, self.cpu_s, self.writer_cpu_s)
        except BaseException as exc:  # (said by wait(), as a write's failure)
            self.error = self.error or exc

    def _remove_own_files(self) -> None:
        """Remove this rank's part of a shared staging folder, which no commit will ever count: its own files, not
        the folder every rank writes into, so one rank's failure never shows up in another's save as a folder
        gone from under it."""
        for path in self._own:
            with contextlib.suppress(OSError):
                os.remove(path)
        if self.snapshot:  # its folder on the node's memory, when no other rank's part is in it
            with contextlib.suppress(OSError):
                os.rmdir(self.target)

    def _write_files(self) -> tuple[list[str], dict[str, dict]]:
        """The snapshot's files written (the writer process first; this thread when it has none, or it broke), and
        on a shared path their sizes and hashes."""
        if self.snap is None:
            return [], {}
        durable = self.durable
        try:
            try:
                # Until the writer has started (the rank's first save), this thread writes: the first checkpoint is
                # committed as soon as it would be without a writer.
                ready = self.writer is not None and self.writer.ready()
                return self.snap.write(self.writer if ready else None, hash_files=self._checksum, durable=durable)
            except WriterGone as exc:  # the writer process ended (killed, out of memory): this thread writes
                print(f"raylaunch: {exc}; this rank writes the checkpoint of step {self.step} itself", file=sys.stderr,
                      flush=True)
                if self.writer is not None:
                    self.writer.broken = str(exc)
                return self.snap.write(None, hash_files=self._checksum, durable=durable)
        finally:
            self.snap.release()

    @property
    def _checksum(self) -> str:
        """A save's files are hashed with sha256 (the committed manifest's contract), a snapshot's with xxh3 (those the
        writer process writes; the few this thread writes stay sha256, which a snapshot's manifest accepts too)."""
        return SNAPSHOT_CHECKSUM if self.snapshot else "sha256"

    def busy(self) -> bool:
        return not self._done.is_set()

    def wait(self, quiet: bool = False) -> None:
        """Until it is written and reported; its failure raised (``quiet``, or a snapshot's: said)."""
        self._done.wait()
        if self.error is None:
            return
        if quiet or self.snapshot:
            print(f"raylaunch: the {'snapshot' if self.snapshot else 'checkpoint'} of step {self.step} was not "
                  f"written to {self.target}: {self.error}", file=sys.stderr, flush=True)
            return
        if _out_of_space(self.error, self.target):
            raise _no_space(self.target, self.step, self.error) from self.error
        where = split_query(self.upload_uri)[0] if self.upload_uri else self.target
        raise CheckpointSaveError(f"writing the checkpoint of step {self.step} to {where} failed: {self.error}. "
                                  "The previous committed checkpoint is kept.") from self.error
