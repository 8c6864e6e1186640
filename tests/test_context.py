"""Rank assignment and the rendezvous environment: pure, no processes."""

from __future__ import annotations

from collections import namedtuple

import pytest

from cluster.context import assign_ranks, choose_socket_interface, rendezvous_env


def test_node_zero_holds_the_first_ranks():
    ctxs = assign_ranks([2, 2, 1])
    assert [(c.world_rank, c.node_rank, c.local_rank) for c in ctxs] == [
        (0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1), (4, 2, 0)
    ]
    assert {c.world_size for c in ctxs} == {5}
    assert [c.local_world_size for c in ctxs] == [2, 2, 2, 2, 1]


def test_empty_or_zero_nodes_are_rejected():
    with pytest.raises(ValueError, match="at least one worker"):
        assign_ranks([2, 0])


def test_env_makes_accelerate_join_as_a_client_of_node_zero_store():
    ctx = assign_ranks([1, 1])[1]
    env = rendezvous_env(ctx, "10.0.0.1", 29500, use_gpu=False, omp_threads=2)
    assert env["RANK"] == "1" and env["WORLD_SIZE"] == "2" and env["NODE_RANK"] == "1"
    assert env["MASTER_ADDR"] == "10.0.0.1" and env["MASTER_PORT"] == "29500"
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert env["ACCELERATE_USE_CPU"] == "true" and env["OMP_NUM_THREADS"] == "2"
    assert "ACCELERATE_USE_CPU" not in rendezvous_env(ctx, "h", 1, use_gpu=True, omp_threads=1)


def test_nccl_flight_recorder_is_on_where_cuda_is_used_only():
    ctx = assign_ranks([1, 1])[1]
    gpu = rendezvous_env(ctx, "h", 1, use_gpu=True, omp_threads=1, flight_recorder="/tmp/n1/nccl-trace-rank")
    assert gpu["TORCH_FR_DUMP_TEMP_FILE"] == "/tmp/n1/nccl-trace-rank" and gpu["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert int(gpu["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0
    cpu = rendezvous_env(ctx, "h", 1, use_gpu=False, omp_threads=1, flight_recorder="/tmp/n1/nccl-trace-rank")
    assert not [k for k in cpu if k.startswith(("TORCH_NCCL", "TORCH_FR"))]


# A host like the issue's: loopback, Docker's bridge, a public and a private interface.
Addr = namedtuple("Addr", "family address netmask broadcast ptp")  # psutil's snicaddr
TABLE = {
    "lo": [Addr(2, "127.0.0.1", "255.0.0.0", None, None), Addr(10, "::1", None, None, None)],
    "docker0": [Addr(2, "172.17.0.1", "255.255.0.0", None, None)],
    "eth0": [Addr(17, "02:fc:00:00:00:01", None, None, None), Addr(2, "203.0.113.7", "255.255.255.0", None, None)],
    "eth1": [Addr(2, "10.77.0.2", "255.255.255.0", None, None), Addr(10, "fe80::1%eth1", None, None, None)],
}


def test_the_interface_is_the_one_that_carries_the_ray_address():
    got = choose_socket_interface("10.77.0.2", TABLE, use_gpu=False)
    assert (got.variable, got.name, got.source) == ("GLOO_SOCKET_IFNAME", "eth1", "ray-address")
    assert got.env == {"GLOO_SOCKET_IFNAME": "eth1"}
    assert "GLOO_SOCKET_IFNAME=eth1" in got.describe() and "10.77.0.2" in got.describe()
    assert choose_socket_interface("203.0.113.7", TABLE, use_gpu=False).name == "eth0"
    assert choose_socket_interface("fe80::1", TABLE, use_gpu=False).name == "eth1"


def test_on_gpus_nccl_gets_the_exact_name():
    got = choose_socket_interface("10.77.0.2", TABLE, use_gpu=True)
    assert got.env == {"NCCL_SOCKET_IFNAME": "=eth1"}  # a bare "eth1" would also match eth10


def test_the_spec_then_the_node_environment_win_over_the_ray_address():
    env = {"GLOO_SOCKET_IFNAME": "docker0", "NCCL_SOCKET_IFNAME": "ib0"}
    spec = choose_socket_interface("10.77.0.2", TABLE, use_gpu=False, configured="eth0", environ=env)
    assert spec.env == {"GLOO_SOCKET_IFNAME": "eth0"} and "rendezvous.socket_ifname" in spec.describe()
    node = choose_socket_interface("10.77.0.2", TABLE, use_gpu=True, environ=env)
    assert node.env == {"NCCL_SOCKET_IFNAME": "ib0"} and node.source == "environment"


def test_an_address_no_interface_carries_leaves_the_variable_unset_and_says_so():
    got = choose_socket_interface("192.0.2.9", TABLE, use_gpu=False)
    assert got.name is None and got.env == {}
    assert "rendezvous.socket_ifname" in got.describe()


def test_env_carries_the_interface_for_every_rank_of_the_node():
    ctx = assign_ranks([1, 1])[1]
    socket = choose_socket_interface("10.77.0.2", TABLE, use_gpu=False)
    env = rendezvous_env(ctx, "10.77.0.1", 29400, use_gpu=False, omp_threads=1, socket=socket)
    assert env["GLOO_SOCKET_IFNAME"] == "eth1" and env["MASTER_ADDR"] == "10.77.0.1"


class OnTheGpu:
    """A value still on a GPU, on CPU: ``item()`` waits until the GPU got there (``ready``)."""

    device = type("Device", (), {"type": "cuda"})()

    def __init__(self, value: float, ready) -> None:
        self.value, self.ready = value, ready

    def item(self) -> float:
        assert self.ready.wait(30), "the GPU never got there"
        return self.value


def test_a_metric_still_on_the_gpu_never_holds_the_training_thread(tmp_path):
    """session.log(loss) with loss a GPU tensor returns at once; a thread reads it when the GPU gets there, and the
    rows are written in the order they were logged."""
    import json
    import threading
    import time

    from cluster.runtime import Session

    session = Session(None, local_dir=tmp_path)
    ready = threading.Event()
    began = time.monotonic()
    session.log({"loss": OnTheGpu(1.5, ready)}, step=1)
    session.log({"lr": 0.1}, step=2)  # a plain value after it waits its turn
    assert time.monotonic() - began < 5  # not the 30 s item() would wait
    rows = lambda: [json.loads(line) for line in (tmp_path / "metrics-rank0.jsonl").read_text().splitlines()]
    assert rows() == []  # nothing read off the "GPU" yet
    ready.set()
    session.flush_metrics()
    assert [(r["step"], r["values"]) for r in rows()] == [(1, {"loss": 1.5}), (2, {"lr": 0.1})]
    assert rows()[0]["time"] <= rows()[1]["time"] < time.time()  # the time it was logged, not read
