"""The goodput ledger, without Ray: timelines of run events (as the driver writes them) and the seconds each
category gets; the categories always add up to the wall clock."""

from __future__ import annotations

import json
import math

import pytest

from cluster.protocol import RunStatus
from jobs.run.events import (
    EVENT_PREFIX, AttemptEnded, AttemptStarted, Committed, FirstStep, Outcome, Reserved, Restored, Saved,
    SessionEnded, SessionStarted, Waiting, Work, decode, encode_line,
)
from jobs.run.ledger import CATEGORIES, checkpoint_interval, ledger, suggestion


def books(events):
    b = ledger(events)
    assert math.isclose(sum(b.seconds.values()), b.wall_s, abs_tol=1e-9), b.seconds
    assert all(v >= 0 for v in b.seconds.values()), b.seconds
    return {k: round(v, 6) for k, v in b.seconds.items() if v}, round(b.wall_s, 6)


def test_a_decoded_event_carries_its_enums_and_the_files_keep_their_spelling():
    ended = decode({"kind": "attempt_ended", "time": 1.0, "attempt": 1, "outcome": "grow", "restarts": 0})
    assert ended.outcome is Outcome.GROW
    assert decode({"kind": "session_ended", "time": 2.0, "status": "stopped"}).status is RunStatus.STOPPED
    assert json.loads(encode_line(ended)[len(EVENT_PREFIX):])["outcome"] == "grow"
    assert json.loads(encode_line(SessionEnded(time=2.0, status=RunStatus.FAILED))[len(EVENT_PREFIX):])[
        "status"] == "failed"
    # a spelling this version does not know (a newer one wrote it) stays a string: the event and its time are kept
    assert decode({"kind": "attempt_ended", "time": 1.0, "attempt": 1, "outcome": "exploded"}).outcome == "exploded"
    assert decode({"kind": "session_ended", "time": 3.0, "status": "paused"}).time == 3.0


def test_an_undisturbed_run():
    # the command at 0, attempt at 2, reserved 3, first step 10, saves at 40 (held 1 s) and 80 (held 2 s),
    # 20 s of data waits, last step 100, the function ends at 104, the command at 105
    events = [
        SessionStarted(time=0), AttemptStarted(time=2, attempt=1), Reserved(time=3, attempt=1),
        FirstStep(time=10, attempt=1), Saved(time=40, attempt=1, step=40, held_s=1.0),
        Committed(time=42, attempt=1, step=40, state_time=40), Saved(time=80, attempt=1, step=80, held_s=2.0),
        Work(time=100, attempt=1, last=100, data_wait_s=20.0, step=100),
        AttemptEnded(time=104, attempt=1, outcome=Outcome.SUCCEEDED), SessionEnded(time=105, status="succeeded"),
    ]
    seconds, wall = books(events)
    assert wall == 105
    assert seconds == {"startup": 10, "checkpoint": 3, "data_wait": 20, "training": 90 - 3 - 20, "other": 5}
    assert ledger(events).ratio == pytest.approx(67 / 105)


def test_a_failure_after_a_commit_is_recompute_then_failure_then_restore():
    events = [
        SessionStarted(time=0), AttemptStarted(time=1, attempt=1), FirstStep(time=5, attempt=1),
        Saved(time=30, attempt=1, step=25, held_s=0.5), Committed(time=31, attempt=1, step=25, state_time=30),
        Work(time=45, attempt=1, last=42, data_wait_s=0.0, step=35),  # a rank died after step 35, at 42
        AttemptEnded(time=50, attempt=1, outcome=Outcome.FAILED, restarts=1),
        AttemptStarted(time=51, attempt=2, restarts=1), Restored(time=56, attempt=2, step=25, seconds=2.0),
        FirstStep(time=57, attempt=2), Work(time=90, attempt=2, last=90, step=60),
        AttemptEnded(time=91, attempt=2, outcome=Outcome.SUCCEEDED), SessionEnded(time=92, status="succeeded"),
    ]
    seconds, wall = books(events)
    assert wall == 92
    assert seconds == {
        "startup": 5 + 4,  # 0-5; 51-54 and 56-57 around the restore
        "training": (30 - 5) + (90 - 57),
        "checkpoint": 0.5,  # the committed save's hold, 30-30.5
        "recompute": 42 - 30.5,  # the steps past the committed state
        "failure": 51 - 42,  # from the last training seen to the next attempt's start
        "restore": 2,
        "other": 2,
    }


def test_a_resume_from_a_snapshot_in_memory_keeps_the_work_up_to_it():
    """The same failure, resumed from a snapshot taken at 41 (#59): only the second after it is recompute."""
    events = [
        SessionStarted(time=0), AttemptStarted(time=1, attempt=1), FirstStep(time=5, attempt=1),
        Saved(time=30, attempt=1, step=25, held_s=0.5), Committed(time=31, attempt=1, step=25, state_time=30),
        Work(time=45, attempt=1, last=42, data_wait_s=0.0, step=35),
        AttemptEnded(time=50, attempt=1, outcome=Outcome.FAILED, restarts=1),
        AttemptStarted(time=51, attempt=2, restarts=1, resume_step=34, resume_from="memory", resume_state_time=41),
        Restored(time=56, attempt=2, step=34, seconds=2.0),
        FirstStep(time=57, attempt=2), Work(time=90, attempt=2, last=90, step=60),
        AttemptEnded(time=91, attempt=2, outcome=Outcome.SUCCEEDED), SessionEnded(time=92, status="succeeded"),
    ]
    seconds, _ = books(events)
    assert seconds["recompute"] == 42 - 41
    assert seconds["training"] == (41 - 5 - 0.5) + (90 - 57)
    # the same events read back from events.jsonl's lines
    assert books([decode(json.loads(json.dumps(e.to_dict()))) for e in events])[0] == seconds


def test_a_failed_attempt_without_a_commit_loses_all_its_steps():
    events = [
        SessionStarted(time=0), AttemptStarted(time=0, attempt=1), FirstStep(time=4, attempt=1),
        Saved(time=10, attempt=1, step=5, held_s=1.0),  # saved, never committed: its hold is lost work too
        Work(time=20, attempt=1, last=20), AttemptEnded(time=25, attempt=1, outcome=Outcome.FAILED),
        SessionEnded(time=26, status="failed"),
    ]
    seconds, _ = books(events)
    assert seconds == {"startup": 4, "recompute": 16, "failure": 6}


def test_a_failed_attempt_that_showed_no_step_books_its_start_up_as_start_up():
    """#56.9: rank 1 was killed about a second into training, before any rank had logged a step or reported its
    pace; the driver knew only when the ranks joined (FirstStep not seen) and when the failure came. Nothing is
    known to have trained: start-up until the failure, then failure; recompute only from a step that was seen.
    Before, the rendezvous stood for the first step and the attempt's end for its last work: 6 s of recompute."""
    events = [
        SessionStarted(time=0), AttemptStarted(time=5, attempt=1), Reserved(time=7, attempt=1),
        FirstStep(time=14, attempt=1, seen=False),  # every rank joined; imports, model, data still to come
        Work(time=20.5, attempt=1, last=19),  # no step seen; the failure came at 19, the attempt ended at 20.5
        AttemptEnded(time=20.5, attempt=1, outcome=Outcome.FAILED, restarts=1),
        AttemptStarted(time=20.5, attempt=2, restarts=1), FirstStep(time=24, attempt=2),
        Work(time=27, attempt=2, last=26.5), AttemptEnded(time=27, attempt=2, outcome=Outcome.SUCCEEDED),
        SessionEnded(time=27.5, status="succeeded"),
    ]
    seconds, wall = books(events)
    assert wall == 27.5
    assert seconds == {"startup": 5 + 14 + 3.5, "failure": 20.5 - 19, "training": 2.5, "other": 1}
    # a function that never logs nor reads a prepared dataloader and succeeds: trained from the rendezvous, as before
    quiet = [SessionStarted(time=0), AttemptStarted(time=1, attempt=1), FirstStep(time=4, attempt=1, seen=False),
             Work(time=10, attempt=1, last=10), AttemptEnded(time=10, attempt=1, outcome=Outcome.SUCCEEDED),
             SessionEnded(time=11, status="succeeded")]
    assert books(quiet)[0] == {"startup": 4, "training": 6, "other": 1}
    # a step seen after the rendezvous (a pace report, a logged row) starts training there, whatever the outcome
    seen = events[:4] + [Work(time=20.5, attempt=1, last=19, first=17)] + events[5:]
    assert books(seen)[0]["recompute"] == 19 - 17 and books(seen)[0]["startup"] == 5 + 12 + 3.5


def test_waiting_for_nodes_and_growing_back():
    events = [
        SessionStarted(time=0), AttemptStarted(time=1, attempt=1), Waiting(time=2, attempt=1),
        Reserved(time=12, attempt=1), FirstStep(time=15, attempt=1),
        Committed(time=41, attempt=1, step=40, state_time=40), Work(time=42, attempt=1, last=42),
        AttemptEnded(time=43, attempt=1, outcome=Outcome.GROW),
        AttemptStarted(time=44, attempt=2), Waiting(time=45, attempt=2), Reserved(time=47, attempt=2),
        FirstStep(time=50, attempt=2), Work(time=60, attempt=2, last=60),
        AttemptEnded(time=60, attempt=2, outcome=Outcome.SUCCEEDED), SessionEnded(time=60, status="succeeded"),
    ]
    seconds, _ = books(events)
    assert seconds == {
        "startup": 1 + 1 + 3 + 1 + 3,
        "waiting": 10 + (44 - 42) + 2,  # placement, stopping to grow (from the last step), placement again
        "training": 25 + 10,
        "recompute": 2,  # steps 40-42 past the grow point
    }


def test_an_attempt_event_written_after_its_reservation_counts_from_when_it_began():
    """The driver writes an attempt's event once where it resumes from is final (after its nodes are reserved and a
    snapshot put together), with the time the attempt began: the books are those of the order things happened in;
    a driver killed after a wait for nodes, before that attempt's event, still has the wait counted."""
    events = [
        SessionStarted(time=0), Waiting(time=2, attempt=1), Reserved(time=12, attempt=1),
        AttemptStarted(time=1, attempt=1), FirstStep(time=15, attempt=1),
        Committed(time=41, attempt=1, step=40, state_time=40), Work(time=42, attempt=1, last=42),
        AttemptEnded(time=43, attempt=1, outcome=Outcome.FAILED),
        Waiting(time=45, attempt=2), Reserved(time=47, attempt=2),
        AttemptStarted(time=44, attempt=2, restarts=1, resume_step=40, resume_from="storage"),
        FirstStep(time=50, attempt=2), Work(time=60, attempt=2, last=60),
        AttemptEnded(time=60, attempt=2, outcome=Outcome.SUCCEEDED), SessionEnded(time=60, status="succeeded"),
    ]
    in_order = sorted(events, key=lambda e: e.time)
    assert books(events) == books(in_order)
    assert books(events)[0]["waiting"] == 10 + 2
    killed = [SessionStarted(time=0), AttemptStarted(time=1, attempt=1), FirstStep(time=3, attempt=1),
              Work(time=30, attempt=1, last=29), AttemptEnded(time=31, attempt=1, outcome=Outcome.FAILED),
              Waiting(time=32, attempt=2), Reserved(time=40, attempt=2)]  # killed before the snapshot was ready
    assert books(killed)[0]["waiting"] == 40 - 32


def test_a_rerun_continues_the_books_and_a_killed_driver_ends_at_its_last_event():
    first = [  # the driver was SIGKILLed: no AttemptEnded, no SessionEnded
        SessionStarted(time=0), AttemptStarted(time=1, attempt=1), FirstStep(time=3, attempt=1),
        Committed(time=21, attempt=1, step=10, state_time=20), Work(time=30, attempt=1, last=29),
    ]
    second = [  # an hour later, the same command
        SessionStarted(time=3600), AttemptStarted(time=3602, attempt=2), Restored(time=3605, attempt=2, step=10,
                                                                              seconds=1.0),
        FirstStep(time=3606, attempt=2), Work(time=3630, attempt=2, last=3630),
        AttemptEnded(time=3631, attempt=2, outcome=Outcome.SUCCEEDED), SessionEnded(time=3632, status="succeeded"),
    ]
    seconds, wall = books(first + second)
    assert wall == 30 + 32  # the hour between the commands is not the run's
    assert seconds["recompute"] == 29 - 20 and seconds["failure"] == 30 - 29
    assert seconds["training"] == 17 + 24
    assert books(first)[1] == 30


def test_a_running_attempt_is_not_a_failure_while_its_command_is_live():
    now = [SessionStarted(time=0), AttemptStarted(time=1, attempt=1), FirstStep(time=3, attempt=1),
           Work(time=10, attempt=1, last=10)]
    live = ledger(now, live=True)
    assert live.failures == 0 and live.seconds["training"] == 7 and live.wall_s == 10
    killed = ledger(now)  # read back after its driver died: the attempt failed, its work lost
    assert killed.failures == 1 and killed.seconds["recompute"] == 7


def test_a_stopped_run_and_events_of_a_newer_version():
    events = [SessionStarted(time=0), AttemptStarted(time=1, attempt=1), FirstStep(time=2, attempt=1),
              Work(time=9, attempt=1, last=9), AttemptEnded(time=10, attempt=1, outcome=Outcome.STOPPED),
              SessionEnded(time=11, status="stopped")]
    assert books(events)[0] == {"startup": 2, "recompute": 7, "other": 2}
    assert decode({"kind": "from_the_future", "time": 1}) is None
    assert decode({"kind": "work", "time": 1, "attempt": 1, "last": 2, "new_field": 3}) == Work(time=1, attempt=1,
                                                                                                 last=2)


def test_every_category_is_in_the_result():
    b = ledger([SessionStarted(time=0), SessionEnded(time=1, status="failed")])
    assert set(b.as_result()["seconds"]) == set(CATEGORIES)
    assert b.as_result() == {"wall_s": 1.0, "seconds": {**dict.fromkeys(CATEGORIES, 0.0), "startup": 1.0},
                             "ratio": 0.0}


@pytest.mark.parametrize("save_s, mtbf_s, every_s", [
    (2.0, 3600.0, 120.0),  # sqrt(2 x 2 x 3600)
    (30.0, 86400.0, 2276.8),
    (0.18, 6 * 3600.0, 88.2),
])
def test_young_daly_interval(save_s, mtbf_s, every_s):
    assert checkpoint_interval(save_s, mtbf_s) == pytest.approx(every_s, abs=0.1)


def test_the_books_suggest_an_interval_when_saves_or_recompute_cost_much():
    events = [
        SessionStarted(time=0), AttemptStarted(time=0, attempt=1), FirstStep(time=1, attempt=1),
        *[Saved(time=t, attempt=1, step=t, held_s=2.0) for t in range(10, 100, 10)],
        Committed(time=90, attempt=1, step=90, state_time=90), Work(time=99, attempt=1, last=99),
        AttemptEnded(time=100, attempt=1, outcome=Outcome.FAILED), AttemptStarted(time=101, attempt=2),
        FirstStep(time=102, attempt=2), Work(time=200, attempt=2, last=200),
        AttemptEnded(time=200, attempt=2, outcome=Outcome.SUCCEEDED), SessionEnded(time=200, status="succeeded"),
    ]
    text = suggestion(ledger(events))
    assert text is not None and "a save every 28 s loses the least (Young/Daly)" in text, text
    quiet = [SessionStarted(time=0), AttemptStarted(time=0, attempt=1), FirstStep(time=1, attempt=1),
             Work(time=99, attempt=1, last=99), AttemptEnded(time=100, attempt=1, outcome=Outcome.SUCCEEDED)]
    assert suggestion(ledger(quiet)) is None
