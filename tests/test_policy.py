"""The restart rule, one case a row, without Ray: what a failed attempt leads to, given what is left of the budgets."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from cluster.protocol import FailureCause, RankFailure
from jobs.driver.hangs import is_hang
from jobs.driver.policy import (
    Action, AttemptOutcome, Fault, WorldSize, attempt_ended, blame, decide, fit, grow_to, next_step, resize_note,
    resize_reason, world_sizes,
)
from jobs.driver.routing import group_failures
from jobs.run.events import Outcome
from jobs.spec import FailureSpec, ScalingSpec

ROOT = Path(__file__).resolve().parents[1]
SIGTERM = RankFailure.killed(1, -15, "SIGTERM")
SIGKILL = RankFailure.killed(1, -9, "SIGKILL")
RAISED = RankFailure(0, 1, "ValueError: bad shape", "Traceback ...")
RESET = RankFailure(0, 1, "RuntimeError: Connection reset by peer", "")
# torch's words, as a rank's error enters (``RankFailure.raised``)
GLOO_RESET = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [10.0.0.2]:5821: " \
             "Connection reset by peer"
PEER = RankFailure.raised(0, 1, GLOO_RESET, "Traceback (most recent call last):\n  ...\n" + GLOO_RESET)


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


# kind, whose fault, (restarts, preemptions, infrastructure restarts) used, (max_restarts, max_preemptions,
# max_infra_restarts) -> action, used after it
CASES = [
    # a failure of the code restarts while restarts last
    (Outcome.FAILED, Fault.CODE, (0, 0, 0), (2, 10, 3), Action.RESTART, (1, 0, 0)),
    (Outcome.FAILED, Fault.CODE, (1, 0, 0), (2, 10, 3), Action.RESTART, (2, 0, 0)),
    # then the run has failed
    (Outcome.FAILED, Fault.CODE, (2, 0, 0), (2, 10, 3), Action.GIVE_UP, (2, 0, 0)),
    # by default not at all: a bug never loops, whatever the infrastructure's budget
    (Outcome.FAILED, Fault.CODE, (0, 0, 0), (0, 10, 3), Action.GIVE_UP, (0, 0, 0)),
    # a failure outside the code restarts on its own budget, even with no restart allowed (the defaults)
    (Outcome.FAILED, Fault.INFRA, (0, 0, 0), (0, 10, 3), Action.RESTART, (1, 0, 1)),
    (Outcome.FAILED, Fault.INFRA, (2, 0, 2), (0, 10, 3), Action.RESTART, (3, 0, 3)),
    # ... which leaves max_restarts to the code
    (Outcome.FAILED, Fault.CODE, (2, 0, 2), (1, 10, 3), Action.RESTART, (3, 0, 2)),
    # that budget spent: it counts as any failure
    (Outcome.FAILED, Fault.INFRA, (3, 0, 3), (0, 10, 3), Action.GIVE_UP, (3, 0, 3)),
    (Outcome.FAILED, Fault.INFRA, (3, 0, 3), (1, 10, 3), Action.RESTART, (4, 0, 3)),
    (Outcome.FAILED, Fault.INFRA, (0, 0, 0), (1, 10, 0), Action.RESTART, (1, 0, 0)),
    # a preemption restarts without using a restart, even with none allowed
    (Outcome.PREEMPTED, Fault.INFRA, (0, 0, 0), (0, 10, 3), Action.RESTART, (0, 1, 0)),
    (Outcome.PREEMPTED, Fault.INFRA, (2, 9, 0), (2, 10, 3), Action.RESTART, (2, 10, 0)),
    # preemptions spent: it counts as a failure of max_restarts (never of the infrastructure's budget)
    (Outcome.PREEMPTED, Fault.INFRA, (0, 10, 0), (1, 10, 3), Action.RESTART, (1, 10, 0)),
    (Outcome.PREEMPTED, Fault.INFRA, (1, 10, 0), (1, 10, 3), Action.GIVE_UP, (1, 10, 0)),
    (Outcome.PREEMPTED, Fault.INFRA, (0, 0, 0), (0, 0, 3), Action.GIVE_UP, (0, 0, 0)),
]


@pytest.mark.parametrize("kind, fault, used, budgets, action, after", CASES)
def test_the_restart_decision(kind, fault, used, budgets, action, after):
    restarts, preemptions, infra = used
    max_restarts, max_preemptions, max_infra = budgets
    d = decide(kind, 3, restarts, preemptions, FailureSpec(max_restarts=max_restarts, max_preemptions=max_preemptions,
                                                          max_infra_restarts=max_infra), fault, infra)
    assert (d.action, (d.restarts, d.preemptions, d.infra_restarts)) == (action, after)


# what failed, a node lost -> whose fault
@pytest.mark.parametrize("failures, lost, fault", [
    ([SIGKILL], False, Fault.INFRA),  # the OOM killer, a person, a scheduler
    ([PEER, SIGKILL], False, Fault.INFRA),  # the survivor's lost peer is the kill's consequence, reported first
    ([RankFailure.silent(1, 12.0, 10.0)], False, Fault.INFRA),  # a stopped or frozen process
    ([RankFailure.node_lost(1, "node 1", "was lost"), PEER], True, Fault.INFRA),
    ([RAISED], True, Fault.INFRA),  # a node was lost: whatever the ranks said, the next attempt needs other nodes
    ([RAISED], False, Fault.CODE),
    ([RankFailure.exited(1, 3)], False, Fault.CODE),  # an exit code the code chose
    ([RankFailure.killed(1, -11, "SIGSEGV")], False, Fault.CODE),  # signals the process's own execution raises
    ([RankFailure.killed(1, -6, "SIGABRT")], False, Fault.CODE),
    ([RankFailure.raised(0, 1, "RuntimeError: Timed out waiting 5000ms for recv", "")], False, Fault.CODE),
    ([RAISED, SIGKILL], False, Fault.CODE),  # an error of the code beside the kill: the code's, never a loop
    ([PEER], False, Fault.CODE),  # only lost peers: a rank returned early, its peers' collectives lost it
    # the cause is read from fields, never the text: a message that reads like a kill is the code's
    ([RankFailure.raised(0, 1, "killed by signal SIGKILL", "")], False, Fault.CODE),
])
def test_whose_fault_a_failure_was(failures, lost, fault):
    assert blame(failures, lost_nodes=lost) is fault


def test_the_defaults_restart_what_the_code_did_not_cause_and_nothing_else():
    """The spec's defaults, with no failure key written: a kill or a lost node restarts, a bug does not, and the
    line says why and how to ask for it."""
    defaults = FailureSpec()
    kill = next_step(AttemptOutcome(Outcome.FAILED, "killed", fault=blame([PEER, SIGKILL], False)), 1, 0, 0,
                     defaults, 30.0)
    lost = next_step(AttemptOutcome(Outcome.FAILED, "lost", lost_nodes=(1,)), 1, 0, 0, defaults, 30.0)
    assert (kill.action, kill.restarts, kill.infra_restarts) == (Action.RESTART, 1, 1)
    assert (lost.action, lost.restarts, lost.infra_restarts) == (Action.RESERVE, 1, 1)
    bug = next_step(AttemptOutcome(Outcome.FAILED, "boom", fault=blame([RAISED], False)), 1, 0, 0, defaults, 30.0)
    assert bug.action is Action.GIVE_UP
    assert bug.line() == (
        "raylaunch: not restarted: the training code failed (an exception, an exit code it chose, a crash or a "
        "collective that timed out), and restarting the same code from the same checkpoint most likely fails the "
        "same way; set failure.max_restarts to restart from the last committed checkpoint after it (--set "
        "failure.max_restarts=2; raylaunch launch also takes accelerate launch's --max_restarts 2)")
    # three kills in a row: the fourth is not restarted, and the line names the budget spent
    fourth = next_step(AttemptOutcome(Outcome.FAILED, "killed", fault=Fault.INFRA), 4, 3, 0, defaults, 30.0,
                       infra_restarts=3)
    assert fourth.action is Action.GIVE_UP
    assert fourth.line() == ("raylaunch: not restarted: the 3 infrastructure restarts of failure.max_infra_restarts "
                             "and the 0 restarts of failure.max_restarts are used up; raise "
                             "failure.max_infra_restarts to allow more (--set failure.max_infra_restarts=N)")


def test_what_the_driver_says_when_it_restarts():
    """It names the checkpoint the restart resumes from, or says there is none (#56: it claimed "the last committed
    checkpoint" with nothing committed)."""
    budgets = FailureSpec(max_restarts=2, max_preemptions=10)
    assert decide(Outcome.FAILED, 3, 0, 0, budgets).line(10) == (
        "raylaunch: attempt 3 failed; restarting from checkpoint 10 (1 of 2 restarts)")
    assert decide(Outcome.FAILED, 3, 0, 0, budgets).line(None) == (
        "raylaunch: attempt 3 failed; restarting from the beginning: nothing was committed (1 of 2 restarts)")
    assert decide(Outcome.PREEMPTED, 3, 0, 4, budgets).line(20) == (
        "raylaunch: attempt 3 was preempted (SIGTERM); restarting from checkpoint 20 "
        "(5 of 10 preemptions; restarts are not used up)")
    assert decide(Outcome.FAILED, 3, 1, 0, budgets, Fault.INFRA, 1).line(20) == (
        "raylaunch: attempt 3 failed outside the training code; restarting from checkpoint 20 "
        "(2 of 3 infrastructure restarts: failure.max_infra_restarts)")
    assert decide(Outcome.FAILED, 3, 2, 0, budgets).line() == (
        "raylaunch: not restarted: the 2 restarts of failure.max_restarts are used up; raise it to allow more "
        "(--set failure.max_restarts=N)")


def test_the_cause_is_said_first_and_the_ranks_that_lost_their_peer_in_one_line():
    """Rank 1 killed, ranks 0, 2 and 3 lose their peer and raise (reported before the kill): the kill first, the
    others in one line without their tracebacks (#56: the survivor's error stood as large as the cause)."""
    peers = [RankFailure.raised(r, 1, GLOO_RESET.replace("Read error", f"Read error {r}"), "Traceback ...")
             for r in (3, 0, 2)]
    assert group_failures([*peers, SIGKILL]) == (
        "[rank 1] killed by signal SIGKILL\n"
        "[ranks 0, 2, 3] failed after it: lost their peer (gloo: Connection reset by peer)")
    # a cause with its traceback, once
    assert group_failures([RankFailure.raised(2, 1, GLOO_RESET, "tb"), RAISED]) == (
        "[rank 0] ValueError: bad shape\nTraceback ...\n[rank 2] failed after it: lost its peer (gloo: Connection "
        "reset by peer)")
    # nothing but lost peers: they are what there is to say, in full
    assert group_failures([PEER]) == f"[rank 0] {GLOO_RESET}\n{PEER.traceback}"


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
    # torch's words for a collective whose peer went away: a consequence of another rank's end
    (PEER, FailureCause.PEER_LOST, False),
    (RankFailure.raised(0, 1, "RuntimeError: [../gloo/transport/tcp/pair.cc:598] Connection closed by peer "
                              "[10.0.0.2]:5821", "tb"), FailureCause.PEER_LOST, False),
    (RankFailure.raised(0, 1, "DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or "
                              "there was a network error", "tb"), FailureCause.PEER_LOST, False),
    (RankFailure(1, -1, "no heartbeat for 12 s", "", cause=FailureCause.SILENT), FailureCause.SILENT, True),
    # a function's own message that reads like the runner's words is still an exception, not a hang
    (RankFailure.raised(0, 1, "no heartbeat for 12 s (timeouts.heartbeat_s is 10)", ""), FailureCause.EXCEPTION,
     False),
    (RankFailure(0, -9, "node 1 was lost", "", cause=FailureCause.NODE_LOST), FailureCause.NODE_LOST, False),
])
def test_a_failure_carries_its_cause_from_where_it_entered(failure, cause, hang):
    assert failure.cause is cause and is_hang([failure]) is hang


GIVE = FailureSpec(max_restarts=1, max_preemptions=1, max_infra_restarts=0)
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
    assert bool(step.line()) == (action is not Action.FINISH and not step.grew)
    assert next_step(AttemptOutcome(Outcome.GROW, "grow", grow=W2), 3, 0, 0, GIVE, resize_s=1.0).wait_full_s == 10.0


def test_a_run_that_meant_to_grow_and_got_fewer_nodes_says_so():
    grow = next_step(AttemptOutcome(Outcome.GROW, "grow", grow=W2), 2, 0, 0, GIVE, resize_s=1.0)
    lost = next_step(AttemptOutcome(Outcome.FAILED, "lost", lost_nodes=(1,)), 2, 0, 0, GIVE, resize_s=1.0)
    assert resize_reason(grow, old_nodes=1, new_nodes=2) == "nodes came back"
    assert resize_reason(grow, old_nodes=2, new_nodes=1) == "nodes left while it grew back"
    assert resize_reason(lost, old_nodes=2, new_nodes=1) == "node 1 lost"


def test_a_connection_reset_the_code_met_itself_is_its_own_error_not_a_lost_peer():
    """Only torch's collectives say a peer was lost: a ConnectionResetError from the code's own download is the
    code's fault (so a kill beside it does not make the attempt the infrastructure's, restarted by default)."""
    from jobs.driver.policy import Fault, blame

    own = RankFailure.raised(0, 1, "ConnectionResetError: [Errno 104] Connection reset by peer", "")
    assert own.cause is FailureCause.EXCEPTION and own.peer_loss == ""
    assert PEER.cause is FailureCause.PEER_LOST
    assert blame([own, SIGKILL], lost_nodes=False) is Fault.CODE
