"""Metrics rows rendered on the node (``cluster.metric_rows``): metrics.jsonl holds what the driver used to write
row by row, and TensorBoard the same means across ranks, with the driver doing a few microseconds a node and step.
No Ray: the node's batcher and the driver's router, recorder and board are the real ones; the poll answer is
pickled as Ray would carry it."""

from __future__ import annotations

import io
import json
import math
import pickle

import pytest

from cluster.metric_rows import RowBatcher
from cluster.protocol import CheckpointPart, Metrics, NodePoll
from jobs.driver.record import Recorder
from jobs.driver.routing import AttemptRouter, AttemptState
from jobs.run.storage import RunDir


def _node_poll(batcher: RowBatcher, events: list[dict]) -> NodePoll:
    """What a node actor answers (``NodeActor._rendered``), after a trip through pickle."""
    p = NodePoll()
    p.events, rows = batcher.take(events)
    if rows:
        p.rows.append(rows)
    return pickle.loads(pickle.dumps(p))


def _metrics(rank: int, step: int | None, at: float, **values) -> dict:
    return Metrics(time=at, rank=rank, step=step, values=values).to_dict()


@pytest.fixture
def driver(tmp_path):
    run = RunDir(str(tmp_path), "rows")
    run.prepare({"name": "rows"})
    out = io.StringIO()
    rec = Recorder(run, out=out)
    rec.open_board()
    rec.board.start_attempt(None)
    # 2 nodes of 2 ranks
    route = AttemptRouter(AttemptState(1, run.staging_uri(1), {0: 0, 1: 0, 2: 1, 3: 1}), rec, run, keep=2)
    yield run, rec, route, out
    rec.board.close()
    run.close()


def test_rows_rendered_on_the_node_are_the_rows_the_driver_wrote(driver, tmp_path):
    """Every kind of value a rank may log (capped JSON data) comes out as ``json.dumps`` of the row the driver
    built before: record keys first, then the values in the rank's order."""
    run, rec, route, out = driver
    odd = {"loss": 0.25, "nan": math.nan, "inf": -math.inf, "note": "a \"quoted\" é", "flag": True,
           "big": 2**70, "nested": {"a": [1, 2.5, None]}, "count": 3}
    events = [_metrics(0, 1, 100.5, **odd), _metrics(1, None, 100.75, eval_acc=0.5), _metrics(1, 2, 101.0),
              {"kind": "joined", "time": 99.0, "rank": 1}]
    p = _node_poll(RowBatcher(1, 4, {0: 0, 1: 0}), events)
    assert [e["kind"] for e in p.events] == ["joined"]  # the other events stay events, for the router
    route.forward(0, p)
    written = (tmp_path / "rows" / "metrics.jsonl").read_text()
    record = {"node": 0, "attempt": 1, "world_size": 4}
    assert written.splitlines() == [
        json.dumps({"step": 1, "rank": 0, **record, "time": 100.5, **odd}),
        json.dumps({"step": None, "rank": 1, **record, "time": 100.75, "eval_acc": 0.5}),
        json.dumps({"step": 2, "rank": 1, **record, "time": 101.0}),
    ]
    assert route.a.steps == {0: 1, 1: 2}
    assert rec.result.last_step == 1 and rec.result.last_metrics["loss"] == 0.25  # rank 0's row on the progress
    assert "raylaunch: step 1" in out.getvalue()


def test_tensorboard_means_across_nodes_and_per_rank_series(driver, tmp_path):
    """Two nodes' batches: each step's scalar is the mean over all four ranks, written once every rank passed
    it; each rank's throughput (steps a second, from its own rows' times) and memory under rank_<R>/."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, rec, route, _ = driver
    nodes = [RowBatcher(1, 4, {0: 0, 1: 0}), RowBatcher(1, 4, {2: 1, 3: 1})]
    for step in (1, 2, 3):
        for n, batcher in enumerate(nodes):
            ranks = (2 * n, 2 * n + 1)
            # rank r's loss: step * (r + 1); rank r steps every 0.1 * (r + 1) s
            route.forward(n, _node_poll(batcher, [_metrics(r, step, 1000.0 + step * 0.1 * (r + 1), loss=step * (r + 1.0))
                                                  for r in ranks]))
    route.events([{"kind": "resources", "time": 1000.5, "rank": r, "peak_rss_mb": 100.0 * (r + 1)} for r in range(4)])
    rec.board.flush()  # steps 1 and 2 passed by every rank; 3 (and the memory, at step 3) not yet
    board = EventAccumulator(str(tmp_path / "rows" / "tensorboard"))
    board.Reload()
    assert [(e.step, e.value) for e in board.Scalars("loss")] == [(1, 2.5), (2, 5.0)]
    rec.board.close_writer()  # the attempt ends: the rest
    board = EventAccumulator(str(tmp_path / "rows" / "tensorboard"))
    board.Reload()
    assert [(e.step, e.value) for e in board.Scalars("loss")] == [(1, 2.5), (2, 5.0), (3, 7.5)]
    tags = set(board.Tags()["scalars"])
    assert {f"rank_{r}/steps_per_s" for r in range(4)} <= tags
    assert {f"rank_{r}/peak_rss_mb" for r in range(4)} <= tags
    assert [round(board.Scalars(f"rank_{r}/steps_per_s")[-1].value, 3) for r in range(4)] == [10.0, 5.0, 3.333, 2.5]
    assert [board.Scalars(f"rank_{r}/peak_rss_mb")[-1].value for r in range(4)] == [100.0, 200.0, 300.0, 400.0]
    assert "steps_per_s" not in (tmp_path / "rows" / "metrics.jsonl").read_text()  # TensorBoard's alone


def test_rows_of_a_poll_are_stored_before_its_checkpoint_commits(driver, tmp_path):
    """A node's answer holding a rank's rows and then its checkpoint part: the rows are in metrics.jsonl when the
    commit happens (a driver killed after it loses none of the steps it covers)."""
    run, rec, route, _ = driver
    staging = tmp_path / "rows" / ".staging" / "attempt-1" / "checkpoint-00000002"
    staging.mkdir(parents=True)
    lines_at_commit = []
    commit = run.checkpoints.commit

    def watched(*args, **kwargs):
        lines_at_commit.append((tmp_path / "rows" / "metrics.jsonl").read_text().count("\n"))
        return commit(*args, **kwargs)

    run.checkpoints.commit = watched
    batchers = [RowBatcher(1, 4, {0: 0, 1: 0}), RowBatcher(1, 4, {2: 1, 3: 1})]
    for n, batcher in enumerate(batchers):
        events = []
        for r in (2 * n, 2 * n + 1):
            (staging / f"random_states_{r}.pkl").write_bytes(b"x")
            events += [_metrics(r, 1, 10.0, loss=1.0), _metrics(r, 2, 10.1, loss=0.5),
                       CheckpointPart(time=10.2, rank=r, step=2, uri=str(staging)).to_dict()]
        route.forward(n, _node_poll(batcher, events))
    assert run.checkpoints.latest().step == 2
    assert lines_at_commit == [8]
