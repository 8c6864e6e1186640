"""Hostile or careless input through the installed `raylaunch` command: one clear error, exit 2,
no traceback of the runner's own, no secret echoed, nothing created on storage."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from conftest import cli_env

SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY"
RAYLAUNCH = str(Path(sys.executable).parent / "raylaunch")


def raylaunch(cwd: Path, *args: str, timeout: float = 120, umask: int | None = None) -> subprocess.CompletedProcess:
    env = cli_env()
    env["PYTHONPATH"] = ""  # what a user has: the installed command and the project folder
    return subprocess.run([RAYLAUNCH, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                          preexec_fn=None if umask is None else (lambda: os.umask(umask)))


def project(tmp_path: Path, spec: str = "", files: dict[str, str] | None = None) -> Path:
    root = tmp_path / "project"
    root.mkdir(exist_ok=True)
    (root / "mytrain.py").write_text(
        "from accelerate import Accelerator\n"
        "from cluster.runtime import get_session\n\n\n"
        "def train(config):\n"
        "    accelerator = Accelerator(**get_session().accelerator_kwargs())\n"
        "    get_session().log({'loss': 1.0}, step=1)\n"
        "    return {'world': accelerator.num_processes}\n")
    (root / "job.yaml").write_text(spec or "name: mine\ntrain_fn: mytrain:train\n"
                                           "scaling: {num_nodes: 1, workers_per_node: 1}\n")
    for rel, text in (files or {}).items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def assert_refused(proc: subprocess.CompletedProcess, *texts: str) -> None:
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    for text in texts:
        assert text in proc.stderr, proc.stderr[-2000:]


def test_credentials_in_a_storage_uri_are_refused_and_never_echoed(tmp_path):
    root = project(tmp_path)
    runs = tmp_path / "runs"
    cases = [
        ("--storage", f"s3://AKIAEXAMPLE:{SECRET}@bucket/runs", "a user:password@ part before the bucket"),
        ("--storage", f"s3://bucket/runs?endpoint_override=minio:9000&secret_key={SECRET}",
         "the query key 'secret_key'"),
        ("--storage", f"gs://bucket/runs?access_token={SECRET}", "the query key 'access_token'"),
    ]
    for flag, storage, what in cases:
        for verb in (["validate", "job.yaml"], ["run", "job.yaml"],
                     ["submit", "job.yaml", "--address", "http://127.0.0.1:1", "--dry-run"]):
            proc = raylaunch(root, *verb, flag, storage)
            assert_refused(proc, f"storage: the URI holds credentials ({what})", "own credential chain")
            assert SECRET not in proc.stdout + proc.stderr, verb
    # runs, show and plot take --storage without a spec: refused the same way
    for verb in (["runs"], ["show", "mine"], ["plot", "mine"]):
        proc = raylaunch(root, *verb, "--storage", f"s3://AKIAEXAMPLE:{SECRET}@bucket/runs")
        assert_refused(proc, "the storage URI holds credentials (a user:password@ part before the bucket)")
        assert SECRET not in proc.stdout + proc.stderr, verb
    # in the spec file itself, too
    (root / "job.yaml").write_text(f"name: mine\ntrain_fn: mytrain:train\nstorage: s3://k:{SECRET}@b/runs\n")
    proc = raylaunch(root, "run", "job.yaml")
    assert_refused(proc, "storage: the URI holds credentials")
    assert SECRET not in proc.stdout + proc.stderr
    assert not runs.exists() and not list(root.glob("**/spec.yaml"))


def test_name_and_storage_are_literal_strings(tmp_path):
    root = project(tmp_path)
    proc = raylaunch(root, "validate", "job.yaml", "--name", "exp #3")
    assert_refused(proc, "name: 'exp #3' must start with a letter or digit, then letters, digits")  # never 'exp'
    proc = raylaunch(root, "validate", "job.yaml", "--name", "2024", "--storage", str(tmp_path / "a #b"))
    assert proc.returncode == 0, proc.stderr
    assert "ok (2024: 1 nodes x 1 workers" in proc.stdout and f"storage {tmp_path}/a #b" in proc.stdout
    # and submit hands them on as the same literal flags
    proc = raylaunch(root, "submit", "job.yaml", "--address", "http://127.0.0.1:1", "--dry-run",
                     "--name", "2024", "--storage", str(tmp_path / "a #b"))
    assert proc.returncode == 0, proc.stderr
    assert f"run --event-lines job.yaml --storage '{tmp_path}/a #b' --name 2024" in proc.stdout


def test_numbers_must_be_finite_and_sane(tmp_path):
    root = project(tmp_path)
    proc = raylaunch(root, "validate", "job.yaml", "--set", "timeouts.heartbeat_s=.inf",
                     "--set", "scaling.cpus_per_worker=1e300", "--set", "scaling.num_nodes=100000000000000000000",
                     "--set", "timeouts.placement_s=.nan")
    assert_refused(proc, "timeouts.heartbeat_s: must be a finite number, at most 2.592e+06 seconds, got inf",
                   "scaling.cpus_per_worker: must be at most 1024, got 1e+300",
                   "scaling.num_nodes: must be at most 10000, got 100000000000000000000",
                   "timeouts.placement_s: must be a finite number")


def test_alias_bomb_is_refused_quickly_and_errors_stay_short(tmp_path):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 10):  # 10**10 values once expanded, in a 600-byte file
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    root = project(tmp_path, "name: bomb\ntrain_fn: mytrain:train\nconfig:\n  " + "\n  ".join(lines) + "\n")
    start = time.monotonic()
    proc = raylaunch(root, "validate", "job.yaml")
    assert_refused(proc, "expands to more than 100,000 values (YAML aliases")
    assert time.monotonic() - start < 60
    # a huge value in an error is cut short
    (root / "job.yaml").write_text("name: mine\ntrain_fn: mytrain:train\n")
    proc = raylaunch(root, "validate", "job.yaml", "--set", "scaling.num_nodes=" + "9" * 100_000 + "x")
    assert_refused(proc, "scaling.num_nodes: expected an integer, got a string '99999")
    assert len(proc.stderr) < 2000


def test_not_utf8_relative_module_and_syntax_error(tmp_path):
    root = project(tmp_path, files={"broken.py": "def train(config):\n    return (\n"})
    (root / "latin1.yaml").write_bytes("name: caf\xe9\ntrain_fn: mytrain:train\n".encode("latin-1"))
    assert_refused(raylaunch(root, "validate", "latin1.yaml"), "not UTF-8 text (byte 0xe9 at offset 9)")
    assert_refused(raylaunch(root, "validate", "job.yaml", "--set", "train_fn=.mytrain:train"),
                   "train_fn: '.mytrain:train' must be an absolute module path")
    proc = raylaunch(root, "run", "job.yaml", "--set", "train_fn=broken:train", "--storage", str(tmp_path / "runs"))
    assert_refused(proc, "broken.py line 2: SyntaxError", "Fix `train_fn`")
    assert not (tmp_path / "runs").exists()


def test_validate_runs_none_of_the_packages_code(tmp_path):
    marker = tmp_path / "imported"
    root = project(tmp_path, files={
        "mypkg/__init__.py": f"open({str(marker)!r}, 'w').write('ran')\n",
        "mypkg/train.py": f"open({str(marker)!r}, 'w').write('ran')\n\ndef main(config):\n    return 1\n",
    })
    proc = raylaunch(root, "validate", "job.yaml", "--set", "train_fn=mypkg.train:main")
    assert proc.returncode == 0, proc.stderr
    assert not marker.exists()
    assert_refused(raylaunch(root, "validate", "job.yaml", "--set", "train_fn=mypkg.train:mian"),
                   "has no function 'mian'; it defines: main")


def test_a_project_with_its_own_jobs_cluster_train_fn_folders_and_a_stray_pyarrow(tmp_path):
    """Folders and a module named like the runner's own, each of which fails loudly if imported:
    the run trains (driver, node actor and rank use the runner's packages), and runs/show/plot
    never put the folder on the path."""
    boom = "raise RuntimeError('the project shadowed the runner: {}')\n"
    files = {f"{name}/__init__.py": boom.format(name) for name in ("jobs", "cluster", "train_fn")}
    root = project(tmp_path, files=files)
    runs = tmp_path / "runs"
    proc = raylaunch(root, "run", "job.yaml", "--quiet", "--storage", str(runs), timeout=240, umask=0o077)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert json.loads((runs / "mine" / "result.json").read_text())["rank_results"] == {"0": {"world": 1}}
    # what the runner wrote follows the user's umask (077: nothing for group or others)
    written = [p for p in (runs / "mine").rglob("*")]
    assert written and not [p for p in written if p.stat().st_mode & 0o077], "group/other bits under umask 077"
    (root / "pyarrow.py").write_text(boom.format("pyarrow"))
    for verb in (["runs", "--storage", str(runs)], ["show", "mine", "--storage", str(runs)],
                 ["plot", "mine", "-o", str(tmp_path / "p.png"), "--storage", str(runs)]):
        proc = raylaunch(root, *verb)
        assert proc.returncode == 0 and "shadowed" not in proc.stderr, (verb, proc.stderr[-2000:])
    assert "mine" in raylaunch(root, "runs", "--storage", str(runs)).stdout


def test_show_and_plot_apply_the_run_name_rules(tmp_path):
    """A run directory outside the storage (with a spec.yaml, so it would read) is never reached."""
    outside = tmp_path / "elsewhere" / "secret-run"
    outside.mkdir(parents=True)
    (outside / "spec.yaml").write_text("name: secret-run\ntrain_fn: m:f\n")
    (outside / "result.json").write_text('{"status": "succeeded"}')
    storage = tmp_path / "storage"
    storage.mkdir()
    for verb in (["show", "../elsewhere/secret-run"], ["plot", "../elsewhere/secret-run", "-o", str(tmp_path / "p.png")]):
        proc = raylaunch(tmp_path, *verb, "--storage", str(storage))
        assert_refused(proc, "run name '../elsewhere/secret-run' must start with a letter or digit")
        assert "succeeded" not in proc.stdout
