"""The restart rule: after a failed attempt, restart or give up, as a pure function of what happened and the budgets.

The driver asks ``decide`` once per failed attempt. A preempted attempt (a rank ended by
SIGTERM, a spot node's notice, or every rank checkpointed within the grace period and
stopped) restarts without using up ``failure.max_restarts``, up to
``failure.max_preemptions`` times; once those are spent it counts as a failure. A failure
restarts while ``failure.max_restarts`` lasts. Errors that no restart can fix (the cluster
cannot place the job, storage cannot hold it, a checkpoint cannot be committed) end the run
before it gets here.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Iterable

from cluster.protocol import RankFailure
from jobs.spec import FailureSpec

__all__ = ["Action", "Decision", "Failure", "decide", "failure_kind"]


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
