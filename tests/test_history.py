"""Looking back at runs: `raylaunch runs`, `show`, `plot`, TensorBoard files, progress output."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import ROOT, cli_env
from jobs.driver.driver import Driver
from jobs.progress import ProgressView
from jobs.run.events import AttemptEnded, AttemptStarted, ProgressShown, RunEvent
from jobs.run.storage import RunDir
from jobs.runs import format_runs, format_show, plot
from jobs.spec import load_spec_text

STEADY = """
name: steady
train_fn: fns:steady
config: {{steps: 40, every: 10, step_s: 0.1, fail_at: 25, pid_dir: {pids}}}
scaling: {{num_nodes: 2, workers_per_node: 1}}
failure: {{max_restarts: 1}}
checkpoint: {{snapshots: {{every: 0}}}}  # the restart from the commit of step 20 (test_snapshots: from memory)
storage: {storage}
"""


def raylaunch(*args: str, timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jobs.cli", *args], cwd=ROOT, env={**cli_env(), **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def pixels(png: Path, hex_color: str) -> int:
    """How many pixels of ``png`` have (about) this colour."""
    import matplotlib.image

    rgb = (matplotlib.image.imread(png)[..., :3] * 255).round()
    target = np.array([int(hex_color[i:i + 2], 16) for i in (1, 3, 5)])
    return int((np.abs(rgb - target).sum(axis=-1) < 30).sum())


def rows(storage: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (storage / name / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(ray_cluster, tmp_path_factory):
    """Three runs on one storage: one restarted once, one through the CLI, one that failed.

    The first is looked at with ``raylaunch runs`` while it is still running.
    """
    storage = tmp_path_factory.mktemp("runs")
    spec = load_spec_text(STEADY.format(pids=storage / "pids", storage=storage))
    out = io.StringIO()
    done: dict = {}
    thread = threading.Thread(target=lambda: done.update(result=Driver(spec, can_grow=False, out=out).run()))
    thread.start()
    while_running: dict = {}
    deadline = time.monotonic() + 120
    while thread.is_alive() and time.monotonic() < deadline:
        table = format_runs(str(storage))
        # rank 0's "loss" (what the plot below draws), not any rank's row: rank 1's "rank_loss" can come first
        if "running" in table and any(r.get("step") and "loss" in r
                                      for r in RunDir(str(storage), "steady").read_metrics()):
            # runs, show and plot on the run while it trains
            (curve,) = plot(str(storage), ["steady"], "loss", str(storage / "running.png"))
            while_running = {"table": table, "show": format_show(str(storage), "steady"), "curve": curve}
            break
        time.sleep(0.2)
    thread.join(180)
    assert done["result"].status == "succeeded", done["result"].error
    cli = raylaunch("run", "jobs/examples/digits.yaml", "--address", ray_cluster.address, "--storage", str(storage),
                    "--set", "config.epochs=1", "--set", "config.dropout=0.0")
    assert cli.returncode == 0, cli.stderr[-3000:]
    broken = io.StringIO()
    failed = Driver(load_spec_text(f"name: broken\ntrain_fn: fns:fail_on_all_ranks\nscaling: {{num_nodes: 2}}\n"
                                   f"storage: {storage}\nfailure: {{max_restarts: 1}}\n"), can_grow=False,
                    out=broken).run()
    assert failed.status == "failed"
    return {"storage": storage, "while_running": while_running, "cli": cli, "steady": done["result"],
            "said": {"steady": out.getvalue(), "broken": broken.getvalue()}}


def test_runs_lists_every_run_with_its_outcome(runs):
    storage = runs["storage"]
    running = runs["while_running"]
    assert "steady" in running["table"] and "running" in running["table"]
    assert "run steady: running" in running["show"]
    assert running["curve"].steps and running["curve"].steps[-1] < 40  # the part trained so far
    assert (storage / "running.png").stat().st_size > 10_000
    proc = raylaunch("runs", "--storage", str(storage), timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["NAME", "STATUS", "NODES", "x", "WORKERS", "STEPS", "LAST", "LOSS", "BEST",
                                "DURATION", "GOODPUT", "STARTED"]
    table = {line.split()[0]: line.split() for line in lines[1:]}
    assert set(table) == {"steady", "digits", "broken"}
    last_loss = [r["loss"] for r in rows(storage, "steady") if r.get("step") == 40 and "loss" in r]
    assert table["steady"][1:6] == ["succeeded", "2", "x", "1", "40"]
    assert table["steady"][6] == f"{last_loss[-1]:.4g}"
    assert table["digits"][1:6] == ["succeeded", "2", "x", "1", "45"]
    accuracy = json.loads((storage / "digits" / "result.json").read_text())["return_value"]["eval_accuracy"]
    assert table["digits"][7] == f"eval_accuracy={accuracy:.4g}"
    assert table["broken"][1:5] == ["failed", "2", "x", "1"] and table["broken"][5] == "-"
    for name in ("steady", "digits"):  # the share of the wall clock that trained the model
        ratio = json.loads((storage / name / "result.json").read_text())["goodput"]["ratio"]
        # (result.json keeps the ratio to 3 decimals, `runs` rounds the unrounded one: 0.375 may read 37% or 38%)
        assert table[name][9] in {f"{100 * ratio + d:.0f}%" for d in (-0.05, 0.05)} and 0 < ratio < 1


def test_show_tells_restarts_checkpoints_logs_and_errors(runs):
    storage = runs["storage"]
    proc = raylaunch("show", "steady", "--storage", str(storage), timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "run steady: succeeded" in out
    assert "attempts    2 (restarts 1, preemptions 0)" in out
    assert "  resumed     attempt 2 from checkpoint 20 (storage)" in out
    # the restart says what it resumes from, and that there is nothing when nothing was committed (#56)
    assert "raylaunch: attempt 1 failed; restarting from checkpoint 20 (1 of 1 restarts)" in runs["said"]["steady"]
    assert ("raylaunch: attempt 1 failed; restarting from the beginning: nothing was committed (1 of 1 restarts)"
            in runs["said"]["broken"])
    assert ("raylaunch: not restarted: the 1 restarts of failure.max_restarts are used up; raise it to allow more "
            "(--set failure.max_restarts=N)") in runs["said"]["broken"]
    ckpt = storage / "steady" / "checkpoints" / "checkpoint-00000040"
    size = sum(f.stat().st_size for f in ckpt.iterdir() if f.name != "manifest.json") / 2**20
    assert f"step 40       {size:9.1f} MiB  {ckpt}" in out
    logs = sorted(p.name for p in (storage / "steady" / "logs").iterdir())
    assert f"logs        {storage}/steady/logs/ ({', '.join(logs) or 'no output yet'})" in out
    # the mean across ranks by default, every rank on request
    per_rank = {r["rank"]: r["rank_loss"] for r in rows(storage, "steady") if r.get("step") == 40 and "rank_loss" in r}
    assert f"rank_loss                    {sum(per_rank.values()) / 2:.6g} at step 40" in out
    by_rank = raylaunch("show", "steady", "--storage", str(storage), "--per-rank", timeout=60).stdout
    assert f"rank_loss rank 1             {per_rank[1]:.6g} at step 40" in by_rank
    broken = raylaunch("show", "broken", "--storage", str(storage), timeout=60)
    assert "run broken: failed" in broken.stdout and "ValueError: bad batch shape (3, 4)" in broken.stdout
    missing = raylaunch("show", "nope", "--storage", str(storage), timeout=60)
    assert missing.returncode == 2 and "no run 'nope'" in missing.stderr and "broken, digits, steady" in missing.stderr


def test_plot_writes_a_png_with_one_curve_per_run(runs, tmp_path):
    import matplotlib.image

    storage = runs["storage"]
    png = tmp_path / "loss.png"
    proc = raylaunch("plot", "steady", "digits", "--metric", "loss", "-o", str(png), "--storage", str(storage),
                     timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {png} (loss: steady, digits)" in proc.stdout
    assert matplotlib.image.imread(png).shape[:2] == (500, 800)
    # matplotlib's first two line colours: one curve each (and the legend's swatches)
    assert pixels(png, "#1f77b4") > 200 and pixels(png, "#ff7f0e") > 200
    # errors name what exists
    bad = raylaunch("plot", "steady", "--metric", "los", "--storage", str(storage), "-o", str(png), timeout=60)
    assert bad.returncode == 2 and "run 'steady' has no metric 'los'; it has:" in bad.stderr and "loss" in bad.stderr
    bad = raylaunch("plot", "steady", "ghost", "--storage", str(storage), "-o", str(png), timeout=60)
    assert bad.returncode == 2 and "no run 'ghost'" in bad.stderr


def test_plot_per_rank_and_storage_from_the_environment(runs, tmp_path):
    """No --storage: RAYLAUNCH_STORAGE names it; --per-rank draws one curve per rank."""
    env = {"RAYLAUNCH_STORAGE": str(runs["storage"])}
    png = tmp_path / "ranks.png"
    proc = raylaunch("plot", "steady", "--metric", "rank_loss", "--per-rank", "-o", str(png), timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {png} (rank_loss: steady rank 0, steady rank 1)" in proc.stdout
    assert pixels(png, "#1f77b4") > 200 and pixels(png, "#ff7f0e") > 200
    listed = raylaunch("runs", timeout=60, env=env)
    assert listed.returncode == 0 and {"steady", "digits", "broken"} <= {l.split()[0] for l in listed.stdout.splitlines()}


def test_plot_peak_memory_per_rank_of_a_real_run(runs, tmp_path):
    """What the ranks' heartbeats report is in metrics.jsonl: one curve per rank, in MiB."""
    from jobs.runs import series

    png = tmp_path / "rss.png"
    proc = raylaunch("plot", "steady", "--metric", "peak_rss_mb", "--per-rank", "-o", str(png),
                     "--storage", str(runs["storage"]), timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {png} (peak_rss_mb: steady rank 0, steady rank 1)" in proc.stdout
    curves = series(RunDir(str(runs["storage"]), "steady").read_metrics(), "peak_rss_mb", per_rank=True)
    assert [c.label for c in curves] == ["rank 0", "rank 1"]
    assert all(c.values and all(100 < v < 20_000 for v in c.values) for c in curves), curves  # MiB of a real process


def test_nan_and_infinity_are_stored_and_never_drawn(ray_cluster, tmp_path):
    """A rank's NaN, infinity and minus infinity reach metrics.jsonl as they are; `plot` draws the run
    exactly as it draws the same run without them (no point, no stretched axis), and TensorBoard
    holds only the finite steps."""
    import math
    import shutil

    import matplotlib.image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    storage = tmp_path / "runs"
    result = Driver(load_spec_text(f"name: diverges\ntrain_fn: fns:diverges\nscaling: {{num_nodes: 2}}\n"
                                   f"storage: {storage}\n"), can_grow=False, out=io.StringIO()).run()
    assert result.status == "succeeded", result.error
    text = (storage / "diverges" / "metrics.jsonl").read_text()
    assert text.count('"score": NaN') == text.count('"score": Infinity') == text.count('"score": -Infinity') == 2
    for rank in (0, 1):
        got = {r["step"]: r["score"] for r in rows(storage, "diverges") if r["rank"] == rank and "score" in r}
        assert sorted(got) == list(range(1, 8)) and got[4] == 0.25 * (rank + 1), got
        assert math.isnan(got[5]) and got[6] == math.inf and got[7] == -math.inf, got
    # the same run with only its finite rows, under the same name on another storage
    finite = tmp_path / "finite" / "diverges"
    finite.mkdir(parents=True)
    shutil.copy(storage / "diverges" / "spec.yaml", finite)
    finite.joinpath("metrics.jsonl").write_text("".join(
        line + "\n" for line in text.splitlines() if "score" not in json.loads(line)
        or math.isfinite(json.loads(line)["score"])))
    for extra in ([], ["--per-rank"]):
        drawn = {}
        for where in (storage, finite.parent):
            png = tmp_path / f"{where.name}{''.join(extra)}.png"
            proc = raylaunch("plot", "diverges", "--metric", "score", *extra, "-o", str(png), "--storage", str(where),
                             timeout=60)
            assert proc.returncode == 0 and f"wrote {png} (score: diverges" in proc.stdout, proc.stderr
            drawn[where] = matplotlib.image.imread(png)
        assert pixels(png, "#1f77b4") > 200  # the finite part of the curve is there
        assert (pixels(png, "#ff7f0e") > 200) == bool(extra)  # and rank 1's, per rank
        assert np.array_equal(drawn[storage], drawn[finite.parent]), extra
    board = EventAccumulator(str(storage / "diverges" / "tensorboard"))
    board.Reload()
    assert [e.step for e in board.Scalars("score")] == [1, 2, 3, 4]


def test_the_best_evaluation_is_the_highest_or_for_losses_the_lowest(tmp_path):
    for name, metric in (("acc", "eval_accuracy"), ("lossy", "eval_loss")):
        run = RunDir(str(tmp_path), name)
        run.prepare({"name": name})
        run.append_metrics([{"step": s, "rank": 0, "attempt": 1, "time": 0.0, metric: v}
                            for s, v in ((1, 0.5), (2, 0.25), (3, 0.75), (4, 0.4))])
        run.close()
    table = {line.split()[0]: line for line in format_runs(str(tmp_path)).splitlines()[1:]}
    assert "eval_accuracy=0.75" in table["acc"] and "eval_loss=0.25" in table["lossy"]


def test_restarts_are_marked_and_rerun_steps_counted_once(runs):
    from jobs.runs import series

    records = RunDir(str(runs["storage"]), "steady").read_metrics()
    (loss,) = series(records, "loss")
    assert loss.steps == list(range(1, 41)) and loss.restarts == [21]  # resumed from the checkpoint of step 20
    # steps 21-25 ran twice, on other batches; the curve holds the second attempt's values
    first = {r["step"]: r["loss"] for r in records if r["attempt"] == 1 and "loss" in r}
    second = {r["step"]: r["loss"] for r in records if r["attempt"] == 2 and "loss" in r}
    assert first[23] != pytest.approx(second[23])
    assert loss.values[loss.steps.index(23)] == pytest.approx(second[23])
    (rank1,) = [c for c in series(records, "rank_loss", per_rank=True) if c.label == "rank 1"]
    assert rank1.values[rank1.steps.index(23)] == pytest.approx(
        next(r["rank_loss"] for r in records if r["attempt"] == 2 and r["rank"] == 1 and r.get("step") == 23
             and "rank_loss" in r))


def test_tensorboard_files_hold_the_metrics_memory_and_throughput(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    storage = runs["storage"]
    board = EventAccumulator(str(storage / "steady" / "tensorboard"))
    board.Reload()
    tags = set(board.Tags()["scalars"])
    assert {"loss", "rank_loss", "rank_0/steps_per_s", "rank_1/steps_per_s", "rank_0/peak_rss_mb",
            "rank_1/peak_rss_mb"} <= tags
    loss = board.Scalars("loss")
    assert [e.step for e in loss] == list(range(1, 41))  # the restarted steps once, not twice
    second = {r["step"]: r["loss"] for r in rows(storage, "steady") if r["attempt"] == 2 and "loss" in r}
    assert loss[22].value == pytest.approx(second[23], rel=1e-6)
    assert all(100 < e.value < 20_000 for e in board.Scalars("rank_1/peak_rss_mb"))  # MiB of a real process
    assert all(0 < e.value < 100 for e in board.Scalars("rank_0/steps_per_s"))  # step_s is 0.1
    # the run made through the CLI has its own files
    assert list((storage / "digits" / "tensorboard").glob("events.out.tfevents.*"))


def test_progress_in_a_log_file_is_plain_lines(runs):
    out = runs["cli"].stdout
    assert "\r" not in out and "\x1b[" not in out
    progress = [line for line in out.splitlines() if line.startswith("raylaunch: step ")]
    assert progress, out
    assert progress[-1].startswith("raylaunch: step 45/45 (100%) loss=")
    assert all("| elapsed " in line and " remaining " in line and "| attempt 1 restarts 0" in line
               for line in progress)


def _job_log(*items) -> list[str]:
    """The lines a job's log holds: prose as it is, events as a relay view (the driver under submit) prints them."""
    log = io.StringIO()
    relay = ProgressView.for_stream(log, relay=True)
    for item in items:
        relay.event(item) if isinstance(item, RunEvent) else print(item, file=relay)
    return log.getvalue().splitlines()


def test_progress_view_modes():
    """A terminal gets a bar (carriage returns), --quiet nothing; other lines always pass through; the events
    that a followed job's log carries are never shown as text."""

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    lines = _job_log(AttemptStarted(time=0, attempt=2), "raylaunch: attempt 2: resuming from /x (step 3)",
                     ProgressShown(time=1, step=4, values={"loss": "0.5", "total_steps": "8"}),
                     "[node 0 rank 0] hello", ProgressShown(time=2, step=8, values={"loss": "0.25", "total_steps": "8"}))
    assert sum(line.startswith("raylaunch-event {") for line in lines) == 3, lines
    term = Terminal()
    view = ProgressView.for_stream(term)
    assert view.mode == "bar"
    for line in lines:
        print(line, file=view)
    view.close()
    assert "\r" in term.getvalue() and "8/8" in term.getvalue() and "[node 0 rank 0] hello" in term.getvalue()
    assert "raylaunch-event" not in term.getvalue()
    quiet = io.StringIO()
    view = ProgressView.for_stream(quiet, quiet=True)
    for line in lines:
        print(line, file=view)
    view.close()
    assert quiet.getvalue() == "raylaunch: attempt 2: resuming from /x (step 3)\n[node 0 rank 0] hello\n"
    plain = io.StringIO()
    view = ProgressView(plain, "plain", every_s=3600)
    for line in lines:
        print(line, file=view)
    view.close()
    shown = [x for x in plain.getvalue().splitlines() if x.startswith("raylaunch: step")]
    # the first step at once, then the last one when the view closes
    assert [x.split(" loss")[0] for x in shown] == ["raylaunch: step 4/8 (50%)", "raylaunch: step 8/8 (100%)"]
    assert shown[-1].endswith("| attempt 2 restarts 0")


def test_an_attempt_that_starts_without_a_checkpoint_shows_its_own_number():
    """Attempt 1 fails before any checkpoint; attempt 2 starts from the beginning: nothing says "resuming", and
    the view still shows attempt 2 with one restart used (it showed attempt 1 before the events)."""
    lines = _job_log(
        AttemptStarted(time=0, attempt=1, max_restarts=1),
        ProgressShown(time=1, step=3, values={"loss": "0.9", "total_steps": "10"}),
        "raylaunch: attempt 1 failed:", "[rank 1] RuntimeError: injected failure at step 3",
        AttemptEnded(time=2, attempt=1, outcome="failed", restarts=1),
        "raylaunch: attempt 1 failed; restarting from the beginning: nothing was committed (1 of 1 restarts)",
        AttemptStarted(time=3, attempt=2, restarts=1, max_restarts=1),
        ProgressShown(time=4, step=2, values={"loss": "0.95", "total_steps": "10"}),
    )
    for view in (ProgressView(io.StringIO(), "plain", every_s=0), ProgressView(io.StringIO(), "quiet")):
        for line in lines:
            print(line, file=view)
        assert (view.attempt, view.restarts, view.step) == (2, 1, 2)
    assert view.out.getvalue().count("\n") == 3  # quiet: the prose lines only


def test_plain_progress_is_one_line_every_10_s_with_samples_per_s(monkeypatch):
    from jobs import progress

    now = [0.0]
    monkeypatch.setattr(progress, "time", SimpleNamespace(monotonic=lambda: now[0]))
    out = io.StringIO()
    view = ProgressView.for_stream(out)  # not a terminal: plain lines
    for step in range(1, 31):  # a step a second
        now[0] = float(step)
        view.event(ProgressShown(time=step, step=step, values={"loss": "0.5", "samples_per_s": "640.5",
                                                                "total_steps": "30"}))
    view.close()
    shown = out.getvalue().splitlines()
    assert [line.split(" loss")[0] for line in shown] == [
        "raylaunch: step 1/30 (3%)", "raylaunch: step 11/30 (37%)", "raylaunch: step 21/30 (70%)",
        "raylaunch: step 30/30 (100%)"]  # every 10 s, and the last one when the run ends
    assert all(" samples/s=640.5 | elapsed " in line for line in shown), shown


def test_the_progress_line_shows_the_loss_a_script_logs_under_its_own_name():
    """transformers' run_clm_no_trainer.py logs ``train_loss`` and ``eval_loss`` once an epoch, never ``loss``: the
    line showed ``loss=-`` throughout (#48); it shows the training loss by its name, and ``loss`` first when logged."""
    plain = io.StringIO()
    view = ProgressView(plain, "plain", every_s=0)
    view.event(ProgressShown(time=1, step=10, values={"total_steps": "20"}))
    view.event(ProgressShown(time=2, step=10, values={"perplexity": "1959.4", "eval_loss": "7.58",
                                                      "train_loss": "7.91", "epoch": "0"}))
    view.event(ProgressShown(time=3, step=20, values={"loss": "7.2"}))
    shown = [line.split(" | ")[0] for line in plain.getvalue().splitlines()]
    assert shown == ["raylaunch: step 10/20 (50%) loss=-",
                     "raylaunch: step 10/20 (50%) train_loss=7.91 eval_loss=7.58",
                     "raylaunch: step 20/20 (100%) loss=7.2"], shown
    bar = ProgressView(io.StringIO(), "plain")
    bar.metrics = {"eval_loss": "7.58"}  # only an evaluation's loss logged so far: that one
    assert bar._postfix()["eval_loss"] == "7.58"


def test_a_tracker_the_user_configures_keeps_working_beside_the_runners(ray_cluster, tmp_path):
    """`log_with=["tensorboard", session.tracker()]`: Accelerate's TensorBoard tracker writes
    the user's own event files, and the same `accelerator.log` calls reach the run directory."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    mine = tmp_path / "my-tensorboard"
    spec = load_spec_text(STEADY.format(pids=tmp_path / "pids", storage=tmp_path / "runs"),
                          ["name=own-tracker", "config.steps=12", "config.step_s=0.01", "config.fail_at=null",
                           f"config.user_tensorboard={mine}"])
    result = Driver(spec, can_grow=False).run()
    assert result.status == "succeeded", result.error
    assert len(list((mine / "steady").glob("events.out.tfevents.*"))) == 1  # rank 0's, under the run's name
    board = EventAccumulator(str(mine / "steady"))
    board.Reload()
    assert [e.step for e in board.Scalars("loss")] == list(range(1, 13))
    ours = [r for r in rows(tmp_path / "runs", "own-tracker") if r["rank"] == 0 and "loss" in r]
    assert [r["step"] for r in ours] == list(range(1, 13))
    assert [e.value for e in board.Scalars("loss")] == pytest.approx([r["loss"] for r in ours])


def test_the_last_progress_line_shows_the_newest_metrics_and_the_last_step(tmp_path):
    """Found running `make demo`: the step's loss came within a second of the line before, so its line (forced
    by the evaluation of the same step) showed the loss of a second earlier: 0.018 against the 0.044 that
    metrics.jsonl and `raylaunch runs` show. And a run whose last rows came within that second ended its
    output on an earlier step."""
    from jobs.driver.record import Recorder

    shown: list[RunEvent] = []
    rec = Recorder(RunDir(str(tmp_path), "r"), on_event=shown.append)
    rec.progress({"step": 1, "rank": 0, "loss": 0.9})
    rec.progress({"step": 2, "rank": 0, "loss": 0.5})  # within the second: held back
    rec.progress({"step": 2, "rank": 0, "eval_accuracy": 0.75})  # an evaluation is always shown
    rec.progress({"step": 3, "rank": 0, "loss": 0.25})  # held back again
    rec.event(AttemptEnded(time=0, attempt=1, outcome="succeeded"))
    lines = [(e.step, e.values) for e in shown if isinstance(e, ProgressShown)]
    assert lines == [(1, {"loss": "0.9"}), (2, {"loss": "0.5", "eval_accuracy": "0.75"}), (3, {"loss": "0.25"})]


def test_tensorboard_files_of_a_killed_driver_are_removed_by_the_next_driver(tmp_path, monkeypatch):
    """#47: a driver of a run on object storage writes its event files in a temporary folder first; one killed
    outright left it behind (the suite left a dozen in /tmp). The next driver on the machine removes it."""
    import os
    import subprocess
    import sys
    import tempfile

    from cluster.hosting.hostproc import pid_namespace
    from jobs.run.board import _scratch

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = tmp_path / f"raylaunch-tb-{pid_namespace()}-{dead.pid:x}" / "x1" / "events.out.tfevents.1"
    left.parent.mkdir(parents=True)
    left.write_bytes(b"\0" * 100)
    mine = Path(_scratch())
    assert not left.parent.parent.exists()
    assert mine.is_dir() and mine.parent.name == f"raylaunch-tb-{pid_namespace()}-{os.getpid():x}"
