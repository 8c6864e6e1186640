"""The restart rule, one case a row, without Ray: what a failed attempt leads to, given what is left of the budgets."""

from __future__ import annotations

import pytest

from cluster.protocol import RankFailure
from jobs.policy import Action, Failure, decide, failure_kind
from jobs.spec import FailureSpec

SIGTERM = RankFailure.killed(1, -15, "SIGTERM")
SIGKILL = RankFailure.killed(1, -9, "SIGKILL")
RAISED = RankFailure(0, 1, "ValueError: bad shape", "Traceback ...")
RESET = RankFailure(0, 1, "RuntimeError: Connection reset by peer", "")


@pytest.mark.parametrize("failures, lost, kind", [
    ([SIGTERM], False, Failure.PREEMPTED),
    ([RESET, SIGTERM], False, Failure.PREEMPTED),  # the peers' errors come first; SIGTERM is the cause
    ([SIGTERM], True, Failure.FAILED),  # a node was lost: a failure, even with a SIGTERM
    ([SIGKILL], False, Failure.FAILED),
    ([RAISED], False, Failure.FAILED),
    # the signal is a field: an exception whose text reads like a signal is no preemption
    ([RankFailure(0, 1, "killed by signal SIGTERM", "")], False, Failure.FAILED),
])
def test_a_rank_ended_by_sigterm_is_a_preemption_unless_a_node_was_lost(failures, lost, kind):
    assert failure_kind(failures, lost_nodes=lost) is kind


# kind, restarts used, preemptions used, max_restarts, max_preemptions -> action, restarts, preemptions
CASES = [
    # a failure restarts while restarts last
    (Failure.FAILED, 0, 0, 2, 10, Action.RESTART, 1, 0),
    (Failure.FAILED, 1, 0, 2, 10, Action.RESTART, 2, 0),
    # then the run has failed
    (Failure.FAILED, 2, 0, 2, 10, Action.GIVE_UP, 2, 0),
    (Failure.FAILED, 0, 0, 0, 10, Action.GIVE_UP, 0, 0),
    # a preemption restarts without using a restart, even with none allowed
    (Failure.PREEMPTED, 0, 0, 0, 10, Action.RESTART, 0, 1),
    (Failure.PREEMPTED, 2, 9, 2, 10, Action.RESTART, 2, 10),
    # preemptions spent: it counts as a failure
    (Failure.PREEMPTED, 0, 10, 1, 10, Action.RESTART, 1, 10),
    (Failure.PREEMPTED, 1, 10, 1, 10, Action.GIVE_UP, 1, 10),
    (Failure.PREEMPTED, 0, 0, 0, 0, Action.GIVE_UP, 0, 0),
]


@pytest.mark.parametrize("kind, restarts, preemptions, max_restarts, max_preemptions, action, after_r, after_p", CASES)
def test_the_restart_decision(kind, restarts, preemptions, max_restarts, max_preemptions, action, after_r, after_p):
    d = decide(kind, 3, restarts, preemptions, FailureSpec(max_restarts=max_restarts, max_preemptions=max_preemptions))
    assert (d.action, d.restarts, d.preemptions) == (action, after_r, after_p)


def test_what_the_driver_says_when_it_restarts():
    budgets = FailureSpec(max_restarts=2, max_preemptions=10)
    assert decide(Failure.FAILED, 3, 0, 0, budgets).message == (
        "raylaunch: attempt 3 failed; restarting from the last committed checkpoint (1 of 2 restarts)")
    assert decide(Failure.PREEMPTED, 3, 0, 4, budgets).message == (
        "raylaunch: attempt 3 was preempted (SIGTERM); restarting from the last committed checkpoint "
        "(5 of 10 preemptions; restarts are not used up)")
    assert decide(Failure.FAILED, 3, 2, 0, budgets).message == ""
