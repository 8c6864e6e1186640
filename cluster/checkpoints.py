"""One rank's checkpoints: Accelerate's state saved to staging (uploaded in the background on an object
store) and a committed checkpoint checked against its manifest and restored.

Under the runner ``cluster.runtime.Session`` hands ``save``, ``restore`` and
``wait_for_upload`` to a ``StagedCheckpoints``; the driver commits what every rank
staged (``jobs.storage.RunDir.commit_checkpoint``).
Imports nothing from Ray.
"""

from __future__ import annotations

import errno
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable

from pyarrow import fs as pafs

from cluster.context import WorkerContext
from cluster.errors import RaylaunchError
from cluster.loaderstate import load_loader_states, save_loader_states
from cluster.restore import node_verified
from cluster.sharding import init_optimizers_for_load, seed_missing_rng
from cluster.storage_io import CheckpointError, describe_files, is_local, join_uri, open_uri, split_query
from cluster.layout import CHECKPOINTS, checkpoint_name, run_of_staging

__all__ = ["CheckpointError", "CheckpointSaveError", "StagedCheckpoints"]

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

    def save(self, accelerator: Any, step: int) -> str:
        uri = join_uri(self.staging_uri, checkpoint_name(step))
        fs, path = open_uri(uri)
        if is_local(fs):
            _save_state(accelerator, path, step)
            # Everyone has finished writing before anyone reports: the driver
            # commits on the last report and must see every rank's files.
            accelerator.wait_for_everyone()
            self._on_saved(step, uri, None)
            return uri
        self.wait_for_upload()  # training that outruns uploads waits here, not later
        local = tempfile.mkdtemp(prefix=f"raylaunch-ckpt-{step:08d}-")
        try:
            _save_state(accelerator, local, step)
        except BaseException:
            shutil.rmtree(local, ignore_errors=True)
            raise
        self._upload = _Upload(local, uri, step, on_done=lambda files: self._on_saved(step, uri, files))
        return uri

    def wait_for_upload(self) -> None:
        upload, self._upload = self._upload, None
        if upload is not None:
            upload.wait()

    def restore(self, accelerator: Any) -> int | None:
        uri = self.restore_uri
        if uri is None:
            return None
        fs, path = open_uri(uri)
        run = run_of_staging(open_uri(self.staging_uri)[1])
        if not path.startswith(f"{run}/{CHECKPOINTS}/"):
            raise CheckpointError(f"{uri} is not a committed checkpoint of this run ({run}); refusing to load it")
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


def _save_state(accelerator: Any, path: str, step: int) -> None:
    """``save_state`` with model weights as safetensors; a full disk is said in plain words."""
    try:
        accelerator.save_state(path, safe_serialization=True)
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


