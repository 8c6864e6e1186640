"""The GPU path's plumbing, on CPU: Ray nodes that declare GPUs (logical resources).

No GPU is needed: Ray hands out GPU ids and sets ``CUDA_VISIBLE_DEVICES`` for what a node
declares. The ranks join with gloo here (this machine's torch has no NCCL); everything else is
what a GPU node gets: ``workers_per_node: auto`` counts the GPUs, each rank's device is
``cuda:LOCAL_RANK`` among the ids Ray gave its node, NCCL's interface variable is set.
"""

from __future__ import annotations

import time

import pytest

from cluster.nodes.connect import embedded_node
from cluster.nodes.group import NodeGroup, resolve_placement
from cluster.protocol import WorkerPayload


@pytest.fixture
def gpu_nodes(ray_cluster):
    """Two more nodes on the shared cluster, each declaring 2 GPUs; removed after the test."""
    nodes = [ray_cluster.add_node(**embedded_node(num_cpus=2, num_gpus=2)) for _ in range(2)]
    ray_cluster.wait_for_nodes()
    try:
        yield nodes
    finally:
        for node in nodes:
            ray_cluster.remove_node(node)


def test_auto_counts_the_gpus_and_each_rank_gets_its_own_device(gpu_nodes, tmp_path):
    placement = resolve_placement(2, "auto", "auto", 1.0)
    assert placement.use_gpu is True and placement.workers_per_node == 2 and placement.bundle["GPU"] == 2

    group = NodeGroup.create(placement, timeout_s=60, can_grow=False)
    try:
        for attempt in (1, 2, 3):
            def payload(ctx, events_path, attempt=attempt):
                return WorkerPayload(context=ctx, attempt=attempt, train_fn="fns:gpu_probe", config={},
                                     events_path=events_path, staging_uri=str(tmp_path / "staging"),
                                     restore_uri=None, backend="gloo")

            group.start(payload, attempt, 120, None)
            returns: dict[int, dict] = {}
            failures = []
            deadline = time.monotonic() + 180
            while len(returns) < 4 and not failures and time.monotonic() < deadline:
                for poll in group.poll(wait_s=1.0):
                    failures += poll.failures
                    returns.update(poll.returns)
            if not failures:
                break
            # Four gloo ranks meshing on a starved 2-core machine once lost a connection (about one run
            # in ten under load; twice in a row once, at load 6): not what this test is about; any other failure is.
            said = "\n".join(f"rank {f.rank}: {f.message}" for f in failures)
            assert attempt < 3 and all("Gloo connectFullMesh failed" in f.message for f in failures), said
            group.stop()
        assert sorted(returns) == [0, 1, 2, 3], f"ranks that returned: {sorted(returns)}"
    finally:
        group.shutdown()

    for node_rank, info in enumerate(group.infos):
        assert len(info.gpu_ids) == 2  # Ray gave the node's actor its bundle's GPUs
        ranks = [returns[r] for r in (2 * node_rank, 2 * node_rank + 1)]
        visible = ",".join(str(g) for g in info.gpu_ids)
        assert [r["CUDA_VISIBLE_DEVICES"] for r in ranks] == [visible, visible]
        # cuda:LOCAL_RANK among the node's visible ids: one GPU per rank, none shared
        devices = [info.gpu_ids[int(r["LOCAL_RANK"])] for r in ranks]
        assert sorted(devices) == sorted(info.gpu_ids)
        for r in ranks:
            assert r["LOCAL_WORLD_SIZE"] == "2" and r["WORLD_SIZE"] == "4"
            assert r["NCCL_SOCKET_IFNAME"] == f"={group.sockets[node_rank].name}"  # exact, NCCL's syntax
            assert r["GLOO_SOCKET_IFNAME"] is None and r["ACCELERATE_USE_CPU"] is None
            assert int(r["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0
