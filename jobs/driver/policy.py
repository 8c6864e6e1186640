"""The restart rule: after a failed attempt, restart or give up, as a pure function of what happened and the budgets.

The driver asks ``next_step`` once per attempt, which asks ``decide`` once per failed one; how an
attempt ended is ``attempt_ended``'s, and whose fault a failure was is ``blame``'s. A preempted attempt (a rank
ended by SIGTERM, a spot node's notice, or every rank checkpointed within the grace period and stopped) restarts
without using up ``failure.max_restarts``, up to ``failure.max_preemptions`` times. A failure outside the training
code (a node lost, a rank killed by a signal from outside, a rank stopped or frozen) restarts the same way, up to
``failure.max_infra_restarts`` times. A failure of the code (an exception, an exit code it chose, a crash, a
collective that timed out, ranks that never joined), and any failure once its own budget is spent, restarts only
while ``failure.max_restarts`` lasts: 0 unless asked, so a bug never loops. Errors that no restart can fix (the
cluster cannot place the job, storage cannot hold it, a checkpoint cannot be committed) end the run before it
gets here.

An elastic run (``scaling.min_nodes`` below ``num_nodes``) also asks here at which world size to
train: ``world_sizes`` lists the sizes it may run at (those where the global batch stays exact,
unless ``scaling.keep_global_batch`` is false), ``fit`` picks the largest the nodes there allow
and says why when it is smaller, and ``grow_to`` says whether nodes that came back are worth a
restart. A resize after a lost node is a failure like any other (``decide``); growing back is not.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Iterable

from cluster.protocol import FailureCause, RankFailure, RunStatus
from jobs.run.events import Outcome
from jobs.spec import FailureSpec, ScalingSpec

__all__ = ["Action", "AttemptOutcome", "Decision", "Fault", "Fit", "Step", "WorldSize", "attempt_ended", "blame",
           "decide", "fit", "grow_to", "next_step", "resize_note", "resize_reason", "resumes_from", "world_sizes"]

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


class Fault(StrEnum):
    """Whose fault a failed attempt was (``blame``): which budget a restart uses."""

    # The training code's: an exception, an exit code it chose, a crash (a signal its own execution raised), a
    # collective that outlived its timeout (mismatched collectives hang the same way every time), ranks that never
    # joined. The same code from the same checkpoint most likely fails the same way: restarted only while
    # failure.max_restarts lasts (0 unless asked).
    CODE = "code"
    # Not the code's: a node lost, a rank killed by a signal from outside (the OOM killer's SIGKILL, a person's, a
    # scheduler's), a rank stopped or frozen (no heartbeat: the heartbeat is a thread of its own, so only a process
    # that does not run at all, or a host that does not, misses it). Restarted within failure.max_infra_restarts.
    INFRA = "infra"


# Signals a process's own execution raises: a crash of the code or of a library it called (a segfault, an abort
# from a failed assertion, a bus error from a too small /dev/shm), never a kill from outside.
CRASH_SIGNALS = frozenset(-s for s in (signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGABRT,
                                       signal.SIGTRAP, signal.SIGSYS))
_INFRA_CAUSES = (FailureCause.SIGNAL, FailureCause.SILENT, FailureCause.NODE_LOST)


def blame(failures: Iterable[RankFailure], lost_nodes: bool) -> Fault:
    """Whose fault a failed attempt was, from its ranks' failures' causes (never their text): the infrastructure's
    when a node was lost, or when every failure that is not a mere consequence (a collective whose peer went away)
    is a kill from outside, a silent rank or a lost node; the code's otherwise, also when only consequences were
    seen (a rank that returned early leaves its peers' collectives without a peer).

    >>> killed = RankFailure.killed(1, -9, "SIGKILL")
    >>> reset = RankFailure.raised(0, 1, "gloo: Connection reset by peer", "")
    >>> blame([reset, killed], lost_nodes=False), blame([reset], lost_nodes=False)
    (<Fault.INFRA: 'infra'>, <Fault.CODE: 'code'>)
    >>> blame([RankFailure.killed(1, -11, "SIGSEGV")], lost_nodes=False)
    <Fault.CODE: 'code'>
    """
    if lost_nodes:
        return Fault.INFRA
    causes = [f for f in failures if f.cause is not FailureCause.PEER_LOST]
    infra = causes and all(f.cause in _INFRA_CAUSES and f.exitcode not in CRASH_SIGNALS for f in causes)
    return Fault.INFRA if infra else Fault.CODE


def resumes_from(step: int | None, memory: bool = False) -> str:
    """What a restart resumes from, said: the committed checkpoint's step, a snapshot's in memory, or that there is
    none.

    >>> resumes_from(10), resumes_from(48, memory=True), resumes_from(None)
    ('from checkpoint 10', 'from the snapshot of step 48 in memory', 'from the beginning: nothing was committed')
    """
    if memory and step is not None:
        return f"from the snapshot of step {step} in memory"
    return f"from checkpoint {step}" if step is not None else "from the beginning: nothing was committed"


@dataclass(frozen=True)
class Decision:
    action: Action  # RESTART or GIVE_UP
    restarts: int  # restarts after a failure, of either budget, counting this one
    preemptions: int  # preemptions used, counting this one
    infra_restarts: int = 0  # of the restarts, those failure.max_infra_restarts allowed, counting this one
    said: str = ""  # RESTART: how the attempt ended ("attempt 3 failed"); GIVE_UP: why it is not restarted
    budget: str = ""  # RESTART: the budget it used ("1 of 2 restarts")

    def line(self, resume_step: int | None = None, memory: bool = False) -> str:
        """What the driver says: the restart, from the checkpoint ``resume_step`` (None: nothing committed; a
        snapshot's in memory with ``memory``), or why the run is not restarted.

        >>> decide(Outcome.FAILED, 1, 0, 0, FailureSpec(max_restarts=1)).line(10)
        'raylaunch: attempt 1 failed; restarting from checkpoint 10 (1 of 1 restarts)'
        """
        if self.action is Action.GIVE_UP:
            return f"raylaunch: {self.said}" if self.said else ""
        return f"raylaunch: {self.said}; restarting {resumes_from(resume_step, memory)} ({self.budget})"


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


# How to ask for restarts after a failure of the code: the spec's key, the command line's, accelerate launch's.
_ASK_RESTARTS = ("set failure.max_restarts to restart from the last committed checkpoint after it "
                "(--set failure.max_restarts=2; raylaunch launch also takes accelerate launch's --max_restarts 2)")


def decide(kind: Outcome, attempt: int, restarts: int, preemptions: int, budgets: FailureSpec,
           fault: Fault = Fault.CODE, infra_restarts: int = 0) -> Decision:
    """Restart or give up after attempt number ``attempt`` ended ``kind`` (FAILED or PREEMPTED) by ``fault``'s
    doing, with ``restarts`` (after failures, ``infra_restarts`` of them within ``failure.max_infra_restarts``) and
    ``preemptions`` used so far.

    >>> decide(Outcome.FAILED, 1, 0, 0, FailureSpec(max_restarts=1)).action
    <Action.RESTART: 'restart'>
    >>> decide(Outcome.FAILED, 2, 1, 0, FailureSpec(max_restarts=1)).action
    <Action.GIVE_UP: 'give_up'>
    >>> decide(Outcome.FAILED, 1, 0, 0, FailureSpec(), Fault.INFRA).line(None)
    'raylaunch: attempt 1 failed outside the training code; restarting from the beginning: nothing was committed (1 of 3 infrastructure restarts: failure.max_infra_restarts)'
    """
    b = budgets
    code_restarts = restarts - infra_restarts  # what failure.max_restarts allowed
    if kind is Outcome.PREEMPTED and preemptions < b.max_preemptions:
        return Decision(Action.RESTART, restarts, preemptions + 1, infra_restarts,
                        f"attempt {attempt} was preempted (SIGTERM)",
                        f"{preemptions + 1} of {b.max_preemptions} preemptions; restarts are not used up")
    if kind is Outcome.FAILED and fault is Fault.INFRA and infra_restarts < b.max_infra_restarts:
        return Decision(Action.RESTART, restarts + 1, preemptions, infra_restarts + 1,
                        f"attempt {attempt} failed outside the training code",
                        f"{infra_restarts + 1} of {b.max_infra_restarts} infrastructure restarts: "
                        "failure.max_infra_restarts")
    if code_restarts < b.max_restarts:
        return Decision(Action.RESTART, restarts + 1, preemptions, infra_restarts, f"attempt {attempt} failed",
                        f"{code_restarts + 1} of {b.max_restarts} restarts")
    # Why not: the budgets this failure could use, spent; or a failure of the code, none asked for.
    if kind is Outcome.PREEMPTED:
        spent = f"the {b.max_preemptions} preemptions of failure.max_preemptions"
        key = "failure.max_preemptions"
    elif fault is Fault.INFRA:
        spent = f"the {b.max_infra_restarts} infrastructure restarts of failure.max_infra_restarts"
        key = "failure.max_infra_restarts"
    else:
        spent, key = "", "failure.max_restarts"
    if not spent and b.max_restarts == 0:
        said = ("not restarted: the training code failed (an exception, an exit code it chose, a crash or a "
                "collective that timed out), and restarting the same code from the same checkpoint most likely "
                f"fails the same way; {_ASK_RESTARTS}")
    else:
        used = f"{spent} and " if spent else ""
        said = (f"not restarted: {used}the {b.max_restarts} restarts of failure.max_restarts are used up; raise "
                f"{key if spent else 'it'} to allow more (--set {key}=N)")
    return Decision(Action.GIVE_UP, restarts, preemptions, infra_restarts, said)


# --- after an attempt ----------------------------------------------------------------


@dataclass(frozen=True)
class AttemptOutcome:
    """How one attempt ended, as the driver saw it (``jobs.driver.attempt``): ``ended`` is what ``events.jsonl``
    records (SUCCEEDED, FAILED, PREEMPTED or GROW; a stopped run never reaches the policy); ``fault``, whose fault
    a failure was (``blame``; a lost node is the infrastructure's whatever it says)."""

    ended: Outcome
    error: str | None = None
    lost_nodes: tuple[int, ...] = ()
    grow: "WorldSize | None" = None  # GROW: stopped at a committed checkpoint to grow back to this size
    fault: Fault = Fault.CODE
    said: bool = False  # the error was printed in full when the attempt ended
    # node ranks Ray is draining (the next attempt needs other nodes) -> each one's deadline (Unix time; 0: none named)
    drained: dict[int, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.ended is Outcome.SUCCEEDED


@dataclass(frozen=True)
class Step:
    """What the driver does after an attempt, and what that takes."""

    action: Action
    restarts: int  # restarts after a failure, of either budget, counting this one
    preemptions: int  # preemptions used, counting this one
    wait_full_s: float = 0.0  # an elastic run's next reservation waits this long for all of num_nodes
    resize_why: str = ""  # why the next reservation may change the world size
    grew: bool = False  # it stopped to grow back onto more nodes
    infra_restarts: int = 0  # of the restarts, those failure.max_infra_restarts allowed, counting this one
    decision: Decision | None = None  # after a failure or a preemption: restart or give up, and what to say

    def line(self, resume_step: int | None = None, memory: bool = False) -> str:
        """What the driver says of this step (``Decision.line``): a restart, from the checkpoint ``resume_step`` (a
        snapshot's in memory with ``memory``), or why the run is not restarted; "" for a step that says nothing
        (finished, grown back)."""
        return self.decision.line(resume_step, memory) if self.decision is not None else ""


def next_step(outcome: AttemptOutcome, attempt: int, restarts: int, preemptions: int, budgets: FailureSpec,
              resize_s: float, infra_restarts: int = 0) -> Step:
    """What the driver does after attempt number ``attempt``, from how it ended and the budgets left: a pure
    function (``tests/test_policy.py`` has a row for every case).

    >>> next_step(AttemptOutcome(Outcome.FAILED, lost_nodes=(1,)), 1, 0, 0, FailureSpec(), 30.0).action
    <Action.RESERVE: 'reserve'>
    """
    if outcome.ok:
        return Step(Action.FINISH, restarts, preemptions, infra_restarts=infra_restarts)
    if outcome.ended is Outcome.GROW:
        # Nodes came back and a checkpoint was committed since: no failure, no budget used; wait long enough for
        # the nodes this run just released to show as free.
        return Step(Action.RESERVE, restarts, preemptions, wait_full_s=max(resize_s, GROW_SETTLE_S),
                    resize_why=GREW, grew=True, infra_restarts=infra_restarts)
    lost = outcome.lost_nodes
    why = (f"node{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} lost") if lost else \
        (f"node{'s' if len(outcome.drained) > 1 else ''} {', '.join(map(str, outcome.drained))} drained"
         if outcome.drained else "a failure")
    fault = Fault.INFRA if lost else outcome.fault
    d = decide(outcome.ended, attempt, restarts, preemptions, budgets, fault, infra_restarts)
    if d.action is Action.GIVE_UP:
        return Step(Action.GIVE_UP, d.restarts, d.preemptions, infra_restarts=d.infra_restarts, decision=d)
    # A lost node's bundle is gone with it (a drained one's soon will be): reserve anew, on the nodes that are left
    # or that the cluster adds.
    return Step(Action.RESERVE if lost or outcome.drained else Action.RESTART, d.restarts, d.preemptions, wait_full_s=resize_s,
                resize_why=why, infra_restarts=d.infra_restarts, decision=d)


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
