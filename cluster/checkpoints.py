"""One rank's checkpoints: Accelerate's state saved to staging (uploaded in the background on an object
store) and a committed checkpoint checked against its manifest and restored.

Under the runner ``cluster.runtime.Session`` hands ``save``, ``restore`` and
``wait_for_upload`` to a ``StagedCheckpoints``; the driver commits what every rank
staged (``jobs.storage.RunDir.commit_checkpoint``).
Imports nothing from Ray.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from pyarrow import fs as pafs

from cluster.context import WorkerContext
from cluster.errors import RaylaunchError
from cluster.loaderstate import load_loader_states, save_loader_states
from cluster.restore import node_copy, node_verified
from cluster.sharding import init_optimizers_for_load, seed_missing_rng
from cluster.storage_io import CheckpointError, describe_files, is_local, join_uri, open_uri, split_query
from cluster.layout import CHECKPOINTS, SCRIPT_FOLDER, checkpoint_name, run_of_staging

__all__ = ["CheckpointError", "CheckpointSaveError", "ScriptSave", "StagedCheckpoints"]

# Called when this rank's part of the checkpoint of ``step`` is on storage at ``uri``;
# ``files`` ({rel: {size, sha256}}) when it was hashed on local disk before an upload.
OnSaved = Callable[[int, str, "dict[str, dict] | None"], None]


class StagedCheckpoints:
    """Under the runner: save into the attempt's staging folder, restore the committed checkpoint it was given."""

    def __init__(self, staging_uri: str, restore_uri: str | None, on_saved: OnSaved, *,
                 context: WorkerContext, node_dir: str) -> None:
        self.staging_uri, self.restore_uri = staging_uri, restore_uri
        self._context, self._node_dir = context, node_dir  # the ranks of a node verify a restore once
        self._on_saved = on_saved
        self._upload: _Upload | None = None  # this rank's checkpoint upload in flight

    def save(self, accelerator: Any, step: int, script: ScriptSave | None = None) -> str:
        """This rank's part of the checkpoint of ``step``, into staging; ``script``: a script's ``save_state``."""
        uri = join_uri(self.staging_uri, checkpoint_name(step))
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
            self._on_saved(step, uri, None)
            return uri
        self.wait_for_upload()  # training that outruns uploads waits here, not later
        local = tempfile.mkdtemp(prefix=f"raylaunch-ckpt-{step:08d}-")
        try:
            _save_state(accelerator, local, step, safe, kwargs)
            if script is not None:
                script.label(local, accelerator.is_main_process)
                if script.mirror is not None:
                    _mirror(local, script.mirror)  # this rank's files, as it wrote them
        except BaseException:
            shutil.rmtree(local, ignore_errors=True)
            raise
        self._upload = _Upload(local, uri, step, on_done=lambda files: self._on_saved(step, uri, files))
        if script is not None and script.mirror is not None:
            accelerator.wait_for_everyone()  # every rank's files are in the script's folder when save_state returns
        return uri

    def wait_for_upload(self) -> None:
        upload, self._upload = self._upload, None
        if upload is not None:
            upload.wait()

    def _committed(self) -> str | None:
        """The checkpoint to restore, once it is known to be a committed one of this run."""
        uri = self.restore_uri
        if uri is None:
            return None
        path = open_uri(uri)[1]
        run = run_of_staging(open_uri(self.staging_uri)[1])
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
    for root, _, names in os.walk(source):
        dest = Path(target, os.path.relpath(root, source))
        dest.mkdir(parents=True, exist_ok=True)
        for name in names:
            tmp = dest / f".{name}.raylaunch-{os.getpid()}"
            shutil.copyfile(os.path.join(root, name), tmp)
            os.replace(tmp, dest / name)


def _save_state(accelerator: Any, path: str, step: int, safe_serialization: bool = True,
                kwargs: dict | None = None) -> None:
    """``save_state`` (model weights as safetensors unless a script asked otherwise); a full disk is said in plain
    words."""
    try:
        accelerator.save_state(path, safe_serialization=safe_serialization, **(kwargs or {}))
        save_loader_states(accelerator, path)  # each rank's own stream position
    except Exception as exc:
        if not _out_of_space(exc, path):
            raise
        shutil.rmtree(path, ignore_errors=True)  # a part no commit will ever count
        raise CheckpointSaveError(
            f"no space left on the device holding {path}: the checkpoint of step {step} was not written "
            f"({exc}). The previous committed checkpoint is kept; free space there, or set `storage` "
            "(or the node's temporary folder, TMPDIR, for object storage) to a larger volume."
        ) from exc


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


class _Upload:
    """One rank's checkpoint part on its way from local disk to storage, in a thread."""

    def __init__(self, local: str, uri: str, step: int, on_done: Callable[[dict[str, dict]], None]) -> None:
        self.local, self.uri, self.step = local, uri, step
        self.error: BaseException | None = None
        self._on_done = on_done
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"raylaunch-upload-{step}")
        self._thread.start()

    def _run(self) -> None:
        try:
            # Hashed here, on local disk, so the driver's commit reads nothing back from the store.
            files = describe_files(pafs.LocalFileSystem(), self.local)
            fs, path = open_uri(self.uri)
            pafs.copy_files(self.local, path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)
            self._on_done(files)
        except BaseException as exc:  # handed to the training thread by wait()
            self.error = exc
        finally:
            shutil.rmtree(self.local, ignore_errors=True)

    def wait(self) -> None:
        self._thread.join()
        if self.error is not None:
            raise CheckpointSaveError(
                f"uploading the checkpoint of step {self.step} to {split_query(self.uri)[0]} failed: {self.error}. "
                "The previous committed checkpoint is kept."
            ) from self.error


