"""The restart rule: after a failed attempt, restart or give up, as a pure function of what happened and the budgets.

The driver asks ``next_step`` once per attempt, which asks ``decide`` once per failed one; how an
attempt ended is ``attempt_ended``'s. A preempted attempt (a rank ended by SIGTERM, a spot node's
notice, or every rank checkpointed within the grace period and stopped) restarts without using up ``failure.max_restarts``, up to
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

from cluster.protocol import RankFailure, RunStatus
from jobs.run.events import Outcome
from jobs.spec import FailureSpec, ScalingSpec

__all__ = ["Action", "AttemptOutcome", "Decision", "Fit", "Step", "WorldSize", "attempt_ended", "decide", "fit",
           "grow_to", "next_step", "resize_note", "resize_reason", "world_sizes"]

# Growing back, the least time to wait for all the nodes seen (released bundles free up within moments).
GROW_SETTLE_S = 10.0
# The reason a resize records when the run grows back.
GREW = "nodes came back"


class Action(StrEnum):
    """What the driver does after an attempt; every transition is ``next_step``'s (``decide`` answers RESTART or
    GIVE_UP for a failed one):

    - RESERVE: reserve nodes anew (``jobs.driver.preflight``), then start an attempt: the first attempt, after
      nodes were lost (on the nodes there are, or that come), or to grow back onto more nodes at a committed
      checkpoint;
    - RESTART: a failure or a preemption within the budgets, no node lost: an attempt on the same nodes;
    - FINISH: every rank returned: the run succeeded;
    - GIVE_UP: the budgets are spent: the run failed.

    Ctrl-C, SIGTERM and errors no restart can fix end the run from outside this rule (raised, not decided here).
    """

    RESERVE = "reserve"
    RESTART = "restart"
    FINISH = "finish"
    GIVE_UP = "give_up"

    @property
    def status(self) -> RunStatus | None:
        """The run's status when this action ends the run; None when another attempt follows.

        >>> Action.FINISH.status, Action.RESTART.status
        (<RunStatus.SUCCEEDED: 'succeeded'>, None)
        """
        return {Action.FINISH: RunStatus.SUCCEEDED, Action.GIVE_UP: RunStatus.FAILED}.get(self)


@dataclass(frozen=True)
class Decision:
    action: Action  # RESTART or GIVE_UP
    restarts: int  # restarts used, counting this one
    preemptions: int  # preemptions used, counting this one
    message: str = ""  # what the driver says, when it restarts


def attempt_ended(failures: Iterable[RankFailure], lost_nodes: bool, preempted: bool = False) -> Outcome:
    """How an attempt ended, from its ranks' failures: the one place a preemption is decided. With no failure it
    succeeded, unless its ranks checkpointed within a stop notice's grace period and returned (``preempted``). A
    rank ended by SIGTERM is a preemption (its peers' collective errors, "Connection reset by peer", are
    consequences and may be reported first); unless a node was lost, which is a failure.

    >>> attempt_ended([RankFailure.killed(0, -15, "SIGTERM")], lost_nodes=False)
    <Outcome.PREEMPTED: 'preempted'>
    >>> attempt_ended([], lost_nodes=False, preempted=True), attempt_ended([], lost_nodes=False)
    (<Outcome.PREEMPTED: 'preempted'>, <Outcome.SUCCEEDED: 'succeeded'>)
    """
    failures = list(failures)
    if not failures:
        return Outcome.PREEMPTED if preempted else Outcome.SUCCEEDED
    return Outcome.PREEMPTED if any(f.preempted for f in failures) and not lost_nodes else Outcome.FAILED


def decide(kind: Outcome, attempt: int, restarts: int, preemptions: int, budgets: FailureSpec) -> Decision:
    """Restart or give up after attempt number ``attempt`` ended ``kind`` (FAILED or PREEMPTED), with
    ``restarts`` and ``preemptions`` used so far.

    >>> decide(Outcome.FAILED, 1, 0, 0, FailureSpec(max_restarts=1)).action
    <Action.RESTART: 'restart'>
    >>> decide(Outcome.FAILED, 2, 1, 0, FailureSpec(max_restarts=1)).action
    <Action.GIVE_UP: 'give_up'>
    """
    if kind is Outcome.PREEMPTED and preemptions < budgets.max_preemptions:
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


# --- after an attempt ----------------------------------------------------------------


@dataclass(frozen=True)
class AttemptOutcome:
    """How one attempt ended, as the driver saw it (``jobs.driver.attempt``): ``ended`` is what ``events.jsonl``
    records (SUCCEEDED, FAILED, PREEMPTED or GROW; a stopped run never reaches the policy)."""

    ended: Outcome
    error: str | None = None
    lost_nodes: tuple[int, ...] = ()
    grow: "WorldSize | None" = None  # GROW: stopped at a committed checkpoint to grow back to this size

    @property
    def ok(self) -> bool:
        return self.ended is Outcome.SUCCEEDED


@dataclass(frozen=True)
class Step:
    """What the driver does after an attempt, and what that takes."""

    action: Action
    restarts: int  # restarts used, counting this one
    preemptions: int  # preemptions used, counting this one
    wait_full_s: float = 0.0  # an elastic run's next reservation waits this long for all of num_nodes
    resize_why: str = ""  # why the next reservation may change the world size
    grew: bool = False  # it stopped to grow back onto more nodes
    message: str = ""  # what the driver says (a restart)


def next_step(outcome: AttemptOutcome, attempt: int, restarts: int, preemptions: int, budgets: FailureSpec,
              resize_s: float) -> Step:
    """What the driver does after attempt number ``attempt``, from how it ended and the budgets left: a pure
    function (``tests/test_policy.py`` has a row for every case).

    >>> next_step(AttemptOutcome(Outcome.FAILED, lost_nodes=(1,)), 1, 0, 0, FailureSpec(max_restarts=1), 30.0).action
    <Action.RESERVE: 'reserve'>
    """
    if outcome.ok:
        return Step(Action.FINISH, restarts, preemptions)
    if outcome.ended is Outcome.GROW:
        # Nodes came back and a checkpoint was committed since: no failure, no budget used; wait long enough for
        # the nodes this run just released to show as free.
        return Step(Action.RESERVE, restarts, preemptions, wait_full_s=max(resize_s, GROW_SETTLE_S),
                    resize_why=GREW, grew=True)
    lost = outcome.lost_nodes
    why = (f"node{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} lost") if lost else "a failure"
    decision = decide(outcome.ended, attempt, restarts, preemptions, budgets)
    if decision.action is Action.GIVE_UP:
        return Step(Action.GIVE_UP, decision.restarts, decision.preemptions)
    # A lost node's bundle is gone with it: reserve anew, on the nodes that are left or that the cluster adds.
    return Step(Action.RESERVE if lost else Action.RESTART, decision.restarts, decision.preemptions,
                wait_full_s=resize_s, resize_why=why, message=decision.message)


def resize_reason(step: Step, old_nodes: int, new_nodes: int) -> str:
    """Why the world size changed after ``step``: its reason, unless the run meant to grow and got fewer nodes.

    >>> grow = Step(Action.RESERVE, 0, 0, resize_why=GREW, grew=True)
    >>> resize_reason(grow, 2, 1), resize_reason(grow, 1, 2)
    ('nodes left while it grew back', 'nodes came back')
    """
    return "nodes left while it grew back" if step.grew and new_nodes < old_nodes else step.resize_why


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
