"""The runner's API inside a training function. Imports nothing from Ray.

A training function asks for the session and uses three things from it::

    from cluster.runtime import get_session

    session = get_session()
    accelerator = Accelerator(log_with=[session.tracker()])
    ...
    start_step = session.restore(accelerator) or 0   # the latest committed checkpoint
    accelerator.log({"loss": loss}, step=step)       # reaches the driver, from every rank
    session.save(accelerator, step)                  # committed once every rank wrote its part

Under the runner these reach the driver and the run directory. Outside it
(plain ``python`` or ``accelerate launch``) the same calls write metrics to
``./raylaunch-local/metrics-rank<R>.jsonl`` and checkpoints to
``./raylaunch-local/checkpoints`` (``RAYLAUNCH_LOCAL_DIR`` moves that folder).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

from accelerate.tracking import GeneralTracker
from pyarrow import fs as pafs

from cluster.context import RECORD_KEYS, WorkerContext, WorkerPayload
from cluster.files import (
    CheckpointError, describe_files, is_local, join_uri, open_uri, split_query,
)
from cluster.restore import node_verified
from cluster.sharding import Resolved, seed_missing_rng

__all__ = ["CheckpointError", "CheckpointSaveError", "RunnerTracker", "Session", "WorkerPayload", "get_session"]


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
        self._session._emit({"kind": "config", "values": self._session._clean(values, "configuration")})

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        # Accelerate calls this on the main process only; Session.log is per rank.
        self._session.log(values, step)


class Session:
    """This process's link to the runner (or to a local folder outside it)."""

    def __init__(self, payload: WorkerPayload | None, local_dir: Path | None = None) -> None:
        self.payload = payload
        self._local_dir = local_dir
        if payload is not None:
            self._events_path = Path(payload.events_path)
        else:
            assert local_dir is not None
            rank = int(os.environ.get("RANK", "0"))
            self._events_path = local_dir / f"metrics-rank{rank}.jsonl"
        self._events_path.parent.mkdir(parents=True, exist_ok=True)
        self._events = open(self._events_path, "a", buffering=1)
        self._lock = threading.Lock()
        self._cooperative = False  # the function calls preempted()
        self._stop_requested = False  # this rank got SIGTERM
        self._stopped_for_preemption = False  # every rank agreed to stop
        self._upload: _Upload | None = None  # this rank's checkpoint upload in flight
        self._said: set[str] = set()  # what _clean has said about the values (once each)
        self.strategy: Resolved | None = None  # set by the worker (cluster.sharding.install)

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
            "dataloader_config": DataLoaderConfiguration(**opts.get("dataloader", {})),
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
        out = _jsonable(values, notes)
        if what == "metrics":
            for key in [k for k in out if k in RECORD_KEYS]:
                out[f"logged_{key}"] = out.pop(key)
                notes.append(f"'{key}' is a key of every metrics row: stored as 'logged_{key}'")
        for note in dict.fromkeys(notes):
            if note not in self._said:
                self._said.add(note)
                print(f"raylaunch: {what}: {note} (said once)", file=sys.stderr, flush=True)
        return out

    def log(self, values: dict, step: int | None = None) -> None:
        """Metrics of this rank; unlike ``accelerator.log`` this runs on every rank."""
        self._emit({"kind": "metrics", "step": step, "values": self._clean(values, "metrics")})

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

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        import signal

        if not self._cooperative:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        self._stop_requested = True
        self._emit({"kind": "preempt_notice"})

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

        On storage that is not a local path (an object store), training waits
        only for the state to reach local disk: the upload runs in the
        background and the rank reports its part when the upload is done. The
        next ``save`` waits for the previous upload (one in flight at a time),
        and the runner waits for the last one before the function counts as
        finished. Storage that is full fails the save with ``CheckpointSaveError``.
        """
        if self.payload is None:
            target = self._local_dir / "checkpoints" / f"checkpoint-{step:08d}"
            accelerator.save_state(str(target), safe_serialization=True)
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                (self._local_dir / "checkpoints" / "latest").write_text(target.name)
            return str(target)
        uri = join_uri(self.payload.staging_uri, f"checkpoint-{step:08d}")
        fs, path = open_uri(uri)
        if is_local(fs):
            _save_state(accelerator, path, step)
            # Everyone has finished writing before anyone reports: the driver
            # commits on the last report and must see every rank's files.
            accelerator.wait_for_everyone()
            self._emit({"kind": "checkpoint", "step": step, "uri": uri})
            return uri
        self.wait_for_upload()  # training that outruns uploads waits here, not later
        local = tempfile.mkdtemp(prefix=f"raylaunch-ckpt-{step:08d}-")
        try:
            _save_state(accelerator, local, step)
        except BaseException:
            shutil.rmtree(local, ignore_errors=True)
            raise
        self._upload = _Upload(local, uri, step, on_done=lambda files: self._emit(
            {"kind": "checkpoint", "step": step, "uri": uri, "files": files}))
        return uri

    def wait_for_upload(self) -> None:
        """Block until this rank's last checkpoint is uploaded; raise if the upload failed.

        The runner calls it when the training function returns, so a run never
        finishes before its last checkpoint is committed.
        """
        upload, self._upload = self._upload, None
        if upload is not None:
            upload.wait()

    def restore(self, accelerator: Any) -> int | None:
        """Load the latest committed checkpoint into ``accelerator``; its step, or None.

        Accelerate unpickles the RNG, sampler and registered states
        (``weights_only=False``), so nothing is loaded unless it is this run's
        committed checkpoint and every file matches its manifest's sha256; a mismatch
        raises ``CheckpointError``. The ranks of a node verify once between them
        (``cluster.restore``): from an object store the node's downloaded copy is checked
        and loaded; on a shared path the check and the loads are separate reads.
        """
        if self.payload is None:
            latest = self._local_dir / "checkpoints" / "latest"
            if not latest.exists():
                return None
            name = latest.read_text().strip()
            accelerator.load_state(str(self._local_dir / "checkpoints" / name))
            return int(re.sub(r"\D", "", name))
        uri = self.payload.restore_uri
        if uri is None:
            return None
        fs, path = open_uri(uri)
        run = open_uri(self.payload.staging_uri)[1].split("/.staging/")[0]
        if not path.startswith(f"{run}/checkpoints/"):
            raise CheckpointError(f"{uri} is not a committed checkpoint of this run ({run}); refusing to load it")
        # Read and verified (on object storage: downloaded) once per node, in the node's scratch folder.
        ctx = self.payload.context
        with node_verified(uri, Path(self.payload.events_path).parent, ctx.local_world_size) as (ready, manifest):
            accelerator.load_state(ready)
        # Saved by fewer ranks (another world size): this rank's RNGs get a defined state.
        seed_missing_rng(manifest["files"], ctx.world_rank, int(manifest["step"]))
        return int(manifest["step"])

    # --- events --------------------------------------------------------------

    def _emit(self, event: dict) -> None:
        event = {"time": time.time(), **event}
        if self.payload is not None:
            event["rank"] = self.payload.context.world_rank
        with self._lock:
            self._events.write(json.dumps(event) + "\n")
            self._events.flush()


# Caps on what one log call hands the runner: enough for any real metric, and what passes
# them cannot swell metrics.jsonl, the driver's memory or TensorBoard.
MAX_KEYS = 1000
MAX_KEY_CHARS = 200
MAX_TEXT_CHARS = 1000
_FLOAT_MAX = 1.7976931348623157e308


def _cap(v: Any) -> tuple[Any, str | None]:
    """One value as JSON data within the caps, and what was changed (or None)."""
    if hasattr(v, "item") and callable(v.item):  # tensors and numpy scalars
        try:
            v = v.item()
        except (ValueError, RuntimeError):
            pass
    if isinstance(v, bool) or v is None:
        return v, None
    if isinstance(v, int):
        if abs(v) <= 2**63:
            return v, None
        return (_FLOAT_MAX if v > 0 else -_FLOAT_MAX), "integers beyond 2**63 capped to the largest float"
    if isinstance(v, float):
        return v, None  # NaN and infinity stay what they are: they are never drawn as a point
    if isinstance(v, (list, dict)):
        try:
            text = json.dumps(v)
        except (TypeError, ValueError):  # objects inside, or a cycle
            text = repr(v)
        else:
            if len(text) <= MAX_TEXT_CHARS:
                return v, None
        v = text
    elif not isinstance(v, str):
        v = str(v)
    if len(v) > MAX_TEXT_CHARS:
        return v[:MAX_TEXT_CHARS] + "...", f"text longer than {MAX_TEXT_CHARS} characters cut"
    return v, None


def _jsonable(values: dict, notes: list[str]) -> dict:
    out: dict[str, Any] = {}
    if len(values) > MAX_KEYS:
        notes.append(f"more than {MAX_KEYS} keys in one call: the rest dropped")
    for k, v in list(values.items())[:MAX_KEYS]:
        key = str(k)
        if len(key) > MAX_KEY_CHARS:
            key = key[:MAX_KEY_CHARS]
            notes.append(f"names longer than {MAX_KEY_CHARS} characters cut")
        out[key], note = _cap(v)
        if note:
            notes.append(note)
    return out


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written or uploaded; the previous committed one is kept."""


def _save_state(accelerator: Any, path: str, step: int) -> None:
    """``save_state`` with model weights as safetensors; a full disk is said in plain words."""
    try:
        accelerator.save_state(path, safe_serialization=True)
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


_SESSION: Session | None = None


def _install(payload: WorkerPayload) -> Session:
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
