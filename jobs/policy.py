"""The restart rule: after a failed attempt, restart or give up, as a pure function of what happened and the budgets.

The driver asks ``decide`` once per failed attempt. A preempted attempt (a rank ended by
SIGTERM, a spot node's notice, or every rank checkpointed within the grace period and
stopped) restarts without using up ``failure.max_restarts``, up to
``failure.max_preemptions`` times; once those are spent it counts as a failure. A failure
restarts while ``failure.max_restarts`` lasts. Errors that no restart can fix (the cluster
cannot place the job, storage cannot hold it, a checkpoint cannot be committed) end the run
before it gets here.

An elastic run (``scaling.min_nodes`` below ``num_nodes``) also asks here at which world size to
train: ``world_sizes`` lists the sizes it may run at (those where the global batch stays exact,
unless ``scaling.keep_global_batch`` is false), ``fit`` picks the largest the nodes there allow
and says why when it is smaller, and ``grow_to`` says whether nodes that came back are worth a
restart. A resize after a lost node is a failure like any other (``decide``); growing back is not.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Iterable

from cluster.protocol import RankFailure
from jobs.spec import FailureSpec, ScalingSpec

__all__ = ["Action", "Decision", "Failure", "Fit", "WorldSize", "decide", "failure_kind", "fit", "grow_to",
           "resize_note", "world_sizes"]


class Failure(StrEnum):
    """What ended an attempt that did not succeed."""

    PREEMPTED = "preempted"
    FAILED = "failed"


class Action(StrEnum):
    RESTART = "restart"  # from the last committed checkpoint
    GIVE_UP = "give_up"  # the run has failed


@dataclass(frozen=True)
class Decision:
    action: Action
    restarts: int  # restarts used, counting this one
    preemptions: int  # preemptions used, counting this one
    message: str = ""  # what the driver says, when it restarts


def failure_kind(failures: Iterable[RankFailure], lost_nodes: bool) -> Failure:
    """A rank ended by SIGTERM is a preemption (its peers' collective errors, "Connection reset
    by peer", are consequences and may be reported first); unless a node was lost, which is a failure.

    >>> failure_kind([RankFailure(0, -15, "killed by signal SIGTERM", "", "SIGTERM")], lost_nodes=False)
    <Failure.PREEMPTED: 'preempted'>
    """
    preempted = any(f.signal == "SIGTERM" for f in failures)
    return Failure.PREEMPTED if preempted and not lost_nodes else Failure.FAILED


def decide(kind: Failure, attempt: int, restarts: int, preemptions: int, budgets: FailureSpec) -> Decision:
    """Restart or give up after failed attempt number ``attempt``, with ``restarts`` and
    ``preemptions`` used so far.

    >>> decide(Failure.FAILED, 1, 0, 0, FailureSpec(max_restarts=1)).action
    <Action.RESTART: 'restart'>
    >>> decide(Failure.FAILED, 2, 1, 0, FailureSpec(max_restarts=1)).action
    <Action.GIVE_UP: 'give_up'>
    """
    if kind is Failure.PREEMPTED and preemptions < budgets.max_preemptions:
        preemptions += 1
        return Decision(Action.RESTART, restarts, preemptions,
                        f"raylaunch: attempt {attempt} was preempted (SIGTERM); restarting from the last "
                        f"committed checkpoint ({preemptions} of {budgets.max_preemptions} preemptions; "
                        "restarts are not used up)")
    if restarts < budgets.max_restarts:
        restarts += 1
        return Decision(Action.RESTART, restarts, preemptions,
                        f"raylaunch: attempt {attempt} failed; restarting from the last committed "
                        f"checkpoint ({restarts} of {budgets.max_restarts} restarts)")
    return Decision(Action.GIVE_UP, restarts, preemptions)


# --- elastic world size ------------------------------------------------------------


@dataclass(frozen=True)
class WorldSize:
    """One size an elastic run can train at: its nodes, its processes and the gradient
    accumulation that keeps the global batch (per-device batch x world x accumulation)."""

    nodes: int
    world_size: int
    accumulation: int

    def describe(self) -> str:
        return (f"{self.nodes} node{'s' if self.nodes != 1 else ''} (world size {self.world_size}, "
                f"gradient accumulation {self.accumulation})")


def world_sizes(scaling: ScalingSpec, workers_per_node: int, accumulation: int) -> list[WorldSize]:
    """The sizes a run may train at, largest first: ``num_nodes`` down to ``min_nodes``; with
    ``keep_global_batch`` only those where ``num_nodes x accumulation`` divides evenly by the nodes.

    >>> [w.nodes for w in world_sizes(ScalingSpec(num_nodes=4, min_nodes=1), 1, 1)]
    [4, 2, 1]
    >>> world_sizes(ScalingSpec(num_nodes=2, min_nodes=1), 2, 1)[-1]
    WorldSize(nodes=1, world_size=2, accumulation=2)
    >>> [w.nodes for w in world_sizes(ScalingSpec(num_nodes=4, min_nodes=1, keep_global_batch=False), 1, 1)]
    [4, 3, 2, 1]
    """
    total = scaling.num_nodes * accumulation  # the global batch, in per-node micro-batches
    out = []
    for nodes in range(scaling.num_nodes, scaling.elastic_min - 1, -1):
        if not scaling.keep_global_batch:
            out.append(WorldSize(nodes, nodes * workers_per_node, accumulation))
        elif total % nodes == 0:
            out.append(WorldSize(nodes, nodes * workers_per_node, total // nodes))
    return out


@dataclass(frozen=True)
class Fit:
    """The size chosen for the nodes there are (None: fewer than ``min_nodes``), and why it is
    smaller than them, if it is."""

    size: WorldSize | None
    why: str = ""


def fit(sizes: list[WorldSize], available: int) -> Fit:
    """The largest of ``sizes`` that ``available`` nodes can hold.

    >>> sizes = world_sizes(ScalingSpec(num_nodes=4, min_nodes=2), 1, 1)
    >>> f = fit(sizes, 3)
    >>> f.size.nodes, f.why
    (2, '3 nodes are there, but at 3 the global batch of 4 nodes x gradient accumulation 1 is not a whole number of micro-batches per node: running on 2 nodes (world size 2, gradient accumulation 2)')
    >>> fit(sizes, 1)
    Fit(size=None, why='')
    """
    usable = min(available, sizes[0].nodes)
    size = next((s for s in sizes if s.nodes <= usable), None)
    if size is None or size.nodes == usable:
        return Fit(size)
    full = sizes[0]
    return Fit(size, f"{usable} nodes are there, but at {usable} the global batch of {full.nodes} nodes x gradient "
                     f"accumulation {full.accumulation} is not a whole number of micro-batches per node: "
                     f"running on {size.describe()}")


def grow_to(sizes: list[WorldSize], current: WorldSize, available: int) -> WorldSize | None:
    """The larger size that ``available`` nodes allow, or None when there is none.

    >>> sizes = world_sizes(ScalingSpec(num_nodes=2, min_nodes=1), 1, 1)
    >>> grow_to(sizes, sizes[1], 2).nodes, grow_to(sizes, sizes[0], 2), grow_to(sizes, sizes[1], 1)
    (2, None, None)
    """
    size = fit(sizes, available).size
    return size if size is not None and size.nodes > current.nodes else None


def resize_note(old: WorldSize, new: WorldSize, why: str) -> str:
    """What the driver says when the world changes size.

    >>> resize_note(WorldSize(2, 2, 1), WorldSize(1, 1, 2), "node 1 was lost")
    'world size 2 -> 1 (node 1 was lost); gradient accumulation 1 -> 2 keeps the global batch'
    >>> resize_note(WorldSize(3, 3, 1), WorldSize(2, 2, 1), "node 2 was lost")
    'world size 3 -> 2 (node 2 was lost); the global batch changes with it (scaling.keep_global_batch is false)'
    """
    head = f"world size {old.world_size} -> {new.world_size} ({why})"
    if old.nodes * old.accumulation == new.nodes * new.accumulation:
        return f"{head}; gradient accumulation {old.accumulation} -> {new.accumulation} keeps the global batch"
    return f"{head}; the global batch changes with it (scaling.keep_global_batch is false)"
