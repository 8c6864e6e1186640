"""The restart rule, one case a row, without Ray: what a failed attempt leads to, given what is left of the budgets."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from cluster.protocol import FailureCause, RankFailure
from jobs.driver.hangs import is_hang
from jobs.driver.policy import (
    Action, AttemptOutcome, WorldSize, attempt_ended, decide, fit, grow_to, next_step, resize_note,
    resize_reason, world_sizes,
)
from jobs.run.events import Outcome
from jobs.spec import FailureSpec, ScalingSpec

ROOT = Path(__file__).resolve().parents[1]
SIGTERM = RankFailure.killed(1, -15, "SIGTERM")
SIGKILL = RankFailure.killed(1, -9, "SIGKILL")
RAISED = RankFailure(0, 1, "ValueError: bad shape", "Traceback ...")
RESET = RankFailure(0, 1, "RuntimeError: Connection reset by peer", "")


@pytest.mark.parametrize("failures, lost, kind", [
    ([SIGTERM], False, Outcome.PREEMPTED),
    ([RESET, SIGTERM], False, Outcome.PREEMPTED),  # the peers' errors come first; SIGTERM is the cause
    ([SIGTERM], True, Outcome.FAILED),  # a node was lost: a failure, even with a SIGTERM
    ([SIGKILL], False, Outcome.FAILED),
    ([RAISED], False, Outcome.FAILED),
    # the signal is a field: an exception whose text reads like a signal is no preemption
    ([RankFailure(0, 1, "killed by signal SIGTERM", "")], False, Outcome.FAILED),
])
def test_a_rank_ended_by_sigterm_is_a_preemption_unless_a_node_was_lost(failures, lost, kind):
    assert attempt_ended(failures, lost_nodes=lost) is kind


def test_ranks_that_checkpointed_on_a_stop_notice_and_returned_were_preempted():
    assert attempt_ended([], lost_nodes=False, preempted=True) is Outcome.PREEMPTED
    assert attempt_ended([], lost_nodes=False) is Outcome.SUCCEEDED
    # a failure beside them decides: a SIGTERM is still a preemption, anything else a failure
    assert attempt_ended([SIGTERM], lost_nodes=False, preempted=True) is Outcome.PREEMPTED
    assert attempt_ended([RAISED], lost_nodes=False, preempted=True) is Outcome.FAILED


def test_every_rank_failure_is_built_in_one_place():
    """A rank's failure is built by one of ``RankFailure``'s constructors (cluster/protocol.py), each setting its
    cause: never by hand elsewhere in the product, where a cause could be forgotten."""
    found = []
    for path in sorted([*(ROOT / "cluster").rglob("*.py"), *(ROOT / "jobs").rglob("*.py")]):
        if path == ROOT / "cluster" / "protocol.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "RankFailure":
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == []
    assert "RankFailure" in (ROOT / "jobs" / "driver" / "attempt.py").read_text()  # the walk reads the product


# kind, restarts used, preemptions used, max_restarts, max_preemptions -> action, restarts, preemptions
CASES = [
    # a failure restarts while restarts last
    (Outcome.FAILED, 0, 0, 2, 10, Action.RESTART, 1, 0),
    (Outcome.FAILED, 1, 0, 2, 10, Action.RESTART, 2, 0),
    # then the run has failed
    (Outcome.FAILED, 2, 0, 2, 10, Action.GIVE_UP, 2, 0),
    (Outcome.FAILED, 0, 0, 0, 10, Action.GIVE_UP, 0, 0),
    # a preemption restarts without using a restart, even with none allowed
    (Outcome.PREEMPTED, 0, 0, 0, 10, Action.RESTART, 0, 1),
    (Outcome.PREEMPTED, 2, 9, 2, 10, Action.RESTART, 2, 10),
    # preemptions spent: it counts as a failure
    (Outcome.PREEMPTED, 0, 10, 1, 10, Action.RESTART, 1, 10),
    (Outcome.PREEMPTED, 1, 10, 1, 10, Action.GIVE_UP, 1, 10),
    (Outcome.PREEMPTED, 0, 0, 0, 0, Action.GIVE_UP, 0, 0),
]


@pytest.mark.parametrize("kind, restarts, preemptions, max_restarts, max_preemptions, action, after_r, after_p", CASES)
def test_the_restart_decision(kind, restarts, preemptions, max_restarts, max_preemptions, action, after_r, after_p):
    d = decide(kind, 3, restarts, preemptions, FailureSpec(max_restarts=max_restarts, max_preemptions=max_preemptions))
    assert (d.action, d.restarts, d.preemptions) == (action, after_r, after_p)


def test_what_the_driver_says_when_it_restarts():
    budgets = FailureSpec(max_restarts=2, max_preemptions=10)
    assert decide(Outcome.FAILED, 3, 0, 0, budgets).message == (
        "raylaunch: attempt 3 failed; restarting from the last committed checkpoint (1 of 2 restarts)")
    assert decide(Outcome.PREEMPTED, 3, 0, 4, budgets).message == (
        "raylaunch: attempt 3 was preempted (SIGTERM); restarting from the last committed checkpoint "
        "(5 of 10 preemptions; restarts are not used up)")
    assert decide(Outcome.FAILED, 3, 2, 0, budgets).message == ""


# --- elastic world size -------------------------------------------------------------

# num_nodes, min_nodes, accumulation, keep_global_batch -> (nodes, accumulation) of each size it may run at
SIZES = [
    (2, None, 1, True, [(2, 1)]),  # min_nodes unset: not elastic
    (2, 1, 1, True, [(2, 1), (1, 2)]),
    (4, 1, 1, True, [(4, 1), (2, 2), (1, 4)]),  # 3 cannot keep 4 micro-batches per step
    (3, 2, 1, True, [(3, 1)]),  # 2 cannot keep 3: the run never shrinks
    (3, 2, 2, True, [(3, 2), (2, 3)]),  # 6 micro-batches: 3 x 2 or 2 x 3
    (3, 2, 1, False, [(3, 1), (2, 1)]),  # the global batch may change: every size
    (4, 3, 1, False, [(4, 1), (3, 1)]),
]


@pytest.mark.parametrize("num_nodes, min_nodes, accumulation, keep, expected", SIZES)
def test_the_world_sizes_an_elastic_run_can_train_at(num_nodes, min_nodes, accumulation, keep, expected):
    spec = ScalingSpec(num_nodes=num_nodes, min_nodes=min_nodes, keep_global_batch=keep)
    sizes = world_sizes(spec, 2, accumulation)
    assert [(w.nodes, w.accumulation) for w in sizes] == expected
    assert all(w.world_size == 2 * w.nodes for w in sizes)
    if keep:  # per-device batch x world x accumulation: the same at every size
        assert {w.world_size * w.accumulation for w in sizes} == {2 * num_nodes * accumulation}


# num_nodes, min_nodes, nodes there -> nodes chosen (None: fewer than min_nodes, wait for them), said why
FITS = [
    (2, 1, 2, 2, False),
    (2, 1, 5, 2, False),  # never more than num_nodes
    (2, 1, 1, 1, False),
    (2, 1, 0, None, False),
    (4, 1, 3, 2, True),  # 4 configured, 3 left: runs on 2 and says why
    (4, 2, 1, None, False),
    (3, 2, 2, None, False),  # 2 would change the global batch: wait for 3
]


@pytest.mark.parametrize("num_nodes, min_nodes, there, nodes, why", FITS)
def test_the_size_chosen_for_the_nodes_there_are(num_nodes, min_nodes, there, nodes, why):
    f = fit(world_sizes(ScalingSpec(num_nodes=num_nodes, min_nodes=min_nodes), 1, 1), there)
    assert (f.size.nodes if f.size else None) == nodes
    assert bool(f.why) == why
    if why:
        assert f.why.startswith(f"{there} nodes are there, but at {there} the global batch")


def test_growing_back_only_to_a_larger_size():
    sizes = world_sizes(ScalingSpec(num_nodes=4, min_nodes=1), 1, 1)  # 4, 2, 1
    one, two = sizes[2], sizes[1]
    assert grow_to(sizes, one, 3) == two  # 3 nodes there: 2 keep the batch
    assert grow_to(sizes, two, 3) is None  # nothing larger than 2 until all 4 are there
    assert grow_to(sizes, two, 4) == sizes[0]
    assert grow_to(sizes, sizes[0], 4) is None


def test_what_the_driver_says_when_the_world_resizes():
    assert resize_note(WorldSize(2, 2, 1), WorldSize(1, 1, 2), "node 1 lost") == (
        "world size 2 -> 1 (node 1 lost); gradient accumulation 1 -> 2 keeps the global batch")
    assert resize_note(WorldSize(1, 1, 2), WorldSize(2, 2, 1), "nodes came back") == (
        "world size 1 -> 2 (nodes came back); gradient accumulation 2 -> 1 keeps the global batch")


@pytest.mark.parametrize("failure, cause, hang", [
    (RankFailure.raised(0, 1, "ValueError: bad shape", "tb"), FailureCause.EXCEPTION, False),
    # torch's own words for a collective that outlived the group's timeout, read once where the failure enters
    (RankFailure.raised(1, 1, "RuntimeError: [../gloo/transport/tcp/pair.cc:534] Timed out waiting 5000ms for "
                              "recv operation to complete", "tb"), FailureCause.COLLECTIVE_TIMEOUT, True),
    (RankFailure.raised(1, 1, "DistBackendError: [Rank 1] Watchdog caught collective operation timeout", ""),
     FailureCause.COLLECTIVE_TIMEOUT, True),
    (RankFailure.killed(1, -9, "SIGKILL"), FailureCause.SIGNAL, False),
    (RankFailure(1, -1, "no heartbeat for 12 s", "", cause=FailureCause.SILENT), FailureCause.SILENT, True),
    # a function's own message that reads like the runner's words is still an exception, not a hang
    (RankFailure.raised(0, 1, "no heartbeat for 12 s (timeouts.heartbeat_s is 10)", ""), FailureCause.EXCEPTION,
     False),
    (RankFailure(0, -9, "node 1 was lost", "", cause=FailureCause.NODE_LOST), FailureCause.NODE_LOST, False),
])
def test_a_failure_carries_its_cause_from_where_it_entered(failure, cause, hang):
    assert failure.cause is cause and is_hang([failure]) is hang


GIVE = FailureSpec(max_restarts=1, max_preemptions=1)
W1, W2 = WorldSize(1, 1, 2), WorldSize(2, 2, 1)


# outcome, restarts used, preemptions used -> action, restarts, preemptions, wait, why
@pytest.mark.parametrize("outcome, used, action, after, wait_s, why", [
    (AttemptOutcome(Outcome.SUCCEEDED), (0, 0), Action.FINISH, (0, 0), 0.0, ""),
    (AttemptOutcome(Outcome.SUCCEEDED), (1, 1), Action.FINISH, (1, 1), 0.0, ""),
    # a failure within the budget: the same nodes again
    (AttemptOutcome(Outcome.FAILED, "boom"), (0, 0), Action.RESTART, (1, 0), 30.0, "a failure"),
    # nodes lost: reserve anew, waiting resize_s for all of num_nodes
    (AttemptOutcome(Outcome.FAILED, "lost", lost_nodes=(1,)), (0, 0), Action.RESERVE, (1, 0), 30.0,
     "node 1 lost"),
    (AttemptOutcome(Outcome.FAILED, "lost", lost_nodes=(1, 2)), (0, 0), Action.RESERVE, (1, 0), 30.0,
     "nodes 1, 2 lost"),
    # a preemption uses its own budget, then counts as a failure
    (AttemptOutcome(Outcome.PREEMPTED, "sigterm"), (0, 0), Action.RESTART, (0, 1),
     30.0, "a failure"),
    (AttemptOutcome(Outcome.PREEMPTED, "sigterm"), (0, 1), Action.RESTART, (1, 1),
     30.0, "a failure"),
    # the budgets are spent
    (AttemptOutcome(Outcome.FAILED, "boom"), (1, 0), Action.GIVE_UP, (1, 0), 0.0, ""),
    (AttemptOutcome(Outcome.FAILED, "lost", lost_nodes=(0,)), (1, 0), Action.GIVE_UP, (1, 0), 0.0, ""),
    (AttemptOutcome(Outcome.PREEMPTED, "sigterm"), (1, 1), Action.GIVE_UP, (1, 1), 0.0,
     ""),
    # growing back: no budget used, even a spent one; wait at least GROW_SETTLE_S for the nodes just released
    (AttemptOutcome(Outcome.GROW, "grow", grow=W2), (1, 1), Action.RESERVE, (1, 1), 30.0, "nodes came back"),
])
def test_what_the_driver_does_after_an_attempt(outcome, used, action, after, wait_s, why):
    step = next_step(outcome, 3, *used, GIVE, resize_s=30.0)
    assert (step.action, (step.restarts, step.preemptions), step.wait_full_s, step.resize_why) == (
        action, after, wait_s, why)
    assert step.action.status == {Action.FINISH: "succeeded", Action.GIVE_UP: "failed"}.get(action)
    assert bool(step.message) == (action is Action.RESTART or (action is Action.RESERVE and not step.grew))
    assert next_step(AttemptOutcome(Outcome.GROW, "grow", grow=W2), 3, 0, 0, GIVE, resize_s=1.0).wait_full_s == 10.0


def test_a_run_that_meant_to_grow_and_got_fewer_nodes_says_so():
    grow = next_step(AttemptOutcome(Outcome.GROW, "grow", grow=W2), 2, 0, 0, GIVE, resize_s=1.0)
    lost = next_step(AttemptOutcome(Outcome.FAILED, "lost", lost_nodes=(1,)), 2, 0, 0, GIVE, resize_s=1.0)
    assert resize_reason(grow, old_nodes=1, new_nodes=2) == "nodes came back"
    assert resize_reason(grow, old_nodes=2, new_nodes=1) == "nodes left while it grew back"
    assert resize_reason(lost, old_nodes=2, new_nodes=1) == "node 1 lost"
