"""Submission from a laptop: a real Ray head (dashboard on 127.0.0.1, token auth on) in a fixture."""

from __future__ import annotations

import json
import re
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

from cluster.nodes.connect import stop_processes_under
from conftest import ROOT, cli_env, free_ports, interruptible, wait_for
from cluster.nodes.upload import UploadError, plan_upload

SMALL = ["--set", "scaling.num_nodes=1", "--set", "scaling.workers_per_node=2", "--set", "config.epochs=1",
         "--set", "config.train_samples=256"]


def free_port() -> int:
    return free_ports(1)[0]


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """`ray start --head` with token authentication; stopped by PID at the end."""
    # A short path: Ray's Unix sockets live under it, and socket paths are capped at 107 bytes.
    temp = Path(tempfile.mkdtemp(prefix="rl-", dir="/tmp"))
    token = secrets.token_hex(16)
    port, listen, grpc, runtime_env, metrics = free_ports(5)
    env = cli_env()
    # its jobs' snapshots in memory in a folder of its own, removed with it (a stopped job's were left in /dev/shm)
    snapshots = Path(tempfile.mkdtemp(prefix="raylaunch-test-head-snapshots-",
                                      dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token, RAYLAUNCH_SNAPSHOT_DIR=str(snapshots),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}")
    started = subprocess.run([str(Path(sys.executable).parent / "ray"), "start", "--head", "--port=0", "--num-cpus=2",
                    "--dashboard-host=127.0.0.1", f"--dashboard-port={port}", f"--temp-dir={temp}",
                    "--include-dashboard=true", "--disable-usage-stats",
                    # not the fixed defaults: another Ray on this machine may hold them
                    f"--dashboard-agent-listen-port={listen}", f"--dashboard-agent-grpc-port={grpc}",
                    f"--runtime-env-agent-port={runtime_env}", f"--metrics-export-port={metrics}"],
                   env=env, capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
    gcs = re.search(r"--address='([^']+)'", started.stdout)
    try:
        yield {"address": f"http://127.0.0.1:{port}", "token": token, "temp": str(temp), "snapshots": snapshots}
    finally:
        stop_processes_under(str(temp))
        shutil.rmtree(temp, ignore_errors=True)
        shutil.rmtree(snapshots, ignore_errors=True)
    # every process of the cluster ended, its Ray Client server too (named by the GCS address only, it was left
    # behind, a child of init, by every `ray start --head` the tests and the benches stopped before 2026-12-06)
    assert gcs, started.stdout[-2000:]
    left = [p.pid for p in psutil.process_iter(["cmdline", "status"]) if p.info["status"] != psutil.STATUS_ZOMBIE
            and f"--address={gcs.group(1)}" in (p.info["cmdline"] or [])]
    assert not left, f"processes of the stopped cluster left: {left}"


def cli(head, *args, token: bool = True, timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    extra, env = env or {}, cli_env()
    env.pop("RAY_ADDRESS", None)
    env.update(extra)
    if token:
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=head["token"])
    else:
        env.pop("RAY_AUTH_MODE", None)
        env.pop("RAY_AUTH_TOKEN", None)
        env["HOME"] = head["temp"]  # no ~/.ray/auth_token either
    return subprocess.run([sys.executable, "-m", "jobs.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_submit_follow_trains_and_exits_with_the_job_status(head, tmp_path):
    proc = cli(head, "submit", "jobs/examples/digits.yaml", "--address", head["address"], "--follow",
               "--storage", str(tmp_path), *SMALL)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"run directory {tmp_path}/digits" in proc.stdout
    assert "submitted raylaunch-digits-" in proc.stdout and "succeeded" in proc.stdout
    assert "8/8" in proc.stdout and "loss=" in proc.stdout  # the progress bar: step of total, loss
    assert "[node 0 rank 0] eval accuracy" in proc.stdout  # rank-prefixed logs under it
    assert "raylaunch-event" not in proc.stdout  # the run's events are read, never shown
    result = json.loads((tmp_path / "digits" / "result.json").read_text())
    assert result["status"] == "succeeded" and result["world_size"] == 2
    assert result["goodput"]["seconds"]["training"] > 0
    job = proc.stdout.split("submitted ", 1)[1].split()[0]
    logs = cli(head, "logs", job, "--address", head["address"])
    assert logs.returncode == 0 and "[node 0 rank 0] eval accuracy" in logs.stdout
    assert "raylaunch-event" not in logs.stdout
    status = cli(head, "status", job, "--address", head["address"])
    assert status.returncode == 0 and f"{job}: SUCCEEDED" in status.stdout
    listed = cli(head, "list", "--address", head["address"])
    assert job in listed.stdout and "digits" in listed.stdout


def test_submit_of_an_accelerate_launch_script_follows_it_to_the_end(head, tmp_path):
    """`raylaunch submit` with a launch command: the spec is built on the laptop and sent whole; the script
    travels with the working directory and its save_state commits on the cluster's storage."""
    proc = cli(head, "submit", "--address", head["address"], "--follow", "--storage", str(tmp_path),
               "--num_processes", "2", "--cpu", "train_fn/digits_script.py", "--epochs", "1", "--train_samples",
               "128", "--output_dir", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "submitted raylaunch-digits_script-" in proc.stdout and "succeeded" in proc.stdout
    assert "4/4" in proc.stdout and "loss=" in proc.stdout  # the progress bar, from the script's accelerator.log
    run = Path(proc.stdout.split("run directory ", 1)[1].split()[0])
    assert run.parent == tmp_path and run.name.startswith("digits_script-")
    result = json.loads((run / "result.json").read_text())
    assert result["status"] == "succeeded" and result["world_size"] == 2
    assert (run / "checkpoints" / "checkpoint-00000004" / "manifest.json").is_file()
    assert json.loads((tmp_path / "out" / "result.json").read_text())["steps"] == 4


def test_a_failing_job_exits_non_zero_with_the_error(head, tmp_path):
    spec = ROOT / "tests" / "boom.yaml"
    spec.write_text(f"name: boom\ntrain_fn: tests.fns:fail_on_all_ranks\nscaling: {{num_nodes: 1, workers_per_node: 2}}\n"
                    f"storage: {tmp_path}\n")
    try:
        proc = cli(head, "submit", "tests/boom.yaml", "--address", head["address"], "--follow")
    finally:
        spec.unlink()
    assert proc.returncode == 1, proc.stdout
    assert "[ranks 0, 1] ValueError: bad batch shape (3, 4)" in proc.stdout
    assert "job raylaunch-boom-" in proc.stdout and "failed" in proc.stdout


def test_stop_records_stopped_and_leaves_no_rank_running(head, tmp_path):
    """`submit --follow` exits 3 when the job is stopped; Ctrl-C on `logs --follow` detaches and
    says how to reattach and stop, leaving the job running."""
    spec = ROOT / "tests" / "long.yaml"
    spec.write_text(f"name: long\ntrain_fn: tests.fns:steady\nscaling: {{num_nodes: 1, workers_per_node: 2}}\n"
                    f"config: {{steps: 100000, every: 20, step_s: 0.05, pid_dir: {tmp_path / 'pids'}}}\n"
                    f"storage: {tmp_path}\n")
    submitted, detached = tmp_path / "submit.out", tmp_path / "logs.out"
    clients: list[subprocess.Popen] = []
    try:
        try:
            following = cli_popen(head, submitted, "submit", "tests/long.yaml", "--address", head["address"],
                                  "--follow")
            clients.append(following)
            job = wait_for(lambda: "submitted " in submitted.read_text()
                           and submitted.read_text().split("submitted ", 1)[1].split()[0], 120, "the job id")
        finally:
            spec.unlink()
        latest = tmp_path / "long" / "checkpoints" / "latest.json"
        wait_for(latest.exists, 120, "a committed checkpoint")
        pids = [int((tmp_path / "pids" / f"rank-{r}.pid").read_text().split()[1]) for r in (0, 1)]
        logs = cli_popen(head, detached, "logs", job, "--follow", "--address", head["address"])
        clients.append(logs)
        wait_for(lambda: "raylaunch: step " in detached.read_text(), 120, "`logs --follow` to show progress")
        logs.send_signal(signal.SIGINT)  # Ctrl-C
        assert logs.wait(60) == 130
        said = detached.read_text()
        assert f"raylaunch: detached; {job} is still running." in said
        assert f"follow again: raylaunch logs {job} --follow --address {head['address']}" in said
        assert f"stop it:      raylaunch stop {job} --address {head['address']}" in said
        status = cli(head, "status", job, "--address", head["address"]).stdout
        assert f"{job}: RUNNING" in status
        # which process each rank is, from the laptop (#48): the driver's event in the job's log
        assert "ranks of attempt 1:" in status and all(f", pid {pid}" in status for pid in pids), status
        # where the live job's ranks are, from the laptop, through the dashboard alone
        stacks = cli(head, "stacks", job, "--address", head["address"], timeout=150)
        assert stacks.returncode == 0, stacks.stdout + stacks.stderr
        assert "run long: attempt 1, 2 ranks" in stacks.stdout and "could not be read" not in stacks.stdout
        assert all(f", pid {pid}" in stacks.stdout.split("where they run:")[1] for pid in pids), stacks.stdout
        assert not [j for j in job_ids(head) if "-stacks-" in j]  # the helper job that read them is not listed
        stop = cli(head, "stop", job, "--address", head["address"])
        assert stop.returncode == 0 and f"stopping {job}" in stop.stdout
        assert following.wait(120) == 3, submitted.read_text()[-3000:]  # the job's status: stopped
        assert f"raylaunch: job {job} stopped" in submitted.read_text()
    finally:
        for client in clients:
            if client.poll() is None:
                client.kill()
                client.wait()
    result_file = tmp_path / "long" / "result.json"
    # (the run directory's path holds the word "stopped" too: read the status itself)
    wait_for(lambda: result_file.exists() and json.loads(result_file.read_text())["status"] == "stopped", 60,
             "result.json: stopped")
    result = json.loads(result_file.read_text())
    assert result["status"] == "stopped" and "SIGTERM" in result["error"], result["error"]
    # a run is usually stopped because it looks stuck: where each rank was, before they stopped
    assert "where each rank was (every thread: " in result["error"] and "[ranks 0, 1] in " in result["error"] \
        or ("[rank 0] in " in result["error"] and "[rank 1] in " in result["error"]), result["error"]
    assert len(list((tmp_path / "long" / "logs").glob("stacks-1-*.txt"))) == 1
    assert result["checkpoints"]  # the last committed checkpoint is intact
    assert json.loads(latest.read_text())["name"] in result["checkpoints"][-1]
    wait_for(lambda: not any(psutil.pid_exists(p) for p in pids), 30, "every rank to end")
    # the stopped run's snapshots left the node's memory (its ranks wrote one more after they were dropped)
    held = [str(p) for p in (head["snapshots"] / "raylaunch-snapshots").glob("long-*/**/*")]
    assert not held, held


def cli_popen(head, out: Path, *args) -> subprocess.Popen:
    """The CLI in the background, its output (stdout and stderr) into ``out``."""
    env = cli_env()
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=head["token"])
    env.pop("RAY_ADDRESS", None)
    with open(out, "w") as f:
        return subprocess.Popen([sys.executable, "-m", "jobs.cli", *args], cwd=ROOT, env=env, stdout=f,
                                stderr=subprocess.STDOUT, preexec_fn=interruptible)


def job_ids(head) -> set[str]:
    listed = cli(head, "list", "--address", head["address"])
    assert listed.returncode == 0, listed.stderr  # a broken `list` must not read as "nothing was sent"
    return {line.split()[0] for line in listed.stdout.splitlines()}


def test_dry_run_sends_nothing(head):
    before = job_ids(head)
    # no --address: RAY_ADDRESS names the cluster; an argument with spaces stays one argument
    proc = cli(head, "submit", "jobs/examples/digits.yaml", "--dry-run", "--set", "scaling.num_nodes=4",
               "--set", "config.note=two words", "--fresh", env={"RAY_ADDRESS": head["address"]})
    assert proc.returncode == 0, proc.stderr
    assert f"address:       {head['address']}" in proc.stdout
    assert ("entrypoint:    python -m jobs.cli run --event-lines jobs/examples/digits.yaml --set scaling.num_nodes=4 "
            "--set 'config.note=two words' --fresh") in proc.stdout  # --fresh: a new run directory, on the cluster
    assert "nothing was sent" in proc.stdout
    assert job_ids(head) == before


def test_a_bad_spec_never_reaches_the_cluster(head):
    before = job_ids(head)
    proc = cli(head, "submit", "jobs/examples/digits.yaml", "--address", head["address"], "--set", "scaling.nodes=2")
    assert proc.returncode == 2 and "scaling.nodes: unknown key; did you mean 'num_nodes'?" in proc.stderr
    assert job_ids(head) == before


def test_without_the_token_the_cluster_refuses_and_we_say_how_to_get_one(head):
    proc = cli(head, "list", "--address", head["address"], token=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "requires Ray's token authentication" in proc.stderr and "ray get-auth-token" in proc.stderr


def test_clear_errors_for_a_dead_address_and_an_unknown_job(head):
    dead = cli(head, "list", "--address", f"http://127.0.0.1:{free_port()}")
    assert dead.returncode == 1 and "no Ray dashboard answers at" in dead.stderr and "Traceback" not in dead.stderr
    unknown = cli(head, "status", "raylaunch-nope", "--address", head["address"])
    assert unknown.returncode == 1 and "Traceback" not in unknown.stderr
    assert "raylaunch-nope" in unknown.stderr


def test_upload_leaves_out_what_does_not_belong_and_refuses_too_large(tmp_path):
    for rel in ["train.py", ".git/objects/x", ".venv/lib/y", "pkg/__pycache__/z.pyc", "runs/r/metrics.jsonl",
                "data/ignored.bin", "data/kept.csv"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    (tmp_path / ".gitignore").write_text("data/ignored.bin\n")
    assert plan_upload(tmp_path).files == 3  # train.py, data/kept.csv, .gitignore
    (tmp_path / "data" / "private").mkdir()
    (tmp_path / "data" / "private" / "secret.csv").write_text("x")
    (tmp_path / ".rayignore").write_text("data/private/\n")
    plan = plan_upload(tmp_path)
    assert plan.files == 4  # and .rayignore itself; data/private/ is left out
    big = tmp_path / "data" / "weights.bin"
    big.write_bytes(os.urandom(plan.limit + 2**20))
    with pytest.raises(UploadError, match=r"over Ray's upload limit of 100.0 MiB\. Largest: data/ \(101\.0 MiB\)"):
        from jobs.submit import plan_submit

        (tmp_path / "job.yaml").write_text("name: t\ntrain_fn: train_fn.digits:train\n")
        cwd = os.getcwd()
        os.chdir(tmp_path)
        try:
            plan_submit("job.yaml", [], "http://127.0.0.1:1")
        finally:
            os.chdir(cwd)


def test_a_secret_reaches_the_ranks_of_a_submitted_job_and_nothing_shows_it(head, tmp_path):
    """`env.secrets` read from the laptop's shell: every rank sees it; the job's entrypoint and
    metadata, --dry-run, the followed output, status and every file of the run directory do not."""
    import hashlib

    value = f"hf_{secrets.token_hex(12)}"
    env = {"RAYLAUNCH_TEST_HF_TOKEN": value}
    args = ["submit", "jobs/examples/digits.yaml", "--address", head["address"], "--storage", str(tmp_path),
            "--name", "env", "--set", "train_fn=tests.fns:env_probe",
            "--set", "config={var: WANDB_PROJECT, secret: RAYLAUNCH_TEST_HF_TOKEN}",
            "--set", "env.vars.WANDB_PROJECT=raylaunch-demo", "--set", "env.secrets=[RAYLAUNCH_TEST_HF_TOKEN]",
            "--set", "scaling.num_nodes=1", "--set", "scaling.workers_per_node=2"]
    dry = cli(head, *args, "--dry-run", env=env)
    assert dry.returncode == 0, dry.stderr
    assert "secrets RAYLAUNCH_TEST_HF_TOKEN (values from this shell" in dry.stdout and value not in dry.stdout
    proc = cli(head, *args, "--follow", env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "the secret is ***" in proc.stdout and value not in proc.stdout + proc.stderr
    result = json.loads((tmp_path / "env" / "result.json").read_text())
    assert len(result["rank_results"]) == 2
    for seen in result["rank_results"].values():
        assert seen["var"] == "raylaunch-demo"
        assert seen["secret_sha256"] == hashlib.sha256(value.encode()).hexdigest()
    assert not [p for p in (tmp_path / "env").rglob("*") if p.is_file() and value.encode() in p.read_bytes()]
    job = proc.stdout.split("submitted ", 1)[1].split()[0]
    status = cli(head, "status", job, "--address", head["address"])
    assert status.returncode == 0 and value not in status.stdout
    # Ray's own record of the job, read with its SDK in a process of its own (it caches the auth mode)
    read = ("import json, sys; from ray.job_submission import JobSubmissionClient as C; "
            "i = C(sys.argv[1]).get_job_info(sys.argv[2]); "
            "print(json.dumps({'entrypoint': i.entrypoint, 'metadata': i.metadata, 'runtime_env': i.runtime_env}))")
    seen = subprocess.run([sys.executable, "-c", read, head["address"], job], capture_output=True, text=True,
                          timeout=120, env={**cli_env(), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": head["token"]})
    assert seen.returncode == 0, seen.stderr[-2000:]
    info = json.loads(seen.stdout.strip().splitlines()[-1])
    assert value not in info["entrypoint"] and value not in json.dumps(info["metadata"] or {})
    # What Ray itself keeps, as docs/spec.md says (the job's environment): the job's runtime environment
    # carries the value
    assert info["runtime_env"]["env_vars"]["RAYLAUNCH_TEST_HF_TOKEN"] == value
