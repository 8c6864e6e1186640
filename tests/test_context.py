"""Rank assignment and the rendezvous environment: pure, no processes."""

from __future__ import annotations

import pytest

from cluster.context import assign_ranks, rendezvous_env


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
