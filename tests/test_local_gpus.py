"""One machine with GPUs, on CPU: an embedded cluster (`raylaunch run` without --address) declares the machine's GPUs.

No GPU is needed: ``CUDA_VISIBLE_DEVICES`` and ``RAYLAUNCH_LOCAL_GPUS`` tell the embedded cluster what the machine has
(as ``nvidia-smi`` would on a GPU machine), Ray hands the ids out, and the job's first lines say how they were divided
and, for a run on CPUs, that GPUs sit idle and why.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT, cli_env

from cluster.errors import RaylaunchError
from cluster.nodes.connect import GPUS_VAR, divide_gpus, machine_gpus

# Connects an embedded cluster of 2 local nodes and reports, per node, the GPU ids Ray gives a task there.
NODES = """
import json, os, sys
import ray
from cluster.nodes.connect import connect
from cluster.nodes.placement import cpu_beside_gpus, resolve_placement

said = []
with connect(None, local_nodes=2, cpus_per_node=1.0, say=said.append):
    @ray.remote(num_gpus=1, num_cpus=0)
    def where():
        return ray.get_runtime_context().get_node_id(), [str(g) for g in ray.get_gpu_ids()], \\
            os.environ.get("CUDA_VISIBLE_DEVICES")
    nodes = sorted((n["NodeID"], n["Resources"].get("GPU", 0)) for n in ray.nodes() if n["Alive"])
    seen = ray.get([where.options(scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
        node, soft=False)).remote() for node, _ in nodes])
    auto = resolve_placement(2, "auto", "auto", 1.0)
    cpu = resolve_placement(2, 1, False, 1.0)
    print(json.dumps({"said": said, "gpus": [g for _, g in nodes], "seen": [[g, v] for _, g, v in seen],
                      "auto": [auto.use_gpu, auto.workers_per_node],
                      "cpu_note": cpu_beside_gpus(cpu, False, 0, True)}))
"""


def run_nodes(env: dict) -> dict:
    proc = subprocess.run([sys.executable, "-c", NODES], cwd=ROOT, env={**cli_env(), **env}, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_machines_gpus_are_divided_over_local_nodes_and_each_node_sees_its_own():
    out = run_nodes({"CUDA_VISIBLE_DEVICES": "3,5", GPUS_VAR: ""})
    assert out["said"] == ["raylaunch: this machine's 2 GPU(s) (CUDA_VISIBLE_DEVICES) over 2 local node(s): "
                           "node 0: GPU 3; node 1: GPU 5"]
    assert out["gpus"] == [1.0, 1.0]
    # each node's task sees its own device, named as the machine names it: node 0 GPU 3, node 1 GPU 5
    assert sorted(tuple(s) for s in out["seen"]) == [(["3"], "3"), (["5"], "5")]
    assert out["auto"] == [True, 1]  # use_gpu: auto trains on them, one worker per node
    assert out["cpu_note"] == ("raylaunch: training on CPUs although the cluster's nodes have 2 GPU(s): "
                               "scaling.use_gpu is false; set scaling.use_gpu: auto to train on them")


def test_a_run_on_cpus_beside_the_machines_gpus_says_so_and_why(tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text(f"name: cpu-beside\ntrain_fn: fns:probe\nscaling: {{num_nodes: 1, use_gpu: false}}\n"
                    f"storage: {tmp_path / 'runs'}\n")
    proc = subprocess.run([sys.executable, "-m", "jobs.cli", "run", str(spec), "--local-nodes", "2"], cwd=ROOT,
                          env={**cli_env(), GPUS_VAR: "3"}, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("raylaunch: this machine's 3 GPU(s) (RAYLAUNCH_LOCAL_GPUS) over 2 local node(s): node 0: GPU 0,1; "
            "node 1: GPU 2 (uneven: scaling.workers_per_node: auto takes what every node has)") in proc.stdout
    assert "(CPU, gloo)" in proc.stdout
    assert ("raylaunch: training on CPUs although the cluster's nodes have 3 GPU(s): scaling.use_gpu is false; "
            "set scaling.use_gpu: auto to train on them") in proc.stdout


def test_what_the_machine_has(monkeypatch):
    monkeypatch.delenv(GPUS_VAR, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert machine_gpus() == []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-1f2e,GPU-77aa")  # ids as UUIDs pass through
    assert machine_gpus() == ["GPU-1f2e", "GPU-77aa"]
    monkeypatch.setenv(GPUS_VAR, "1")
    assert machine_gpus() == ["GPU-1f2e"] and machine_gpus(override=False) == ["GPU-1f2e", "GPU-77aa"]
    monkeypatch.setenv(GPUS_VAR, "many")
    with pytest.raises(RaylaunchError, match="RAYLAUNCH_LOCAL_GPUS='many': give a whole number of GPUs"):
        machine_gpus()
    assert divide_gpus(["0", "1", "2", "3"], 2) == [["0", "1"], ["2", "3"]]
    assert divide_gpus(["0"], 3) == [["0"], [], []]
