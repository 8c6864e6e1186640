"""A Ray head with Ray's fake multi-node autoscaler (the provider Ray's own autoscaler tests use), and a job's
placement on it, from nothing alive but the head; run as a script, prints what it saw as one JSON line.

``ray.cluster_utils.AutoscalingCluster`` starts and stops the same head with ``ray stop --force``, which ends every
Ray process of the machine (other tests' clusters included), and reads a config file PyPI's wheel lacks: this script
writes the config itself, starts the head with its own ports and temporary folder, and ends what it started by that
folder (tests/test_autoscale.py runs it in a PID namespace of its own where it can, which ends the rest with it).

The cluster is the shape of the project's cluster.yaml: a head with ``CPU: 0`` and one worker type declaring a GPU,
``min_workers: 0``. The job asks ``use_gpu: auto`` and ``workers_per_node: auto`` on 2 nodes; a declared GPU cannot
train here (no CUDA): what was asked and granted is what it reports, and the GPU ids Ray gave each node's actor.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ray
from conftest import ROOT, TESTS, free_ports

from cluster.nodes.autoscaler import HEAD_RESOURCE, launchable_node_types, node_types_from_config, read_on_head
from cluster.nodes.connect import stop_processes_under
from cluster.nodes.group import NodeGroup
from cluster.nodes.placement import resolve_placement

GPU_TYPE = {"resources": {"CPU": 1, "GPU": 1, "object_store_memory": 80_000_000}, "node_config": {},
            "min_workers": 0, "max_workers": 2}


def config(gcs_address: str) -> dict:
    """The fake provider's cluster config (the wheel lacks Ray's example.yaml): the head, and the GPU type."""
    return {
        "cluster_name": "raylaunch-fake", "max_workers": 2, "upscaling_speed": 1.0, "idle_timeout_minutes": 0.05,
        # the head's address: the provider's nodes connect to port 6379 otherwise
        "provider": {"type": "fake_multinode", "gcs_address": gcs_address, "use_node_id_as_ip": True,
                     "disable_node_updaters": True, "disable_launch_config_check": True,
                     "launch_multiple": True},  # both nodes in one launch, not one per autoscaler round
        "available_node_types": {"head": {"resources": {"CPU": 0}, "node_config": {}, "max_workers": 0},
                                 "gpu_worker": GPU_TYPE},
        "head_node_type": "head", "auth": {}, "docker": {}, "file_mounts": {}, "cluster_synced_files": [],
        "file_mounts_sync_continuously": False, "rsync_exclude": [], "rsync_filter": [],
        "initialization_commands": [], "setup_commands": [], "head_setup_commands": [], "worker_setup_commands": [],
        "head_start_ray_commands": [], "worker_start_ray_commands": [],
    }


def gpu_nodes() -> int:
    return sum(1 for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("GPU", 0) > 0)


def main() -> dict:
    began = time.monotonic()
    temp = tempfile.mkdtemp(prefix="rlas-", dir="/tmp")  # short: Ray's Unix sockets live under it
    ip = ray.util.get_node_ip_address()
    port, client, agent = free_ports(3)
    path = Path(temp) / "autoscaling.yaml"
    path.write_text(json.dumps(config(f"{ip}:{port}")))
    env = {**os.environ, "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}
    env.pop("RAY_ADDRESS", None)
    out: dict = {"temp": temp}
    try:
        started = subprocess.run(
            [str(Path(sys.executable).parent / "ray"), "start", "--head", f"--node-ip-address={ip}", f"--port={port}",
             f"--temp-dir={temp}", f"--autoscaling-config={path}", "--num-cpus=0", "--include-dashboard=false",
             f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent}",
             "--object-store-memory=80000000", "--disable-usage-stats"],
            env=env, capture_output=True, text=True, timeout=120)
        assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
        out["head_s"] = round(time.monotonic() - began, 1)
        ray.init(address=f"{ip}:{port}", log_to_driver=False, configure_logging=False,
                 runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)])}})
        out["gpu_nodes_before"] = gpu_nodes()
        out["node_types"] = [[t.name, dict(t.resources), t.max_nodes] for t in launchable_node_types() or ()]
        # the same, read by a task on the head (a driver that runs elsewhere)
        head = next(n["NodeID"] for n in ray.nodes() if n.get("Alive") and HEAD_RESOURCE in n["Resources"])
        seen, read = read_on_head(head, ray.get_runtime_context().gcs_address, 60)
        out["read_on_head"] = [seen, [t.name for t in node_types_from_config(read or {})]]
        placement = resolve_placement(2, "auto", "auto", 1.0, can_grow=True)
        out["placement"] = {"use_gpu": placement.use_gpu, "workers_per_node": placement.workers_per_node,
                            "bundle": placement.bundle}
        said: list[str] = []
        asked = time.monotonic()
        group = NodeGroup.create(placement, timeout_s=120, can_grow=True, on_wait=said.append)
        out["said"], out["granted_s"] = said, round(time.monotonic() - asked, 1)
        try:
            # the cluster is this script's alone: the job's group is its one placement group
            (table,) = [t for t in ray.util.placement_group_table().values() if t["state"] == "CREATED"]
            resources = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n.get("Alive")}
            out["bundles"] = [table["bundles"][i] for i in sorted(table["bundles"])]
            out["bundle_nodes"] = len(set(table["bundles_to_node_id"].values()))
            out["bundle_nodes_gpus"] = [resources[table["bundles_to_node_id"][i]].get("GPU", 0)
                                        for i in sorted(table["bundles_to_node_id"])]
            # what Ray gave each node's actor, which its ranks inherit as CUDA_VISIBLE_DEVICES (the ranks' own
            # environment from those ids: tests/test_gpu_plumbing.py)
            out["actor_gpu_ids"] = [list(info.gpu_ids) for info in group.infos]
        finally:
            group.shutdown()
        ended = time.monotonic()
        while gpu_nodes() and time.monotonic() - ended < 90:  # idle_timeout_minutes: 0.05
            time.sleep(0.5)
        out["gpu_nodes_after"], out["scaled_down_s"] = gpu_nodes(), round(time.monotonic() - ended, 1)
    finally:
        ray.shutdown()
        out["stopped"] = stop_processes_under(temp, timeout_s=3)
        shutil.rmtree(temp, ignore_errors=True)
        out["total_s"] = round(time.monotonic() - began, 1)
        print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
