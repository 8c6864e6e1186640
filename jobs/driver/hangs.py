"""What the driver says when a run hangs: where every rank was, grouped, with the full stacks on storage.

The driver calls ``where_ranks_are`` before it stops the ranks of an attempt that hung (a rank
silent for ``timeouts.heartbeat_s``, a collective timeout, a rendezvous that did not complete,
a stop by SIGTERM or Ctrl-C). Reading them is bounded (``cluster.stacks.SAMPLE_TIMEOUT_S`` per
node, all nodes at once); nothing is read while a run goes well.
"""

from __future__ import annotations

import textwrap
import time
from typing import Iterable

from cluster.errors import RaylaunchError
from cluster.nodes.group import NodeGroup
from cluster.protocol import RankFailure, RunStatus
from cluster.stacks import find_stragglers, format_full, group_stacks, stack_from_traceback, where_ranks
from jobs.run.storage import RunDir

__all__ = ["StacksError", "is_hang", "live_stacks", "where_ranks_are"]

# Between two readings of `raylaunch stacks --samples N`.
SAMPLE_INTERVAL_S = 0.5


def is_hang(failures: Iterable[RankFailure]) -> bool:
    """Whether an attempt's failures are a hang (silent rank, collective timeout) rather than a crash."""
    return any(f.cause.is_hang for f in failures)


def where_ranks_are(group: NodeGroup, run_dir: RunDir, attempt: int, failures: Iterable[RankFailure] = ()) -> str:
    """Every rank's stack, grouped (``[ranks 0, 2] in all_reduce (...)``), after a line naming
    ``logs/stacks-<attempt>-<time>.txt``, which holds every thread of every rank. A rank that
    had already failed is shown where its exception was raised."""
    try:
        stacks, flight = group.stacks()
    except Exception as exc:  # a diagnosis must never hide the failure it explains
        return f"where each rank was: not read ({type(exc).__name__}: {exc})"
    by_rank = {s.rank: s for s in stacks}
    for f in failures:
        held = by_rank.get(f.rank)
        if (held is None or held.error is not None) and f.traceback:
            node = held.node_rank if held else next(i for i, rs in enumerate(group.ranks_by_node) if f.rank in rs)
            by_rank[f.rank] = stack_from_traceback(f.rank, node, f.traceback) or held
    stacks = [s for s in (by_rank[r] for r in sorted(by_rank)) if s is not None]
    try:
        where = run_dir.write_stacks(attempt, format_full(stacks), flight)
    except OSError as exc:
        where = f"not written: {exc}"
    return f"where each rank was (every thread: {where}):\n" + textwrap.indent(group_stacks(stacks), "  ")


# --- on demand: `raylaunch stacks` ----------------------------------------------------------

class StacksError(RaylaunchError, RuntimeError):
    """The run's ranks cannot be read; the message says why and what to do."""


def live_stacks(storage: str, name: str, address: str | None = None, full: bool = False, samples: int = 1) -> str:
    """The grouped stacks of a running run, read through its node actors without stopping it.

    ``samples`` > 1 reads every rank that many times, ``SAMPLE_INTERVAL_S`` apart, and names a
    straggler: the rank the others wait for (``cluster.stacks.find_stragglers``).

    The run directory's ``result.json`` records, while the run runs, the Ray address of its
    cluster and the names of its node actors; ``address`` overrides that address (the same
    cluster as seen from here).
    """
    import ray

    from cluster.nodes.group import collect_stacks

    run = RunDir(storage, name)
    result = run.read_result()
    if result is None:
        raise StacksError(f"no run {name!r} in {storage} (see `raylaunch runs --storage {storage}`)")
    live = result.get("live") or {}
    if RunStatus.of(result) is not RunStatus.RUNNING or not live.get("node_actors"):
        raise StacksError(f"run {name!r} is not running (status {result.get('status')}): it has no ranks to read; "
                          f"`raylaunch show {name}` shows how it ended")
    target = address or live["ray_address"]
    unreachable = (f"cannot reach the Ray cluster of run {name!r} at {target}" + "{}: run this on a machine of "
                   "that cluster, or give its address with --address; if the cluster is gone, the run's driver "
                   "ended without recording it")
    _check_reachable(target, unreachable)
    try:
        ray.init(address=target, namespace=live["namespace"], log_to_driver=False, configure_logging=False)
    except Exception as exc:
        raise StacksError(unreachable.format(f" ({exc})")) from None
    try:
        actors = []
        for actor_name in live["node_actors"]:
            try:
                actors.append(ray.get_actor(actor_name, namespace=live["namespace"]))
            except ValueError:  # gone: the attempt ended between reading result.json and now
                actors.append(None)
        if not any(actors):
            raise StacksError(f"run {name!r} has no node actors on {target} any more: its attempt or its driver "
                              "ended (a driver that was killed leaves status running in result.json)")
        ranks = live.get("ranks") or [[] for _ in actors]
        readings = []
        for i in range(max(1, samples)):
            if i:
                time.sleep(SAMPLE_INTERVAL_S)
            readings.append(collect_stacks(actors, ranks)[0])
    finally:
        ray.shutdown()
    stacks = readings[-1]
    head = f"run {name}: attempt {result.get('attempts')}, {len(stacks)} ranks"
    out = f"{head}\n{group_stacks(stacks)}\nwhere they run:\n{textwrap.indent(where_ranks(stacks), '  ')}"
    if samples > 1:
        out += "\n" + find_stragglers(readings)
    return out + (f"\n\n{format_full(stacks)}" if full else "")


def _check_reachable(address: str, message: str, timeout_s: float = 5.0) -> None:
    """Fail at once for a ``host:port`` nobody listens on: ``ray.init`` would wait minutes."""
    import socket

    host, _, port = address.rpartition(":")
    if "://" in address or not port.isdigit():
        return  # auto, ray://...: Ray resolves and reports these itself
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise StacksError(message.format(f" ({exc.strerror or exc})")) from None
