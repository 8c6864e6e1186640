"""The GPU path of a hang, for `make gpu-check` on a machine with 2 or more GPUs (skipped
elsewhere, saying why): a hung NCCL collective ends the run at `timeouts.collective_s` with every
rank's stack in the error, and the ranks' NCCL Flight Recorder dumps land in the run directory
beside the stacks file. It has not run yet: no GPU was available to this project."""

from __future__ import annotations

import os
import time

import pytest
import torch

from conftest import ROOT, TESTS
from jobs.driver.driver import Driver
from jobs.spec import load_spec_text

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2,
                                reason="needs 2 CUDA GPUs: run `make gpu-check` on a GPU machine")


@pytest.fixture(scope="module")
def gpu_cluster():
    """One Ray node with this machine's first two GPUs."""
    import ray
    from ray.cluster_utils import Cluster

    from cluster.nodes.connect import embedded_node

    cluster = Cluster(initialize_head=True, head_node_args=embedded_node(num_cpus=4, num_gpus=2))
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)])}})
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_a_hung_nccl_collective_leaves_every_ranks_stack_and_its_flight_recorder_dump(gpu_cluster, tmp_path):
    spec = load_spec_text("name: gpuhang\ntrain_fn: fns:hang_in_data\n"
                          "scaling: {num_nodes: 1, workers_per_node: 2, use_gpu: true}\n"
                          f"failure: {{max_restarts: 0}}\ntimeouts: {{collective_s: 10}}\nstorage: {tmp_path}\n")
    began = time.monotonic()
    result = Driver(spec, can_grow=False).run()
    assert time.monotonic() - began < 180
    assert result.status == "failed", result.error
    where = result.error.split("where each rank was (every thread: ", 1)[1]
    assert "[rank 1] in _SlowOnRank1.__getitem__ (fns.py:" in where  # the odd one out, named
    logs = tmp_path / "gpuhang" / "logs"
    assert len(list(logs.glob("stacks-1-*.txt"))) == 1
    dumps = list(logs.glob("nccl-trace-1-*-rank0"))  # rank 0 timed out in the all-reduce and dumped
    assert dumps and dumps[0].stat().st_size > 0, sorted(p.name for p in logs.iterdir())
