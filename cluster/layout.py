"""The names of things on storage and on a node: the one place that spells them.

A run directory (``jobs.run.storage.RunDir`` reads and writes it) holds committed
checkpoints under ``checkpoints/checkpoint-<step>`` and an attempt's checkpoints
being written under ``.staging/attempt-<N>/checkpoint-<step>``; a rank of that
attempt writes there, and a rank checks that what it restores lies under
``checkpoints/`` of the same run. On a node, the actor's scratch folder holds one
``attempt-<N>/`` folder a attempt with each rank's events, heartbeat and stack-dump
files. Both ``cluster/`` and ``jobs/`` import these; nothing here touches a file.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "CHECKPOINTS", "LATEST", "LOCAL_LATEST", "LOGS", "MANIFEST", "MARKER", "METRICS", "RESULT", "RESUME", "RUN_EVENTS",
    "SCRIPT_FOLDER", "SPEC", "STAGING", "TENSORBOARD", "attempt_dir", "checkpoint_name", "checkpoint_step",
    "events_file", "flight_recorder_log", "flight_recorder_prefix", "heartbeat_file", "is_checkpoint_name",
    "rank_log_file", "rank_part_file", "ranks_lacking", "run_of_staging", "stack_dump_file", "stacks_file", "staging_dir",
]

# --- the run directory's own files (``jobs.run.storage.RunDir`` writes them) ------------------

# The resolved spec that ran; its presence makes a folder a run (``raylaunch runs``).
SPEC = "spec.yaml"
# Status, attempts, world size, last step and metrics, checkpoints, times, error.
RESULT = "result.json"
# One JSON object a line (on an object store continued in ``metrics.jsonl.000001``, ...).
METRICS = "metrics.jsonl"
# Each rank's output, stacks of a hang and NCCL Flight Recorder dumps.
LOGS = "logs"
# TensorBoard event files the driver writes.
TENSORBOARD = "tensorboard"
# Written by the driver at start; every node must read it back (shared storage check).
MARKER = ".marker"
# The run's own events (jobs/run/events.py), every command that drove it: the goodput ledger's books.
RUN_EVENTS = "events.jsonl"

# Committed checkpoints, under the run directory.
CHECKPOINTS = "checkpoints"
# Written last into a checkpoint: every file with its size and sha256; its presence is the commit.
MANIFEST = "manifest.json"
# In ``checkpoints/``: names the newest committed checkpoint.
LATEST = "latest.json"
# Checkpoints being written, under the run directory; never loaded, cleared at the next start.
STAGING = ".staging"
# In a checkpoint a script saved: the name of the folder it gave ``save_state`` (``{"folder": "step_30"}``).
SCRIPT_FOLDER = "raylaunch-script.json"
# In a node's scratch folder: the committed checkpoint copied for a script's resume flag.
RESUME = "resume"
# Outside the runner (plain ``python``, ``accelerate launch``), in the function's own local
# ``checkpoints/`` folder: a text file naming the newest checkpoint folder.
LOCAL_LATEST = "latest"

_NCCL_TRACE = "nccl-trace-"

_CHECKPOINT_PREFIX = "checkpoint-"


def checkpoint_name(step: int) -> str:
    """A committed or staged checkpoint's folder name.

    >>> checkpoint_name(20)
    'checkpoint-00000020'
    """
    return f"{_CHECKPOINT_PREFIX}{step:08d}"


def is_checkpoint_name(name: str) -> bool:
    return name.startswith(_CHECKPOINT_PREFIX)


def checkpoint_step(name: str) -> int:
    """The step a checkpoint's folder name holds.

    >>> checkpoint_step('checkpoint-00000020')
    20
    """
    return int(name[len(_CHECKPOINT_PREFIX):])


def attempt_dir(attempt: int) -> str:
    """An attempt's folder, in ``.staging/`` and in a node's scratch folder."""
    return f"attempt-{attempt}"


def staging_dir(attempt: int) -> str:
    """An attempt's staging folder, relative to the run directory."""
    return f"{STAGING}/{attempt_dir(attempt)}"


def run_of_staging(staging_path: str) -> str:
    """The run directory's path, from the path of one of its staging folders.

    >>> run_of_staging('/runs/r1/.staging/attempt-2')
    '/runs/r1'
    """
    return staging_path.split(f"/{STAGING}/")[0]


def rank_part_file(rank: int) -> str:
    """The file every rank writes into a checkpoint (Accelerate's RNG states): its part is there."""
    return f"random_states_{rank}.pkl"


# A transformers Trainer's checkpoint-<n> (``cluster.rank.trainer``): its state file, and each rank's RNG states.
TRAINER_STATE = "trainer_state.json"


def ranks_lacking(files: Iterable[str], world_size: int) -> list[int]:
    """The ranks whose part a checkpoint's files lack: Accelerate's ``random_states_<rank>.pkl``, or in a Trainer's
    checkpoint its ``rng_state_<rank>.pth`` (``rng_state.pth`` in a world of one; none at all when Trainer saved the
    model only, ``save_only_model``).

    >>> ranks_lacking(["random_states_0.pkl"], 2), ranks_lacking(["trainer_state.json", "rng_state_1.pth"], 2)
    ([1], [0])
    >>> ranks_lacking(["trainer_state.json", "rng_state.pth"], 1), ranks_lacking(["trainer_state.json"], 2)
    ([], [])
    """
    names = set(files)
    if TRAINER_STATE not in names:
        return [r for r in range(world_size) if rank_part_file(r) not in names]
    if not any(n.startswith("rng_state") for n in names):
        return []
    if world_size == 1 and "rng_state.pth" in names:
        return []
    return [r for r in range(world_size) if f"rng_state_{r}.pth" not in names]


def rank_log_file(rank: int) -> str:
    """A rank's output, relative to the run directory."""
    return f"{LOGS}/rank-{rank}.log"


def stacks_file(attempt: int, stamp: str) -> str:
    """Every rank's threads when a hang was detected, relative to the run directory."""
    return f"{LOGS}/stacks-{attempt}-{stamp}.txt"


def flight_recorder_log(attempt: int, stamp: str, rank: int) -> str:
    """A rank's NCCL Flight Recorder dump kept beside ``stacks_file(attempt, stamp)``.

    >>> flight_recorder_log(2, '20250101-120000', 3)
    'logs/nccl-trace-2-20250101-120000-rank3'
    """
    return f"{LOGS}/{_NCCL_TRACE}{attempt}-{stamp}-rank{rank}"


# --- on a node: in the node actor's scratch folder ------------------------------------------


def events_file(scratch: str, attempt: int, rank: int) -> str:
    """The rank's events (one JSON object a line), which its node actor tails."""
    return f"{scratch}/{attempt_dir(attempt)}/events-rank{rank}.jsonl"


def heartbeat_file(events_path: str) -> str:
    """Touched by the rank twice a second; its age tells the driver the rank still runs."""
    return events_path + ".beat"


def stack_dump_file(events_path: str) -> str:
    """Where the rank's faulthandler writes every thread's stack when asked (``cluster.stacks``)."""
    return events_path + ".stacks"


def flight_recorder_prefix(scratch: str, attempt: int) -> str:
    """NCCL Flight Recorder dumps of the attempt's ranks on a GPU node: ``<prefix><rank>``."""
    return f"{scratch}/{attempt_dir(attempt)}/{_NCCL_TRACE}rank"
