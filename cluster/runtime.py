"""The session: the runner's API inside a training function (metrics, checkpoints, preemption). Imports nothing from Ray.

A training function asks for the session and uses three things from it::

    from cluster.runtime import get_session

    session = get_session()
    accelerator = Accelerator(log_with=[session.tracker()])
    ...
    start_step = session.restore(accelerator) or 0   # the latest committed checkpoint
    accelerator.log({"loss": loss}, step=step)       # reaches the driver (Accelerate logs on the main process)
    session.log({"loss": loss}, step=step)           # the same, from every rank
    session.save(accelerator, step)                  # committed once every rank wrote its part

Under the runner these reach the driver and the run directory. Outside it
(plain ``python`` or ``accelerate launch``) the same calls write metrics to
``./raylaunch-local/metrics-rank<R>.jsonl`` and checkpoints to
``./raylaunch-local/checkpoints`` (``RAYLAUNCH_LOCAL_DIR`` moves that folder).
This module is the public face (the names below, kept as they are from release to release); the session is
``cluster.rank.session``'s, saving, uploading and restoring under the runner ``cluster.checkpoint``'s.
"""

from cluster.rank.session import (CheckpointError, CheckpointSaveError, RunnerTracker, Session, WorkerPayload,
                                  get_session)

__all__ = ["CheckpointError", "CheckpointSaveError", "RunnerTracker", "Session", "WorkerPayload", "get_session"]
