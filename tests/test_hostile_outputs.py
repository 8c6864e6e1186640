"""What a careless training function hands the runner, run by the runner on the shared cluster:
metrics, output and return values are capped and kept apart; the driver's own failures end the
run `failed`, never `running`."""

from __future__ import annotations

import io
import json
import subprocess
import sys

from conftest import ROOT, cli_env
from jobs.driver.driver import Driver
from jobs.spec import load_spec_text


def run_spec(text: str, out: io.StringIO | None = None):
    return Driver(load_spec_text(text), can_grow=False, out=out).run()


def test_metrics_output_and_return_values_stay_bounded_and_apart(ray_cluster, tmp_path):
    terminal = io.StringIO()
    result = run_spec(f"name: hostile\ntrain_fn: fns:hostile_outputs\nscaling: {{num_nodes: 2, workers_per_node: 1}}\n"
                      f"config: {{line_mb: 100}}\nstorage: {tmp_path}\n", terminal)
    assert result.status == "succeeded", result.error
    run = tmp_path / "hostile"
    # a metric named like a row's key is kept apart; the row's own rank and step are right
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "loss" in r]
    assert sorted((r["rank"], r["step"]) for r in logged) == [(0, 1), (0, 2), (1, 1), (1, 2)]
    assert all(r["logged_step"] == 999 and r["logged_rank"] == 42 for r in logged)
    assert all(len(r["text"]) < 1100 and r["huge_int"] == 1.7976931348623157e308 for r in logged)
    wide = [r for r in rows if "k0" in r]
    assert len(wide) == 2 and all("k999" in r and "k1000" not in r for r in wide)
    # the 100 MB line and the carriage-return bar reach the log bounded
    log = (run / "logs" / "rank-0.log").read_text()
    assert "[line cut at 65536 bytes]" in log and "after the long line" in log
    assert "99%|bar|" in log and (run / "logs" / "rank-0.log").stat().st_size < 1_000_000
    # what was changed is said once, on the rank's log
    said = "'step' is a key of every metrics row: stored as 'logged_step' (said once)"
    assert log.count(said) == 1 and (run / "logs" / "rank-1.log").read_text().count(said) == 1
    assert terminal.getvalue().count(said) == 1  # the terminal: once a run, not once a rank (#48)
    assert "more than 1000 keys in one call: the rest dropped" in log
    # the return value is stored as data, and said so
    for rank in ("0", "1"):
        value = result.rank_results[rank]
        assert value["cycle"]["self"] == "<cycle>" and value["lock"].startswith("<unlocked _thread.lock")
    assert "rank 0's return value is not all JSON data" in log
    assert json.loads((run / "result.json").read_text())["status"] == "succeeded"
    # show, plot and TensorBoard read the run without trouble
    env = cli_env()
    for args in (["show", "hostile"], ["show", "hostile", "--per-rank"],
                 ["plot", "hostile", "--metric", "huge_int", "-o", str(tmp_path / "p.png")],
                 ["plot", "hostile", "--metric", "nan", "-o", str(tmp_path / "q.png")]):
        proc = subprocess.run([sys.executable, "-m", "jobs.cli", *args, "--storage", str(tmp_path)], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=120)
        assert "Traceback" not in proc.stderr, (args, proc.stderr[-2000:])
        assert proc.returncode in (0, 2), (args, proc.stderr[-2000:])
    assert list((run / "tensorboard").rglob("events.out.tfevents.*"))


def test_storage_changed_under_the_driver_ends_the_run_failed_never_running(ray_cluster, tmp_path):
    result = run_spec(f"name: sabotaged\ntrain_fn: fns:sabotage_storage\nscaling: {{num_nodes: 1, workers_per_node: 2}}\n"
                      f"storage: {tmp_path}\n")
    assert result.status == "failed"
    recorded = json.loads((tmp_path / "sabotaged" / "result.json").read_text())
    assert recorded["status"] == "failed" and recorded["end_time"]
    assert "could not commit the checkpoint of step 5" in recorded["error"], recorded["error"]
    assert (tmp_path / "sabotaged" / "spec.yaml").exists()


def test_rows_of_numbers_and_cpu_tensors_are_written_as_logged_whatever_the_dict_becomes_after(tmp_path):
    # the common row takes a shorter way than the caps' walk (#58): it must write what the caps would, read when logged
    import torch

    from cluster.context import WorkerContext
    from cluster.protocol import METRICS_ROWS, WorkerPayload, metrics_lines
    from cluster.rank.session import Session

    ctx = WorkerContext(world_rank=1, local_rank=0, node_rank=0, world_size=2, local_world_size=1, num_nodes=2)
    session = Session(WorkerPayload(context=ctx, attempt=1, train_fn="x:y", config={},
                                    events_path=str(tmp_path / "events-rank1.jsonl"),
                                    staging_uri=str(tmp_path / "staging"), restore_uri=None, backend="gloo"))
    loss = torch.tensor(0.25)
    values = {"loss": loss, "lr": 1e-3, "epoch": 2, "last": True, "none": None, "big": 2**63, "bigger": 2**64,
              "count": torch.tensor(7)}
    session.log(values, step=5)
    values["lr"] = 9.0
    loss += 1  # a running total the function keeps adding to
    session.log({"step": 1, "loss": 0.5}, step=6)  # a row's own key: the caps' way, kept apart
    session.write_rows()
    # as the node reads them: the rows of a batch are one line (cluster.protocol.metrics_rows_line)
    lines = [json.loads(line) for line in (tmp_path / "events-rank1.jsonl").read_text().splitlines()]
    assert [line["kind"] for line in lines] == [METRICS_ROWS]
    rows = metrics_lines(lines[0])
    assert [(r["kind"], r["rank"], r["step"]) for r in rows] == [("metrics", 1, 5), ("metrics", 1, 6)]
    assert rows[0]["values"] == {"loss": 0.25, "lr": 1e-3, "epoch": 2, "last": True, "none": None, "big": 2**63,
                                 "bigger": 1.7976931348623157e308, "count": 7}
    assert rows[1]["values"] == {"logged_step": 1, "loss": 0.5}
