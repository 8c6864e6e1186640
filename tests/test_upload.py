"""The working-directory upload: one plan for `run --address` and `submit`, on real folders.

No cluster is needed: every check here happens before anything connects or is packaged.
"""

from __future__ import annotations

import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from cluster.nodes.upload import SECRET_PATTERNS, UPLOAD_EXCLUDES, UploadError, plan_upload
from conftest import cli_env, free_ports

SECRET = "AKIAQQQQ-very-secret-value-7f3a"

PROJECT_FILES = {
    "mytrain.py": "def train(config):\n    return {'ok': 1}\n",
    "job.yaml": "name: mine\ntrain_fn: mytrain:train\nscaling: {num_nodes: 1, workers_per_node: 1}\n",
    "data/kept.csv": "a,b\n1,2\n",
    # secrets, each holding the secret string
    ".env": f"AWS_SECRET_ACCESS_KEY={SECRET}\n",
    ".env.production": f"TOKEN={SECRET}\n",
    "deploy/id_ed25519": SECRET,
    "certs/server.pem": SECRET,
    "certs/tls.key": SECRET,
    ".aws/credentials": f"[default]\naws_secret_access_key = {SECRET}\n",
    ".ssh/id_rsa": SECRET,
    ".netrc": f"machine x login y password {SECRET}\n",
    ".pypirc": f"[pypi]\npassword = {SECRET}\n",
    ".ray/auth_token": SECRET,
    "gcp/application_default_credentials.json": SECRET,
    # what never belongs in an upload
    ".venv/lib/site.py": "x",
    "pkg/__pycache__/m.cpython-311.pyc": "x",
    "runs/old/metrics.jsonl": "{}",
    "out/storage/mine/result.json": "{}",
    # a Ray temporary folder (`ray start --temp-dir=./raytmp`), as Ray lays it out
    "raytmp/session_2026-11-30_10-00-00_000000_1/logs/raylet.out": "log",
    "raytmp/session_latest/logs/raylet.out": "log",
    # the user's own folder named like one of the runner's packages
    "cluster/helpers.py": "x = 1\n",
}


def make_project(root: Path, extra: dict[str, str] | None = None) -> Path:
    for rel, text in {**PROJECT_FILES, **(extra or {})}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def uploaded_by_ray(root: Path, excludes: list[str], tmp: Path) -> set[str]:
    """What Ray's own packaging (the code `ray.init` and the Jobs SDK run) puts in the zip."""
    from ray._private.runtime_env.packaging import _zip_files

    out = tmp / "pkg.zip"
    _zip_files(str(root), excludes, str(out), include_gitignore=True)
    with zipfile.ZipFile(out) as z:
        return {n.rstrip("/") for n in z.namelist() if not n.endswith("/")}


def test_the_plan_leaves_out_secrets_ray_temp_storage_and_junk_and_ray_zips_the_same(tmp_path):
    project = make_project(tmp_path / "project")
    plan = plan_upload(project, storage=str(project / "out" / "storage"))
    shipped = uploaded_by_ray(project, plan.excludes, tmp_path)
    assert shipped == {"mytrain.py", "job.yaml", "data/kept.csv"}
    assert plan.files == 3
    for secret in [".env", ".env.production", "deploy/id_ed25519", "certs/server.pem", "certs/tls.key",
                   ".aws/", ".ssh/", ".netrc", ".pypirc", ".ray/", "gcp/application_default_credentials.json"]:
        assert secret in plan.secrets, secret
    assert "raytmp/ (a Ray temporary folder)" in plan.left_out
    assert "out/storage/ (the run storage)" in plan.left_out
    assert any(line.startswith("cluster (named like raylaunch's own package") for line in plan.left_out)
    # one list (plain gitignore patterns, what rsync reads too): every secret pattern is in
    # UPLOAD_EXCLUDES, which the plan hands to Ray first
    assert set(SECRET_PATTERNS) <= set(UPLOAD_EXCLUDES) and plan.excludes[: len(UPLOAD_EXCLUDES)] == UPLOAD_EXCLUDES


def test_a_secret_file_is_uploaded_only_when_rayignore_includes_it_by_name(tmp_path):
    project = make_project(tmp_path / "project", {".rayignore": "!certs/server.pem\n"})
    plan = plan_upload(project)
    shipped = uploaded_by_ray(project, plan.excludes, tmp_path)
    assert "certs/server.pem" in shipped and "certs/server.pem" not in plan.secrets
    assert "certs/tls.key" not in shipped and ".env" not in shipped


def test_too_large_is_refused_before_packaging_naming_the_largest_folders(tmp_path):
    project = make_project(tmp_path / "project")
    limit = plan_upload(project).limit
    # sparse files: gigabytes that take no disk
    with open(project / "data" / "huge.bin", "wb") as f:
        f.truncate(10 * limit)
    with open(project / "raytmp" / "session_latest" / "logs" / "big.out", "wb") as f:
        f.truncate(50 * limit)  # inside Ray's temporary folder: never counted, never zipped
    start = time.monotonic()
    plan = plan_upload(project)
    with pytest.raises(UploadError) as info:
        plan.check()
    assert time.monotonic() - start < 30  # refused from sizes alone, nothing zipped
    text = str(info.value)
    assert "1000.0 MiB before compression, over Ray's upload limit of 100.0 MiB" in text
    assert "Largest: data/ (1000.0 MiB)" in text and "raytmp" not in text
    assert ".rayignore" in text


def run_cli(cwd: Path, *args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).parent / "raylaunch"), *args], cwd=cwd,
                          env=env or cli_env(), capture_output=True, text=True, timeout=timeout)


def test_submit_dry_run_lists_what_is_left_out_as_secret_and_never_the_secret(tmp_path):
    project = make_project(tmp_path / "project")
    proc = run_cli(project, "submit", "job.yaml", "--address", f"http://127.0.0.1:{free_ports(1)[0]}",
                   "--dry-run", "--storage", str(tmp_path / "runs"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "left out as secret (11; a `!` line in .rayignore includes one): " in out
    assert ".env, .env.production" in out and ".ssh/" in out and "certs/server.pem" in out
    assert "raytmp/ (a Ray temporary folder)" in out
    assert "largest:       " in out and "data/" in out
    assert "nothing was sent" in out
    assert SECRET not in out + proc.stderr


def test_run_address_checks_the_same_plan_before_connecting(tmp_path):
    """`run --address` once zipped the Ray head's temp folder while Ray wrote to it (78 GB):
    now the same plan and size check as submit run first, with the same message."""
    project = make_project(tmp_path / "project")
    with open(project / "data" / "huge.bin", "wb") as f:
        f.truncate(2**30)
    proc = run_cli(project, "run", "job.yaml", "--address", f"127.0.0.1:{free_ports(1)[0]}",
                   "--storage", str(tmp_path / "runs"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "over Ray's upload limit of 100.0 MiB. Largest: data/ (1024.0 MiB)" in proc.stderr
    assert "Traceback" not in proc.stderr
    submit = run_cli(project, "submit", "job.yaml", "--address", "http://127.0.0.1:1", "--dry-run")
    assert submit.returncode == 2 and "over Ray's upload limit of 100.0 MiB. Largest: data/ (1024.0 MiB)" in submit.stderr


def test_token_mode_without_a_token_says_exactly_that(tmp_path):
    project = make_project(tmp_path / "project")
    env = cli_env()
    env.update(RAY_AUTH_MODE="token", HOME=str(tmp_path / "home"))
    env.pop("RAY_AUTH_TOKEN", None)
    env.pop("RAY_AUTH_TOKEN_PATH", None)
    address = f"http://127.0.0.1:{free_ports(1)[0]}"  # nothing listens there
    for args in (["list", "--address", address],
                 ["run", "job.yaml", "--address", address.removeprefix("http://"), "--storage", str(tmp_path / "r")]):
        proc = run_cli(project, *args, env=env)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert "RAY_AUTH_MODE=token is set but no token was found" in proc.stderr
        assert f"{tmp_path}/home/.ray/auth_token does not exist or is empty" in proc.stderr
        assert "Traceback" not in proc.stderr
