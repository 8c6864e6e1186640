"""`auto` on a cluster that autoscales: the node types its autoscaler may start count, not only the nodes alive.

The project's cluster.yaml gives the head ``CPU: 0`` and GPU workers that scale from zero: with no worker alive yet,
a ``use_gpu: auto`` job must still ask for GPU bundles (and ``workers_per_node: auto`` for the GPUs of the type that
will hold it), and say while it waits that the autoscaler is starting them. Pure tests of the decision and of what
is said, then one run on Ray's own fake multi-node autoscaler (tests/autoscaling_head.py) from nothing alive but a
head with no CPU.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import yaml
from conftest import ROOT, TESTS, cli_env

from cluster.nodes.autoscaler import NodeType, _node_types_from_gcs, head_autoscaling_config, node_types_from_config
from cluster.nodes.placement import Placement, PlacementError, cpu_by_choice, decide_placement, waiting_line

HEAD = {"CPU": 0.0}  # cluster.yaml's head: the autoscaler runs there, no rank does


def shipped_types(gpu_worker: dict) -> list[NodeType]:
    """cluster.yaml's node types as the head's autoscaler reads them: ``ray up`` fills each type's resources from
    its instance type into ``~/ray_bootstrap_config.yaml`` (AWS's describe-instance-types)."""
    from ray.autoscaler._private.util import prepare_config

    config = prepare_config(yaml.safe_load((ROOT / "cluster.yaml").read_text()))  # as `ray up` does first
    config["available_node_types"]["gpu_worker"]["resources"] = gpu_worker
    return node_types_from_config(config)


def test_the_shipped_clusters_gpu_workers_count_before_any_is_alive():
    types = shipped_types({"CPU": 48, "GPU": 4, "memory": 150_000_000_000})  # g5.12xlarge
    assert [(t.name, t.resources["GPU"], t.max_nodes) for t in types] == [("gpu_worker", 4.0, 8)]
    placement = decide_placement(2, "auto", "auto", 1.0, [HEAD], types)
    assert (placement.use_gpu, placement.workers_per_node, placement.bundle) == (True, 4, {"CPU": 4.0, "GPU": 4.0})
    assert placement.world_size == 8
    # a fixed number of workers, GPUs still from the type
    assert decide_placement(2, 1, "auto", 1.0, [HEAD], types).bundle == {"CPU": 1.0, "GPU": 1.0}
    # before: the nodes alive alone (the head), CPU bundles the GPU workers would have trained on
    assert decide_placement(2, 1, "auto", 1.0, [HEAD]).use_gpu is False


def test_the_wait_says_the_autoscaler_is_starting_them_with_the_numbers():
    types = [NodeType("gpu_worker", {"CPU": 48.0, "GPU": 4.0}, 8)]
    placement = decide_placement(2, "auto", "auto", 1.0, [HEAD], types)
    assert waiting_line(placement, 0, placement.node_types, 600) == (
        "raylaunch: waiting for 2 nodes with 4 GPUs each: the autoscaler is starting them (node type gpu_worker; "
        "0 of the 2 can hold one now; up to 600 s, timeouts.placement_s)")
    one = Placement(3, 1, True, 1.0)
    assert waiting_line(one, 2, types, 60, "timeouts.resize_s").startswith(
        "raylaunch: waiting for 1 node with 1 GPU each: the autoscaler is starting them (node type gpu_worker; "
        "2 of the 3 can hold one now")
    # no type the autoscaler may start holds a bundle (or none is known): what every wait said before
    big = Placement(2, 8, True, 1.0)
    unknown = [NodeType("local.cluster.node", {}, 2)]  # resources the provider detects at start
    assert waiting_line(big, 0, types, 600) == waiting_line(big, 0, unknown, 600) == waiting_line(big, 0, None, 600) == (
        "raylaunch: waiting for 2 nodes with {'CPU': 8.0, 'GPU': 8.0}; 0 can hold one now, the cluster may add the "
        "rest (up to 600 s, timeouts.placement_s)")


def test_no_gpu_anywhere_the_cluster_can_start_is_cpu_as_before_said_once():
    cpus = [NodeType("cpu_worker", {"CPU": 8.0}, 4)]
    placement = decide_placement(2, "auto", "auto", 2.0, [HEAD], cpus)
    assert (placement.use_gpu, placement.workers_per_node, placement.bundle) == (False, 4, {"CPU": 8.0})
    assert cpu_by_choice(placement, "auto") == (
        "raylaunch: training on CPUs: scaling.use_gpu is auto and no node has a GPU, nor any node type the "
        "autoscaler may start (cpu_worker {CPU: 8} x4)")
    # asked for CPUs, or on a cluster without an autoscaler: nothing more to say than before
    assert cpu_by_choice(placement, False) is None
    assert cpu_by_choice(decide_placement(2, 1, "auto", 1.0, [{"CPU": 2.0}] * 2), "auto") is None
    # a type whose resources the provider detects only at start: nothing known to hold a GPU
    # (the on-premises local provider's one type, the head's too, as Ray's prepare_config makes it)
    unknown = node_types_from_config({"max_workers": 2, "head_node_type": "local.cluster.node", "available_node_types": {
        "local.cluster.node": {"node_config": {}, "resources": {}, "min_workers": 0, "max_workers": 2}}})
    assert [t.describe() for t in unknown] == ["local.cluster.node {resources unknown} x2"]
    assert decide_placement(2, 1, "auto", 1.0, [HEAD], unknown).use_gpu is False


def test_workers_per_node_auto_that_nothing_can_give_names_the_node_types():
    with pytest.raises(PlacementError) as info:
        decide_placement(2, "auto", True, 1.0, [HEAD], [NodeType("gpu_worker", {"CPU": 4.0, "GPU": 1.0}, 1)])
    assert str(info.value) == (
        "scaling.workers_per_node is 'auto' but no 2 nodes each have a GPU (nodes: {CPU: 0}; node types the "
        "autoscaler may start: gpu_worker {CPU: 4, GPU: 1} x1). Set scaling.workers_per_node to a number, or add "
        "nodes.")


def test_node_types_an_autoscaler_reported_to_the_gcs_are_read_the_same():
    """Later Ray versions' v2 autoscaler reports its worker types to the GCS (``ClusterConfig``); Ray 2.60's do not,
    so the head's own config file is read there (the run below)."""
    from ray.core.generated.autoscaler_pb2 import ClusterConfig, NodeGroupConfig

    config = ClusterConfig(node_group_configs=[
        NodeGroupConfig(name="gpu_worker", resources={"CPU": 48, "GPU": 4}, min_count=0, max_count=8),
        NodeGroupConfig(name="spot", resources={"CPU": 8}, max_count=-1),
        NodeGroupConfig(name="off", resources={"GPU": 8}, max_count=0)])
    assert [(t.name, dict(t.resources), t.max_nodes > 8) for t in _node_types_from_gcs(config)] == [
        ("gpu_worker", {"CPU": 48.0, "GPU": 4.0}, False), ("spot", {"CPU": 8.0}, True)]


def test_the_heads_autoscaler_config_is_the_one_its_process_was_started_with(tmp_path):
    """Read from /proc as ``ray up`` starts it: ``--autoscaling-config=~/ray_bootstrap_config.yaml``, the ``~`` the
    autoscaler's own home; a process of another cluster (another GCS address) is not taken for it."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "ray_bootstrap_config.yaml").write_text(yaml.safe_dump(
        {"max_workers": 2, "head_node_type": "head", "available_node_types": {
            "head": {"resources": {"CPU": 0}}, "gpu_worker": {"resources": {"CPU": 4, "GPU": 1}}}}))
    monitor = [sys.executable, "-c", "import time; time.sleep(60)"]  # named as Ray's autoscaler process is
    procs = [subprocess.Popen(["bash", "-c", 'exec -a "$0" "$@"', "/x/ray/autoscaler/v2/monitor.py", *monitor,
                               f"--gcs-address={address}", *config], env={**os.environ, "HOME": str(home)})
             for address, config in (("10.0.0.9:6379", ["--autoscaling-config=~/ray_bootstrap_config.yaml"]),
                                     ("10.0.0.9:7000", []))]
    try:
        deadline = time.monotonic() + 10
        while not all(head_autoscaling_config(a)[0] for a in ("10.0.0.9:6379", "10.0.0.9:7000")):
            assert time.monotonic() < deadline, "the stand-in processes did not start"
            time.sleep(0.1)
        seen, config = head_autoscaling_config("10.0.0.9:6379")
        assert seen and [t.describe() for t in node_types_from_config(config)] == ["gpu_worker {CPU: 4, GPU: 1} x2"]
        assert head_autoscaling_config("10.0.0.9:7000") == (True, None)  # a head that does not autoscale
        assert head_autoscaling_config("10.0.0.9:7001") == (False, None)  # no such head here
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _in_own_pid_namespace() -> list[str]:
    """``unshare`` into a PID namespace of the run's own (root): whatever the fake autoscaler's nodes leave ends
    with the script. Without root, the script ends what it started by its temporary folder alone."""
    if sys.platform == "linux" and os.geteuid() == 0 and shutil.which("unshare"):
        return ["unshare", "--pid", "--fork", "--mount-proc"]
    return []


def test_a_use_gpu_auto_job_from_zero_gpu_workers_gets_gpu_nodes_from_the_autoscaler(tmp_path):
    # A home of its own: a ~/.ray/auth_token on this machine (the README's `ray get-auth-token --generate`) turned
    # token authentication on for the fake head, which its own client, without the mode, was then refused by.
    proc = subprocess.run([*_in_own_pid_namespace(), sys.executable, str(TESTS / "autoscaling_head.py")],
                          cwd=ROOT, env={**cli_env(), "HOME": str(tmp_path)}, capture_output=True, text=True,
                          timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # the script removed its folder, but a node's last log line can bring it back before the namespace ends
    shutil.rmtree(out["temp"], ignore_errors=True)
    # as the head's autoscaler sees them: its worker type, none of it alive when the job asked
    assert out["node_types"] == [["gpu_worker", {"CPU": 1.0, "GPU": 1.0, "object_store_memory": 80000000.0}, 2]]
    assert out["read_on_head"] == [True, ["gpu_worker"]]  # a driver elsewhere reads it through a task on the head
    assert out["gpu_nodes_before"] == 0
    assert out["placement"] == {"use_gpu": True, "workers_per_node": 1, "bundle": {"CPU": 1.0, "GPU": 1.0}}
    assert out["said"][0] == ("raylaunch: waiting for 2 nodes with 1 GPU each: the autoscaler is starting them "
                              "(node type gpu_worker; 0 of the 2 can hold one now; up to 120 s, timeouts.placement_s)")
    # granted: a GPU bundle on each of two nodes the autoscaler started, each actor given its node's GPU
    assert out["bundles"] == [{"CPU": 1.0, "GPU": 1.0}] * 2
    assert out["bundle_nodes"] == 2 and out["bundle_nodes_gpus"] == [1.0, 1.0]
    assert out["actor_gpu_ids"] == [[0], [0]]
    # and the autoscaler took them down once the job had ended
    assert out["gpu_nodes_after"] == 0, out
