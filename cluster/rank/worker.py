"""The entry point of one rank process: join the group, then run the user's function."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

from cluster.layout import heartbeat_file, stack_dump_file
from cluster.protocol import Arrived, Joined, Pace, Preempted, Resources, ScriptCall, WorkerPayload
from cluster.rank.exiting import as_python_ends
from cluster.rank.pace import install as install_pace
from cluster.rank.restart_sync import install as install_restart_sync
from cluster.rank.sharding import install as install_strategy
from cluster.rank.trainer import TrainerStopped
from cluster.rank.trainer import install as install_trainer
from cluster.stacks import install_signal_dump
from cluster.train_function import resolve_train_fn

if TYPE_CHECKING:
    from cluster.rank import session as runtime

__all__ = ["peak_memory", "run_worker"]


def run_worker(payload: WorkerPayload) -> Any:
    """Runs in each rank process started by the node actor."""
    import os

    from cluster.rank import session as runtime
    import signal

    import torch
    import torch.distributed as dist

    # The process was spawned with the actor's environment (Ray gives an actor
    # OMP_NUM_THREADS = its CPUs) and torch read it at import, before the
    # rank's own variables were applied: apply the rank's bound now.
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    _train_at_full_priority(payload.context.world_rank)  # first: every thread the rank starts inherits it
    session = runtime.install(payload)
    # The Accelerate boundary: precision, accumulation and strategy (FSDP, DeepSpeed) as
    # `accelerate launch` exports them, so a plain Accelerator() honours them too.
    session.strategy = install_strategy(payload.accelerate, use_gpu=payload.backend == "nccl",
                                        rank=payload.context.world_rank, world=payload.context.world_size)
    script = payload.script
    fn = resolve_train_fn(payload.train_fn) if script is None else None
    # We create the process group ourselves, against the store node 0 already
    # holds, so the join has our bound instead of torch's 30 minutes.
    # Accelerate adopts an existing group unchanged.
    _start_heartbeat(heartbeat_file(payload.events_path), session)
    install_signal_dump(stack_dump_file(payload.events_path))  # where this rank is, when asked
    pace = install_pace(lambda window: session.emit(Pace(**window)))  # data_wait, sync_wait
    session.start_snapshots(pace.meter)  # every few optimizer steps, the state in the node's memory
    install_restart_sync(payload.restore_uri is not None)  # a resume's DDP models: no first broadcast, checked
    session.emit(Arrived(pid=os.getpid()))  # at the rendezvous; "joined" once every rank is there
    dist.init_process_group(
        backend=payload.backend,
        timeout=timedelta(seconds=payload.collective_timeout_s),
    )
    if payload.backend == "gloo":
        # gloo's init returns on a rank once its own connections are made, while another rank's may still be
        # connecting: a rank that then ended at once (a function with no collective of its own, or one that
        # raised) failed the other's init with "Connection closed by peer". Every rank is connected past this.
        dist.barrier()
    session.emit(Joined())
    # Held until the function has returned. Accelerate's end_training() destroys the group while the function's
    # DDP model still holds it: the model's Reducer, freed as the function returns, then held the last reference
    # and destroyed the group holding the GIL, while joining gloo threads that may need the GIL to free a finished
    # collective's tensors (a deadlock: "no heartbeat for 60 s" at the function's return). Dropped below, the
    # group is destroyed by its Python handle, which lets go of the GIL first.
    world_group = dist.group.WORLD
    signal.signal(signal.SIGTERM, session.handle_sigterm)
    # A process the rank forks (a DataLoader worker: ranks start processes by fork, as torchrun's do) does not keep the
    # rank's stop-notice handler: DataLoader's shutdown ends a worker that lingers with SIGTERM, which must end it.
    os.register_at_fork(after_in_child=_default_sigterm)
    # A transformers Trainer the code makes (now or later) commits its checkpoints, logs and stops through the runner.
    install_trainer(session, script)
    with as_python_ends():  # its atexit handlers run and the files it left open are written, as python would
        rank = payload.context.world_rank
        try:
            result = fn(dict(payload.config)) if script is None else _run_script(session, script, rank)
        except (TrainerStopped, runtime.StoppedAtSnapshot):  # every rank agreed to stop and saved (Trainer) or
            if not session.stopped_for_preemption:  # wrote its snapshot: reported as preempted below
                raise
            result = None
        finally:
            session.write_rows()  # the metrics rows it logged, however it ended
    session.flush_metrics()  # rows whose values a thread reads off the GPU
    # The run is not over before its last checkpoint is: wait for its upload (and
    # fail the rank if it failed) before reporting this rank as done.
    session.wait_for_upload()
    pace.report()
    session.emit(Resources(**peak_memory()))
    if session.stopped_for_preemption:
        session.emit(Preempted())
    if dist.is_initialized():
        dist.destroy_process_group()
    del world_group
    return _storable_return(result, payload.context.world_rank)


# The niceness a rank trains at: a process's own, as torchrun's and accelerate launch's ranks have it.
RANK_NICE = 0


def _default_sigterm() -> None:
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _train_at_full_priority(rank: int) -> None:
    """Ray starts its workers at niceness 15 (its ``worker_niceness``, so that the raylet comes first), and a rank
    forked from a node actor, a fork server or a warm host inherited it: the node's every other process (Ray's own
    daemons, a log shipper) then took the cores before the training did, and the checkpoint writer, meant to yield to
    training at niceness 10, came before it. Measured (#58, make bench BENCH_FULL=1, 2026-12-05): the ranks' CPU a
    step was torchrun's (1.008x), their wall clock 1.095x. A rank trains at ``RANK_NICE`` where the process may lower
    its niceness (root, CAP_SYS_NICE or RLIMIT_NICE); where it may not, it says so once and how to start Ray's
    workers at 0 instead."""
    import os
    import sys

    try:
        if os.getpriority(os.PRIO_PROCESS, 0) > RANK_NICE:
            os.setpriority(os.PRIO_PROCESS, 0, RANK_NICE)
    except PermissionError:
        if rank == 0:
            print(f"raylaunch: the ranks train at Ray's worker niceness {os.getpriority(os.PRIO_PROCESS, 0)}, which "
                  "this user may not lower: the node's other processes come first. Start Ray's nodes with "
                  "RAY_worker_niceness=0 in their environment (cluster.yaml's start commands), or allow it "
                  "(ulimit -e, CAP_SYS_NICE)", file=sys.stderr, flush=True)
    except OSError:  # no such call here: leave it as it is
        pass


def _run_script(session: "runtime.Session", call: ScriptCall, rank: int) -> None:
    """The script as ``python SCRIPT args`` runs it, with Accelerate's log, save_state and load_state reaching
    the runner; on a resume its arguments get the resume flag and a folder holding the latest checkpoint."""
    from cluster.rank.script import ScriptHooks, run_script, script_argv

    hooks = ScriptHooks(session, call, rank)
    hooks.install()
    session.snapshot_script(hooks.inside)  # written as its save_state writes, named as it names its folders
    resume = None
    if call.resume_arg is None:
        if session.payload.restore_uri is not None:
            hooks.say_once(f"resume_arg is null: {call.path} starts from the beginning although a committed "
                           "checkpoint exists")
    elif (resume := session.resume_folder()) is not None:
        hooks.resumed_from(*resume)
        hooks.say_once(f"resuming: {call.path} gets {call.resume_arg} {resume[0]} (the checkpoint of step "
                       f"{resume[1]['step']})")
    run_script(call, script_argv(call, resume[0] if resume else None))


# A return value lands in result.json; past this it is cut (a model or a dataset returned by mistake).
MAX_RETURN_CHARS = 1_000_000


def _storable_return(value: Any, rank: int) -> Any:
    """The return value as JSON data: what is not (an object, a lock, a cycle) is kept as its
    repr, and said on the rank's log, instead of failing the rank's exit with no exception."""
    import json
    import sys

    notes: list[str] = []
    out = _plain(value, set(), notes, 0)
    text = json.dumps(out)
    if len(text) > MAX_RETURN_CHARS:
        notes.append(f"the whole value is {len(text):,} characters as JSON, over {MAX_RETURN_CHARS:,}: "
                     "kept as its first characters")
        out = {"truncated": text[:MAX_RETURN_CHARS]}
    if notes:
        print(f"raylaunch: rank {rank}'s return value is not all JSON data; stored with "
              + "; ".join(notes[:5]) + (f" (and {len(notes) - 5} more)" if len(notes) > 5 else ""),
              file=sys.stderr, flush=True)
    return out


def _plain(value: Any, seen: frozenset[int] | set[int], notes: list[str], depth: int) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # a numpy or torch scalar
        return _plain(value.item(), seen, notes, depth)
    if isinstance(value, (dict, list, tuple)):
        if id(value) in seen:
            notes.append("a reference to itself (a cycle) as '<cycle>'")
            return "<cycle>"
        if depth >= 32:
            notes.append("nesting deeper than 32 levels as '<too deep>'")
            return "<too deep>"
        seen = seen | {id(value)}
        if isinstance(value, dict):
            return {str(k): _plain(v, seen, notes, depth + 1) for k, v in value.items()}
        return [_plain(v, seen, notes, depth + 1) for v in value]
    notes.append(f"a {type(value).__name__} as its repr")
    try:
        text = repr(value)
    except Exception:  # a repr that fails is the user's bug; the rank's result is not
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 1000 else text[:997] + "..."


def _start_heartbeat(path: str, session: runtime.Session, every_s: float = 0.5, resources_every_s: float = 5.0) -> None:
    """Touch ``path`` while this process runs; a stopped or frozen process stops touching it.

    Every ``resources_every_s`` it also reports this rank's peak memory
    (resident, and the GPU's where one is in use), which the driver puts
    beside the rank's metrics.
    """
    import os
    import threading
    import time

    open(path, "a").close()

    def beat() -> None:
        last_report = time.monotonic()
        while True:
            os.utime(path)
            if time.monotonic() - last_report >= resources_every_s:
                session.emit(Resources(**peak_memory()))
                last_report = time.monotonic()
            time.sleep(every_s)

    threading.Thread(target=beat, daemon=True, name="raylaunch-heartbeat").start()


def peak_memory() -> dict[str, float]:
    """This process's peak resident memory, and peak GPU memory where CUDA is in use, in MiB."""
    import resource

    import torch

    out = {"peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["peak_gpu_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return out
