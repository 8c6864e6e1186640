"""cluster.yaml: Ray's own validation (what `ray up` runs first) and the security settings."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = [ROOT / "cluster.yaml", *sorted((ROOT / "cluster").glob("*.yaml"))]


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


def test_dashboard_on_localhost_token_auth_and_threads_on_every_node():
    c = load(ROOT / "cluster.yaml")
    head = " ".join(c["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head
    for cmd in [head, " ".join(c["worker_start_ray_commands"])]:
        assert "RAY_AUTH_MODE=token" in cmd and "OMP_NUM_THREADS=" in cmd
    assert "~/.ray/auth_token" in c["file_mounts"]


def test_ssh_is_not_open_to_the_world():
    c = load(ROOT / "cluster.yaml")
    ranges = [r["CidrIp"] for p in c["provider"]["security_group"]["IpPermissions"] for r in p["IpRanges"]]
    assert ranges and "0.0.0.0/0" not in ranges
    assert "0.0.0.0/0" not in (ROOT / "cluster.yaml").read_text().replace("never 0.0.0.0/0", "")


def test_nodes_install_the_same_ray_as_this_machine_and_mount_shared_storage():
    c = load(ROOT / "cluster.yaml")
    setup = " ".join(c["setup_commands"])
    pinned = re.findall(r"ray\[default\]==([0-9.]+)", setup)
    assert pinned == [ray.__version__]
    assert "mount -t nfs4" in setup and "pip install --quiet -e ~/raylaunch" in setup
    assert "constraints" not in setup  # GPU nodes take the normal CUDA torch wheel
