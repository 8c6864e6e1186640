"""Bad input through the real command line: a clear error, a non-zero exit, nothing started."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, cli_env, free_ports, interruptible, wait_for


def raylaunch(*args: str, cwd: Path = ROOT, timeout: float = 180, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jobs.cli", *args], cwd=cwd, env={**cli_env(), **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def ray_tmp():
    """Ray's temporary root for one embedded command (RAY_TMPDIR), short enough for its sockets' paths."""
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="rl-ray-", dir="/tmp"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return str(path)


def test_validate_accepts_the_example():
    proc = raylaunch("validate", "jobs/examples/digits.yaml")
    assert proc.returncode == 0, proc.stderr
    assert "ok (digits: 2 nodes x 1 workers" in proc.stdout


def test_spec_that_does_not_parse(tmp_path):
    proc = raylaunch("run", write(tmp_path, "name: [oops\n"), "--storage", str(tmp_path / "runs"))
    assert proc.returncode == 2
    assert "job.yaml has 1 problem" in proc.stderr and "not valid YAML" in proc.stderr
    assert not (tmp_path / "runs").exists()


def test_misspelt_key_and_bad_override(tmp_path):
    spec = write(tmp_path, "name: t\ntrain_fn: train_fn.digits:train\nscaling: {num_nodez: 2}\n")
    proc = raylaunch("run", spec, "--set", "scaling.workers_per_node=-1", "--storage", str(tmp_path / "runs"))
    assert proc.returncode == 2
    assert "scaling.num_nodez: unknown key; did you mean 'num_nodes'?" in proc.stderr
    assert "scaling.workers_per_node: must be at least 1 or 'auto', got -1" in proc.stderr


def test_train_fn_module_or_function_that_does_not_exist(tmp_path):
    proc = raylaunch("run", write(tmp_path, "name: t\ntrain_fn: train_fn.digitz:train\n"),
                     "--storage", str(tmp_path / "runs"))
    assert proc.returncode == 2
    assert "no module named 'train_fn.digitz'" in proc.stderr and "Fix `train_fn`" in proc.stderr
    assert f"in the working directory ({ROOT}) or the installed packages" in proc.stderr
    proc = raylaunch("validate", write(tmp_path, "name: t\ntrain_fn: train_fn.digits:trian\n"))
    assert proc.returncode == 2
    assert "has no function 'trian'; it defines:" in proc.stderr and "train" in proc.stderr
    assert not (tmp_path / "runs").exists()


def test_submit_refuses_a_bad_train_fn_before_sending_anything(tmp_path):
    """Checked on the laptop: exit 2 and the fix, never a connection (nobody listens at the address;
    the same spec with a good train_fn tries to send, and says that no dashboard answers there)."""
    import socket

    # a port held, bound but not listening, for the test's length: connections to it are refused (a port that was
    # merely free a moment ago was once taken meanwhile by a token-authenticated cluster of another test's)
    held = socket.socket()
    held.bind(("127.0.0.1", free_ports(1)[0]))
    address = f"http://127.0.0.1:{held.getsockname()[1]}"
    write(tmp_path, "name: t\ntrain_fn: train_fn.digits:train\n")  # in the project folder it uploads
    try:
        sent = raylaunch("submit", "job.yaml", "--address", address, cwd=tmp_path)
    finally:
        held.close()
    assert sent.returncode == 1 and "no Ray dashboard answers at" in sent.stderr, sent.stderr
    for train_fn, said in (("train_fn.digitz:train", "no module named 'train_fn.digitz'"),
                           ("train_fn.digits:trian", "has no function 'trian'; it defines:")):
        write(tmp_path, f"name: t\ntrain_fn: {train_fn}\n")
        proc = raylaunch("submit", "job.yaml", "--address", address, cwd=tmp_path)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert said in proc.stderr and "Traceback" not in proc.stderr
        assert "submitted" not in proc.stdout and "no Ray dashboard answers" not in proc.stderr


def test_the_installed_command_runs_a_module_of_the_folder_it_runs_in(tmp_path):
    """`raylaunch` (the console script, not `python -m`) in a user's project folder: the
    driver and every rank import the project's own module."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "mytrain.py").write_text(
        "from accelerate import Accelerator\n"
        "from cluster.runtime import get_session\n\n\n"
        "def train(config):\n"
        "    accelerator = Accelerator(**get_session().accelerator_kwargs())\n"
        "    get_session().log({'loss': 0.5}, step=1)\n"
        "    return {'rank': accelerator.process_index, 'world': accelerator.num_processes}\n"
    )
    (project / "job.yaml").write_text(
        "name: mine\ntrain_fn: mytrain:train\nscaling: {num_nodes: 1, workers_per_node: 2}\n")
    env = cli_env()
    env["PYTHONPATH"] = ""  # nothing but what the command itself puts on the path
    proc = subprocess.run([str(Path(sys.executable).parent / "raylaunch"), "run", "job.yaml", "--quiet",
                           "--storage", str(tmp_path / "runs")],
                          cwd=project, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "runs" / "mine" / "result.json").read_text())
    assert result["rank_results"] == {"0": {"rank": 0, "world": 2}, "1": {"rank": 1, "world": 2}}
    # --quiet: the step it logged shows no progress line; the outcome still prints
    assert result["last_step"] == 1 and "raylaunch: step" not in proc.stdout
    assert "raylaunch: succeeded after 1 attempt(s)" in proc.stdout


def test_storage_that_cannot_be_written(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    proc = raylaunch("run", "jobs/examples/digits.yaml", "--storage", str(blocker / "runs"))
    assert proc.returncode == 2
    assert f"cannot write the run directory {blocker}/runs/digits" in proc.stderr
    assert "Set `storage` in the spec (or --storage)" in proc.stderr


def test_more_nodes_than_the_cluster_can_ever_give(tmp_path, ray_tmp):
    """Also `--fresh`: a run of that name exists, and a new run directory is started beside it."""
    earlier = tmp_path / "runs" / "digits"
    earlier.mkdir(parents=True)
    (earlier / "spec.yaml").write_text("name: digits\n")
    (earlier / "result.json").write_text('{"status": "succeeded", "attempts": 1}')
    proc = raylaunch("run", "jobs/examples/digits.yaml", "--local-nodes", "1", "--set", "scaling.num_nodes=3",
                     "--storage", str(tmp_path / "runs"), "--fresh", "--keep-temp", env={"RAY_TMPDIR": str(ray_tmp)})
    assert proc.returncode == 1
    # --keep-temp: the embedded cluster's Ray session folder stays, and where is said (#47)
    kept = [p for p in ray_tmp.glob("ray/session_2*")]
    assert len(kept) == 1 and (kept[0] / "logs").is_dir(), list(ray_tmp.rglob("*"))[:20]
    assert f"raylaunch: the embedded cluster's Ray session folder is kept: {kept[0]}" in proc.stdout + proc.stderr
    assert "the job needs 3 nodes with {CPU: 1} each" in proc.stderr
    assert "only 1 of the cluster's 1 alive nodes can hold that" in proc.stderr
    assert "--set scaling.num_nodes=1" in proc.stderr
    fresh = re.search(r"raylaunch: --fresh: starting a new run directory (digits-\d{8}-\d{6}) \(the old one is kept\)",
                      proc.stdout)
    assert fresh, proc.stdout
    result = json.loads((tmp_path / "runs" / fresh.group(1) / "result.json").read_text())
    assert result["status"] == "failed" and result["attempts"] == 0
    assert json.loads((earlier / "result.json").read_text()) == {"status": "succeeded", "attempts": 1}
    assert (earlier / "spec.yaml").read_text() == "name: digits\n"


def test_a_killed_driver_resumes_when_the_spec_runs_again(tmp_path):
    """The driver process is SIGKILLed mid-run; running the same spec again resumes."""
    import json
    import os
    import signal
    import time

    import psutil

    spec = write(tmp_path, f"name: lost-driver\ntrain_fn: fns:steady\nscaling: {{num_nodes: 2}}\n"
                           f"config: {{steps: 80, every: 10, step_s: 0.05, pid_dir: {tmp_path / 'pids'}}}\n"
                           f"storage: {tmp_path / 'runs'}\n")
    latest = tmp_path / "runs" / "lost-driver" / "checkpoints" / "latest.json"
    # run from a project folder of its own (not raylaunch's checkout): its ranks must start there on both nodes
    proc = subprocess.Popen([sys.executable, "-m", "jobs.cli", "run", spec, "--local-nodes", "2"],
                            cwd=tmp_path, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not latest.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert latest.exists(), "no checkpoint was committed"
        tree = psutil.Process(proc.pid).children(recursive=True)
        api_servers = []  # the embedded head runs no Ray API server (dashboard.py) beside the ranks
        for p in tree:
            with contextlib.suppress(psutil.Error):
                api_servers += [p.pid] if any(a.endswith("dashboard/dashboard.py") for a in p.cmdline()) else []
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        # The embedded cluster died with its driver's process group leader gone: end what it started.
        for child in locals().get("tree", []):
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
        if proc.poll() is None:
            proc.kill()
    assert tree and not api_servers
    step = json.loads(latest.read_text())["step"]
    again = raylaunch("run", spec, "--local-nodes", "2", cwd=tmp_path, timeout=240)
    assert again.returncode == 0, again.stderr[-2000:]
    # the rerun is attempt 2 of the same run, and went on from the checkpoint to the last step
    assert f"attempt 2: resuming from {latest.parent}/checkpoint-{step:08d} (step {step})" in again.stdout
    result = json.loads((tmp_path / "runs" / "lost-driver" / "result.json").read_text())
    assert result["status"] == "succeeded" and result["attempts"] == 2 and result["restarts"] == 0
    assert result["rank_results"]["0"]["restored_step"] == step and result["rank_results"]["0"]["steps"] == 80
    # both nodes' ranks ran in the folder the command ran in (the second node started while the driver connected)
    assert [result["rank_results"][r]["cwd"] for r in ("0", "1")] == [str(tmp_path)] * 2
    rows = [json.loads(line) for line in (tmp_path / "runs" / "lost-driver" / "metrics.jsonl").read_text().splitlines()]
    for rank in (0, 1):
        second = [r["step"] for r in rows if r["attempt"] == 2 and r["rank"] == rank and "rank_loss" in r]
        assert second == list(range(step + 1, 81)), (rank, second)
    assert {r["attempt"] for r in rows} == {1, 2}
    # the books continue: both commands' seconds (the killed one's until its last event; its running attempt
    # never ended), the categories adding up to both commands' wall clock
    events = [json.loads(line) for line in (tmp_path / "runs" / "lost-driver" / "events.jsonl").read_text().splitlines()]
    second = [i for i, e in enumerate(events) if e["kind"] == "session"]
    assert len(second) == 2 and second[0] == 0, events
    first_wall = max(e.get("last", e["time"]) for e in events[:second[1]]) - events[0]["time"]
    second_wall = events[-1]["time"] - events[second[1]]["time"]
    assert events[-1]["kind"] == "session_ended" and "attempt_ended" not in [e["kind"] for e in events[:second[1]]]
    goodput = result["goodput"]
    assert goodput["wall_s"] == pytest.approx(first_wall + second_wall, abs=0.01)
    assert sum(goodput["seconds"].values()) == pytest.approx(goodput["wall_s"], rel=0.01)
    assert goodput["seconds"]["restore"] > 0 and goodput["seconds"]["training"] > 0


@pytest.mark.parametrize("how", ["Ctrl-C", "SIGTERM"])
def test_ctrl_c_or_sigterm_stops_every_rank_and_records_stopped(tmp_path, how):
    """Ctrl-C reaches `raylaunch run`'s whole process group (as a terminal sends it); SIGTERM (a
    scheduler's kill) reaches the process. Either way every rank ends, result.json says stopped, and
    nothing the command started is left."""
    import psutil

    spec = write(tmp_path, f"name: halted\ntrain_fn: fns:steady\nscaling: {{num_nodes: 1, workers_per_node: 2}}\n"
                           f"config: {{steps: 1000000, every: 1000000, step_s: 0.05, pid_dir: {tmp_path / 'pids'}}}\n"
                           f"storage: {tmp_path / 'runs'}\n")
    metrics, out = tmp_path / "runs" / "halted" / "metrics.jsonl", tmp_path / "out.txt"
    with open(out, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "jobs.cli", "run", spec], cwd=ROOT, env=cli_env(),
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=interruptible)
    tree: list = []
    try:
        wait_for(lambda: metrics.exists() and '"rank": 1' in metrics.read_text(), 180, "both ranks to train")
        pids = [int((tmp_path / "pids" / f"rank-{r}.pid").read_text().split()[1]) for r in (0, 1)]
        tree = psutil.Process(proc.pid).children(recursive=True)
        if how == "Ctrl-C":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(120) == 1, out.read_text()[-3000:]
    finally:
        for p in [*tree, psutil.Process(proc.pid)] if proc.poll() is None else tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
    said = out.read_text()
    result = json.loads((tmp_path / "runs" / "halted" / "result.json").read_text())
    why = "interrupted (Ctrl-C)" if how == "Ctrl-C" else "stopped (SIGTERM)"
    assert result["status"] == "stopped" and result["error"].startswith(why), result["error"]
    error = result["error"]  # where every rank was, before it was stopped
    assert "where each rank was (every thread: " in error and ("[ranks 0, 1] in " in error or (
        "[rank 0] in " in error and "[rank 1] in " in error)), error
    assert f"raylaunch: {why}: stopping every rank" in said and "raylaunch: stopped after 1 attempt(s)" in said
    assert "Traceback" not in said, said[-3000:]
    wait_for(lambda: not any(psutil.pid_exists(p) for p in pids), 30, "every rank to end")
    wait_for(lambda: not [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], 30,
             "every process the command started to end")


def test_an_exception_in_the_training_function_fails_the_run(tmp_path, ray_tmp):
    spec = write(tmp_path, "name: boom\ntrain_fn: fns:fail_on_all_ranks\nscaling: {num_nodes: 1, workers_per_node: 1}\n")
    proc = raylaunch("run", spec, "--storage", str(tmp_path / "runs"), env={"RAY_TMPDIR": str(ray_tmp)})
    assert proc.returncode == 1
    # the embedded cluster's Ray session folder (and session_latest) went with the command (#47)
    assert (ray_tmp / "ray").is_dir() and not list(ray_tmp.glob("ray/session_*")), list(ray_tmp.rglob("*"))[:20]
    assert "[rank 0] ValueError: bad batch shape (3, 4)" in proc.stderr
    assert 'fns.py", line' in proc.stderr  # the rank's traceback
    # printed once, where the attempt failed; the last line gives the cause's line (#56)
    assert proc.stderr.count("Traceback (most recent call last)") == 1, proc.stderr
    assert "raylaunch: boom failed: [rank 0] ValueError: bad batch shape (3, 4) (in full above)" in proc.stderr
    # with the defaults, a bug is not restarted, and the line says how to ask for it (#57)
    assert ("raylaunch: not restarted: the training code failed (an exception, an exit code it chose, a crash or a "
            "collective that timed out)") in proc.stdout
    assert "--set failure.max_restarts=2; raylaunch launch also takes accelerate launch's --max_restarts 2" in proc.stdout
    assert "raylaunch: failed after 1 attempt(s)" in proc.stdout


def test_validate_prints_the_world_sizes_an_elastic_spec_can_run_at(tmp_path):
    spec = write(tmp_path, "name: t\ntrain_fn: train_fn.digits:train\n"
                           "scaling: {num_nodes: 4, min_nodes: 1, workers_per_node: 2}\n")
    proc = raylaunch("validate", spec)
    assert proc.returncode == 0, proc.stderr
    assert ("elastic: runs at 4 nodes (world size 8, gradient accumulation 1); 2 nodes (world size 4, gradient "
            "accumulation 2); 1 node (world size 2, gradient accumulation 4); not at 3 node(s): the global batch "
            "would change there (scaling.keep_global_batch)") in proc.stdout
    proc = raylaunch("validate", spec, "--set", "scaling.keep_global_batch=false", "--set", "scaling.min_nodes=3")
    assert "elastic: runs at 4 nodes (world size 8, gradient accumulation 1); 3 nodes (world size 6, gradient " \
           "accumulation 1); the global batch changes with the world size" in proc.stdout


def test_make_demo_names_its_run_plots_its_loss_into_the_run_directory_and_lists_it(tmp_path):
    """The README's `make demo`, one epoch of it: the run's name, its result line, loss.png in the run
    directory and the table of runs."""
    proc = subprocess.run(["make", "-s", "demo", f"STORAGE={tmp_path}", "DEMO_RUN=demo-test",
                           "DEMO_ARGS=--set config.epochs=1 --set config.train_samples=256 --quiet"],
                          cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout
    assert f"raylaunch: succeeded after 1 attempt(s); run directory {tmp_path}/demo-test" in out
    assert re.search(r'raylaunch: result \{"eval_accuracy": [0-9.]+, "steps": 8, "world_size": 2, ', out), out
    png = tmp_path / "demo-test" / "loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"raylaunch: wrote {png} (loss: demo-test)" in out
    table = out.split("NAME", 1)[1].splitlines()
    assert any(line.startswith("demo-test") and "succeeded" in line and "2 x 1" in line for line in table), out
    # local nodes end with the command: their ranks fork from their actors' own servers, no warm host is left
    hosts = {n["rank_host_pid"] for n in json.loads((tmp_path / "demo-test" / "result.json").read_text())["nodes"]}
    assert hosts == {None}, hosts
