"""cluster.yaml and cluster.onprem.yaml: Ray's own validation (what `ray up` runs first) and the
security settings. tests/test_cluster_aws.py runs Ray's AWS bootstrap on cluster.yaml; tests/test_rayup.py
brings cluster.onprem.yaml up for real."""

from __future__ import annotations

import copy
import fnmatch
import re
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = [ROOT / "cluster.yaml", ROOT / "cluster.onprem.yaml"]


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_ray_validates_the_config_with_its_defaults_filled(path):
    config = prepare_config(load(path))
    validate_config(config)
    assert config["head_node_type"] in config["available_node_types"]


def test_validation_is_not_a_rubber_stamp():
    broken = copy.deepcopy(load(ROOT / "cluster.yaml"))
    broken["available_node_types"]["gpu_worker"]["max_workers"] = "eight"
    with pytest.raises(jsonschema.ValidationError, match="'eight' is not of type 'integer'") as info:
        validate_config(prepare_config(broken))
    assert list(info.value.path) == ["available_node_types", "gpu_worker", "max_workers"]


def test_gpu_workers_scale_from_zero_and_the_head_never_trains():
    c = load(ROOT / "cluster.yaml")
    worker = c["available_node_types"]["gpu_worker"]
    assert worker["min_workers"] == 0 and worker["max_workers"] >= 1
    assert worker["node_config"]["InstanceType"].startswith(("g", "p"))
    assert c["available_node_types"]["head"]["resources"] == {"CPU": 0}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_dashboard_on_localhost_token_auth_and_threads_on_every_node(path):
    c = load(path)
    head = " ".join(c["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head
    for cmd in [head, " ".join(c["worker_start_ray_commands"])]:
        assert "RAY_AUTH_MODE=token" in cmd and "OMP_NUM_THREADS=" in cmd
    assert "~/.ray/auth_token" in c["file_mounts"]


def test_every_node_uses_the_prepared_security_group_never_one_ray_creates():
    """Ray's bootstrap opens SSH to 0.0.0.0/0 on any group it creates (tests/test_cluster_aws.py)."""
    c = load(ROOT / "cluster.yaml")
    assert "security_group" not in c["provider"]
    for node_type in c["available_node_types"].values():
        assert node_type["node_config"]["SecurityGroupIds"], node_type


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_the_copied_folder_leaves_out_what_uploads_leave_out(path):
    """`.rsync-filter` is the upload exclusion list; rsync_exclude holds only names that cannot be
    one of Ray's single-file copies (Ray applies it to the token and the SSH key too)."""
    from cluster.nodes.connect import UPLOAD_EXCLUDES

    c = load(path)
    assert c["rsync_filter"] == [".rsync-filter"]
    lines = [ln for ln in (ROOT / ".rsync-filter").read_text().splitlines() if ln and not ln.startswith("#")]
    assert lines == list(UPLOAD_EXCLUDES)
    assert set(c["rsync_exclude"]) <= set(UPLOAD_EXCLUDES)
    singles = ["auth_token", Path(c["auth"]["ssh_private_key"]).name, "ray_bootstrap_key.pem", "id_ed25519"]
    assert not [p for p in c["rsync_exclude"] for name in singles if fnmatch.fnmatch(name, p)]


def test_rsync_with_the_filter_leaves_secrets_behind_and_still_copies_the_token(tmp_path):
    """Real rsync, the arguments Ray builds from the cluster file: a project tree loses its secrets,
    caches and environments; a single-file copy of the token (as `file_mounts` makes) still works."""
    import shutil
    import subprocess

    from ray.autoscaler._private.command_runner import SSHCommandRunner

    if shutil.which("rsync") is None:
        pytest.skip("needs rsync (`.ci/run` installs it)")
    c = load(ROOT / "cluster.onprem.yaml")
    args = SSHCommandRunner._create_rsync_filter_args(None, {"rsync_exclude": c["rsync_exclude"],
                                                               "rsync_filter": c["rsync_filter"]})
    project = tmp_path / "project"
    for rel in ["train.py", "pkg/model.py", ".env", "pkg/.env.local", "deploy/id_ed25519", "certs/server.pem",
                ".aws/credentials", ".venv/bin/python", "pkg/__pycache__/m.pyc", "runs/r/result.json"]:
        (project / rel).parent.mkdir(parents=True, exist_ok=True)
        (project / rel).write_text("x")
    shutil.copy(ROOT / ".rsync-filter", project / ".rsync-filter")
    subprocess.run(["rsync", "-a", *args, f"{project}/", f"{tmp_path / 'copy'}/"], check=True)
    copied = sorted(str(p.relative_to(tmp_path / "copy")) for p in (tmp_path / "copy").rglob("*") if p.is_file())
    assert copied == [".rsync-filter", "pkg/model.py", "train.py"]
    (tmp_path / "laptop").mkdir()
    (tmp_path / "laptop" / "auth_token").write_text("token")
    subprocess.run(["rsync", "-a", *args, str(tmp_path / "laptop" / "auth_token"), str(tmp_path / "node_token")],
                   check=True)
    assert (tmp_path / "node_token").read_text() == "token"


def test_nodes_install_the_same_ray_as_this_machine_and_mount_shared_storage():
    c = load(ROOT / "cluster.yaml")
    setup = " ".join(c["setup_commands"])
    pinned = re.findall(r"ray\[default\]==([0-9.]+)", setup)
    assert pinned == [ray.__version__]
    assert "mount -t nfs4" in setup and "pip install --quiet -e ~/raylaunch" in setup
    assert "constraints" not in setup  # GPU nodes take the normal CUDA torch wheel
