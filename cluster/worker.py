"""The entry point of one rank process: join the group, then run the user's function."""

from __future__ import annotations

import importlib
import os
from datetime import timedelta
from typing import Any, Callable

from typing import TYPE_CHECKING

from cluster.context import WorkerPayload
from cluster.sharding import install as install_strategy
from cluster.stacks import install_signal_dump, stack_dump_path

if TYPE_CHECKING:
    from cluster import runtime

__all__ = ["check_train_fn", "resolve_train_fn", "run_worker"]


def check_train_fn(path: str) -> None:
    """Check that ``"module:function"`` exists without running any of the user's code.

    The driver calls this before it reserves anything. The module is found on
    ``sys.path`` one package at a time (no package's ``__init__`` runs) and its
    top-level definitions are read from the source; a module without source (an
    extension) is the one case that is imported.
    """
    import ast

    module_name, _, fn_name = path.partition(":")
    spec = _find_source(module_name)
    if spec is None:
        raise _no_module(path, module_name)
    if not spec.origin or not spec.origin.endswith(".py"):
        resolve_train_fn(path)  # no source to read: import it
        return
    try:
        with open(spec.origin, "rb") as f:
            tree = ast.parse(f.read(), spec.origin)
    except SyntaxError as exc:
        raise ImportError(
            f"train_fn {path!r}: {spec.origin} line {exc.lineno}: {type(exc).__name__}: {exc.msg}"
        ) from None
    except (OSError, ValueError) as exc:
        raise ImportError(f"train_fn {path!r}: cannot read {spec.origin}: {exc}") from None
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    if fn_name not in names:
        defs = sorted(n.name for n in tree.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_"))
        raise AttributeError(
            f"train_fn {path!r}: module {module_name!r} ({spec.origin}) has no function {fn_name!r}"
            + (f"; it defines: {', '.join(defs)}" if defs else "")
        )


def _find_source(module_name: str):
    """The module's spec, found like an import would without executing any package.

    A package already imported (the runner's own) is searched where it was loaded from.
    """
    import importlib.machinery
    import sys

    if not module_name or module_name.startswith("."):
        return None
    parts = module_name.split(".")
    search = None  # sys.path
    spec = None
    for i, part in enumerate(parts):
        name = ".".join(parts[: i + 1])
        loaded = sys.modules.get(name)
        if loaded is not None and getattr(loaded, "__spec__", None) is not None:
            spec = loaded.__spec__
        elif i == 0:  # a top-level name: finding it runs nothing (an editable install's finder too)
            import importlib.util

            try:
                spec = importlib.util.find_spec(name)
            except (ImportError, ValueError):
                spec = None
        else:
            try:
                spec = importlib.machinery.PathFinder.find_spec(name, search)
            except (ImportError, ValueError):
                spec = None
        if spec is None:
            return None
        if i < len(parts) - 1:
            search = list(spec.submodule_search_locations or [])
            if not search:
                return None
    return spec


def _no_module(path: str, module_name: str) -> ImportError:
    return ImportError(
        f"train_fn {path!r}: no module named {module_name!r} in the working directory "
        f"({os.getcwd()}) or the installed packages; check the spelling, and run raylaunch from "
        "the folder that holds the module (that folder is what every node gets)"
    )


def resolve_train_fn(path: str) -> Callable[[dict], Any]:
    """Import ``"module:function"``; errors say which part is missing and what to check."""
    module_name, _, fn_name = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name or module_name.startswith(f"{exc.name}."):
            raise _no_module(path, module_name) from None
        raise
    fn = getattr(module, fn_name, None)
    if fn is None or not callable(fn):
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                        and getattr(v, "__module__", None) == module.__name__)
        raise AttributeError(
            f"train_fn {path!r}: module {module_name!r} has no function {fn_name!r}"
            + (f"; it defines: {', '.join(public)}" if public else "")
        )
    return fn


def run_worker(payload: WorkerPayload) -> Any:
    """Runs in each rank process started by the node actor."""
    import os

    from cluster import runtime
    import signal

    import torch
    import torch.distributed as dist

    # The process was spawned with the actor's environment (Ray gives an actor
    # OMP_NUM_THREADS = its CPUs) and torch read it at import, before the
    # rank's own variables were applied: apply the rank's bound now.
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    session = runtime._install(payload)
    # The Accelerate boundary: precision, accumulation and strategy (FSDP, DeepSpeed) as
    # `accelerate launch` exports them, so a plain Accelerator() honours them too.
    session.strategy = install_strategy(payload.accelerate, use_gpu=payload.backend == "nccl",
                                        rank=payload.context.world_rank, world=payload.context.world_size)
    fn = resolve_train_fn(payload.train_fn)
    # We create the process group ourselves, against the store node 0 already
    # holds, so the join has our bound instead of torch's 30 minutes.
    # Accelerate adopts an existing group unchanged.
    _start_heartbeat(payload.events_path + ".beat", session)
    install_signal_dump(stack_dump_path(payload.events_path))  # where this rank is, when asked
    session._emit({"kind": "arrived"})  # at the rendezvous; "joined" once every rank is there
    dist.init_process_group(
        backend=payload.backend,
        timeout=timedelta(seconds=payload.collective_timeout_s),
    )
    session._emit({"kind": "joined", "world_size": dist.get_world_size()})
    signal.signal(signal.SIGTERM, session._on_sigterm)
    result = fn(dict(payload.config))
    # The run is not over before its last checkpoint is: wait for its upload (and
    # fail the rank if it failed) before reporting this rank as done.
    session.wait_for_upload()
    session._emit({"kind": "resources", **peak_memory()})
    if session._stopped_for_preemption:
        session._emit({"kind": "preempted"})
    if dist.is_initialized():
        dist.destroy_process_group()
    session._emit({"kind": "finished"})
    return _storable_return(result, payload.context.world_rank)


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
                session._emit({"kind": "resources", **peak_memory()})
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
