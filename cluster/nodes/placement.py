"""Placement: how many nodes with how much each, read from the cluster, and reserving them (one
STRICT_SPREAD bundle per node), or an error with the numbers of what is missing."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Collection

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from cluster.errors import RaylaunchError

__all__ = ["Placement", "PlacementError", "cpu_beside_gpus", "fitting_nodes", "reserve", "resolve_placement"]


class PlacementError(RaylaunchError, RuntimeError):
    """The cluster cannot give the nodes the job asks for; the message has the numbers."""


@dataclass(frozen=True)
class Placement:
    """A resolved request: ``num_nodes`` bundles of ``bundle`` resources, one per node."""

    num_nodes: int
    workers_per_node: int
    use_gpu: bool
    cpus_per_worker: float

    @property
    def bundle(self) -> dict[str, float]:
        b = {"CPU": self.workers_per_node * self.cpus_per_worker}
        if self.use_gpu:
            b["GPU"] = float(self.workers_per_node)
        return b

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.workers_per_node


def _alive_nodes() -> list[dict]:
    return [n for n in ray.nodes() if n.get("Alive")]


def _fits(resources: dict, bundle: dict) -> bool:
    return all(resources.get(k, 0) >= v for k, v in bundle.items())


def fitting_nodes(placement: "Placement", held: Collection[str] = ()) -> int:
    """How many alive nodes can hold one of ``placement``'s bundles now: those whose free
    resources fit it (a node other work holds does not count, though its total would), and the
    nodes in ``held`` (node ids this run's own placement group holds already)."""
    # Ray has no public per-node view of free resources; its autoscaler reads this one. Where a
    # Ray lacks it, the totals are the fallback (a busy node then counts).
    try:
        from ray._private.state import available_resources_per_node
        free = available_resources_per_node()
    except Exception:  # noqa: BLE001 - an internal API that may move
        free = None
    count = 0
    for n in _alive_nodes():
        node_id = n.get("NodeID")
        by_total = free is None or node_id in held  # the run's own node, or no view of free resources
        count += _fits(n.get("Resources", {}) if by_total else free.get(node_id, {}), placement.bundle)
    return count


def _describe_nodes(nodes: list[dict]) -> str:
    parts = []
    for n in nodes:
        r = n.get("Resources", {})
        parts.append("{" + ", ".join(f"{k}: {r[k]:g}" for k in ("CPU", "GPU") if k in r) + "}")
    return ", ".join(parts) if parts else "none"


def resolve_placement(
    num_nodes: int, workers_per_node: int | str, use_gpu: bool | str, cpus_per_worker: float
) -> Placement:
    """Turn ``auto`` values into numbers by looking at the cluster's nodes."""
    nodes = _alive_nodes()
    if use_gpu == "auto":
        use_gpu = any(n.get("Resources", {}).get("GPU", 0) > 0 for n in nodes)
    if workers_per_node == "auto":
        key = "GPU" if use_gpu else "CPU"
        per_node = sorted(
            (int(n.get("Resources", {}).get(key, 0) // (1 if use_gpu else cpus_per_worker)) for n in nodes),
            reverse=True,
        )
        # The largest count that num_nodes nodes can each give.
        workers_per_node = per_node[num_nodes - 1] if len(per_node) >= num_nodes else 0
        if workers_per_node < 1:
            raise PlacementError(
                f"scaling.workers_per_node is 'auto' but no {num_nodes} nodes each have a "
                f"{'GPU' if use_gpu else 'CPU slot'} (nodes: {_describe_nodes(nodes)}). "
                "Set scaling.workers_per_node to a number, or add nodes."
            )
    return Placement(num_nodes, int(workers_per_node), bool(use_gpu), cpus_per_worker)


def cpu_beside_gpus(placement: Placement, asked: bool | str, here: int, embedded: bool) -> str | None:
    """The line a job that trains on CPUs gets while GPUs sit idle, saying why; None when it trains on GPUs or none
    are there. ``asked``: the spec's ``scaling.use_gpu``; ``here``: GPUs of the machine the driver runs on;
    ``embedded``: the cluster was started here (``raylaunch run`` without ``--address``)."""
    if placement.use_gpu:
        return None
    on_nodes = sum(n.get("Resources", {}).get("GPU", 0) for n in _alive_nodes())
    if on_nodes:
        return (f"raylaunch: training on CPUs although the cluster's nodes have {on_nodes:g} GPU(s): "
                f"scaling.use_gpu is {str(asked).lower()}; set scaling.use_gpu: auto to train on them")
    if here:
        why = ("its nodes were started without them (RAYLAUNCH_LOCAL_GPUS=0)" if embedded else
               "the cluster's nodes declare none (start them with `ray start --num-gpus=N`, or give the node type "
               "its GPUs in cluster.yaml's resources)")
        return f"raylaunch: training on CPUs although this machine has {here} GPU(s): {why}"
    return None


def _unplaceable(placement: Placement, nodes: list[dict]) -> str:
    fitting = sum(_fits(n.get("Resources", {}), placement.bundle) for n in nodes)
    bundle = ", ".join(f"{k}: {v:g}" for k, v in placement.bundle.items())
    if fitting >= placement.num_nodes:
        return (
            f"the job needs {placement.num_nodes} nodes with {{{bundle}}} each, and {fitting} of the "
            f"cluster's {len(nodes)} alive nodes are big enough, but Ray did not grant them: other work "
            "holds their resources, or a node is listed alive but unreachable (a cut link or a hung host "
            "stays listed until Ray's health checks give up on it). Check `ray status`, or raise "
            "timeouts.placement_s."
        )
    return (
        f"the job needs {placement.num_nodes} nodes with {{{bundle}}} each "
        f"({placement.workers_per_node} workers x {placement.cpus_per_worker:g} CPUs"
        f"{' + 1 GPU' if placement.use_gpu else ''}), but only {fitting} of the cluster's "
        f"{len(nodes)} alive nodes can hold that (nodes: {_describe_nodes(nodes)}). "
        f"Lower scaling.num_nodes (--set scaling.num_nodes={max(fitting, 1)}) or "
        "scaling.workers_per_node, or add nodes."
    )


def reserve(placement: Placement, *, timeout_s: float, can_grow: bool, on_wait: Callable[[str], None] = print,
            timeout_name: str = "timeouts.placement_s") -> PlacementGroup:
    """A placement group holding one of ``placement``'s bundles on each of ``num_nodes`` nodes, or ``PlacementError``.

    On a cluster that cannot grow (``can_grow=False``), too few fitting nodes fail at once;
    otherwise we wait up to ``timeout_s``, saying what we wait for.
    """
    nodes = _alive_nodes()
    fitting = sum(_fits(n.get("Resources", {}), placement.bundle) for n in nodes)
    if fitting < placement.num_nodes and not can_grow:
        raise PlacementError(_unplaceable(placement, nodes))
    pg = placement_group([placement.bundle] * placement.num_nodes, strategy="STRICT_SPREAD")
    deadline = time.monotonic() + timeout_s
    if fitting < placement.num_nodes:  # say so at once: an autoscaler may take minutes to add them
        on_wait(f"raylaunch: waiting for {placement.num_nodes} nodes with {placement.bundle}; {fitting} can "
                f"hold one now, the cluster may add the rest (up to {timeout_s:g} s, {timeout_name})")
    while True:
        ready, _ = ray.wait([pg.ready()], timeout=min(10.0, max(0.0, deadline - time.monotonic())))
        if ready:
            return pg
        if time.monotonic() >= deadline:
            remove_placement_group(pg)
            raise PlacementError(
                f"gave up after {timeout_s:g} s ({timeout_name}): "
                + _unplaceable(placement, _alive_nodes())
            )
        on_wait(
            f"raylaunch: waiting for {placement.num_nodes} nodes with {placement.bundle} "
            f"({deadline - time.monotonic():.0f} s left of {timeout_name})"
        )
