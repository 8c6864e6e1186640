"""Placement: how many nodes with how much each, read from the cluster (the nodes alive, and on a cluster that
autoscales the node types its autoscaler may start), and reserving them (one STRICT_SPREAD bundle per node), or an
error with the numbers of what is missing."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Collection, Mapping, Sequence

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from cluster.errors import RaylaunchError
from cluster.nodes.autoscaler import NodeType, launchable_node_types

__all__ = ["Placement", "PlacementError", "cpu_beside_gpus", "cpu_by_choice", "decide_placement", "fitting_nodes",
           "reserve", "resolve_placement", "spare_nodes", "waiting_line"]


class PlacementError(RaylaunchError, RuntimeError):
    """The cluster cannot give the nodes the job asks for; the message has the numbers."""


@dataclass(frozen=True)
class Placement:
    """A resolved request: ``num_nodes`` bundles of ``bundle`` resources, one per node."""

    num_nodes: int
    workers_per_node: int
    use_gpu: bool
    cpus_per_worker: float
    # The node types the cluster's autoscaler may start, where they were read to decide (None: not read, or no
    # autoscaler); what the wait for nodes says comes from them.
    node_types: tuple[NodeType, ...] | None = field(default=None, compare=False, repr=False)

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
    return len(_fitting(placement, held))


def spare_nodes(placement: "Placement", exclude: Collection[str]) -> list[str]:
    """The alive nodes, but those in ``exclude`` (node ids), whose free resources fit one of ``placement``'s bundles
    now: where a restart's ranks can go."""
    return [node_id for node_id in _fitting(placement) if node_id not in exclude]


def _fitting(placement: "Placement", held: Collection[str] = ()) -> list[str]:
    """The alive nodes whose free resources fit one of ``placement``'s bundles, and those in ``held`` whose totals do."""
    # Ray has no public per-node view of free resources; its autoscaler reads this one. Where a
    # Ray lacks it, the totals are the fallback (a busy node then counts).
    try:
        from ray._private.state import available_resources_per_node
        free = available_resources_per_node()
    except Exception:  # noqa: BLE001 - an internal API that may move
        free = None
    out = []
    for n in _alive_nodes():
        node_id = n.get("NodeID")
        by_total = free is None or node_id in held  # the run's own node, or no view of free resources
        if _fits(n.get("Resources", {}) if by_total else free.get(node_id, {}), placement.bundle):
            out.append(node_id)
    return out


def _describe_resources(resources: Sequence[Mapping[str, float]]) -> str:
    parts = ["{" + ", ".join(f"{k}: {r[k]:g}" for k in ("CPU", "GPU") if k in r) + "}" for r in resources]
    return ", ".join(parts) if parts else "none"


def _describe_nodes(nodes: list[dict]) -> str:
    return _describe_resources([n.get("Resources", {}) for n in nodes])


def _per_node(resources: Mapping[str, float], use_gpu: bool, cpus_per_worker: float) -> int:
    return int(resources.get("GPU", 0) // 1 if use_gpu else resources.get("CPU", 0) // cpus_per_worker)


def decide_placement(
    num_nodes: int, workers_per_node: int | str, use_gpu: bool | str, cpus_per_worker: float,
    nodes: Sequence[Mapping[str, float]], node_types: Sequence[NodeType] | None = None,
) -> Placement:
    """``auto`` values turned into numbers from the resources of the ``nodes`` alive and, on a cluster that
    autoscales, the ``node_types`` its autoscaler may start (each counts as up to ``max_nodes`` more nodes): GPUs
    when any node has one or any node type declares one; every GPU (or CPU slot) that ``num_nodes`` nodes can each
    give. A node type's nodes alive are counted twice over (alive, and among those it may start): the reservation
    then waits, and says so, rather than deciding on fewer.

    >>> from cluster.nodes.autoscaler import NodeType
    >>> head, gpus = {"CPU": 0.0}, NodeType("gpu_worker", {"CPU": 48.0, "GPU": 4.0}, 8)
    >>> decide_placement(2, "auto", "auto", 1.0, [head], [gpus])
    Placement(num_nodes=2, workers_per_node=4, use_gpu=True, cpus_per_worker=1.0)
    >>> decide_placement(2, 1, "auto", 1.0, [head], [NodeType("cpu_worker", {"CPU": 8.0}, 4)]).use_gpu
    False
    """
    types = tuple(node_types) if node_types is not None else None
    could = [*nodes, *(t.resources for t in types or () for _ in range(min(t.max_nodes, num_nodes)))]
    if use_gpu == "auto":
        use_gpu = any(r.get("GPU", 0) > 0 for r in could)
    if workers_per_node == "auto":
        per_node = sorted((_per_node(r, bool(use_gpu), cpus_per_worker) for r in could), reverse=True)
        # The largest count that num_nodes nodes can each give.
        workers_per_node = per_node[num_nodes - 1] if len(per_node) >= num_nodes else 0
        if workers_per_node < 1:
            started = f"; node types the autoscaler may start: {', '.join(t.describe() for t in types)}" if types else ""
            raise PlacementError(
                f"scaling.workers_per_node is 'auto' but no {num_nodes} nodes each have a "
                f"{'GPU' if use_gpu else 'CPU slot'} (nodes: {_describe_resources(nodes)}{started}). "
                "Set scaling.workers_per_node to a number, or add nodes."
            )
    return Placement(num_nodes, int(workers_per_node), bool(use_gpu), cpus_per_worker, node_types=types)


def resolve_placement(
    num_nodes: int, workers_per_node: int | str, use_gpu: bool | str, cpus_per_worker: float, *,
    can_grow: bool = False,
) -> Placement:
    """Turn ``auto`` values into numbers by looking at the cluster's nodes; on a cluster that may grow
    (``can_grow``), where the nodes alive leave ``auto`` short (no GPU, or fewer than ``num_nodes`` nodes with a
    GPU or CPU slot), at the node types its autoscaler may start too (``decide_placement``)."""
    nodes = [n.get("Resources", {}) for n in _alive_nodes()]
    if not can_grow or (use_gpu != "auto" and workers_per_node != "auto"):
        return decide_placement(num_nodes, workers_per_node, use_gpu, cpus_per_worker, nodes)
    try:
        alive = decide_placement(num_nodes, workers_per_node, use_gpu, cpus_per_worker, nodes)
    except PlacementError:
        alive = None
    if alive is not None and (alive.use_gpu or use_gpu != "auto"):
        return alive
    return decide_placement(num_nodes, workers_per_node, use_gpu, cpus_per_worker, nodes, launchable_node_types())


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


def cpu_by_choice(placement: Placement, asked: bool | str) -> str | None:
    """The one line an ``auto`` job on a cluster that autoscales gets when it trains on CPUs because neither its
    nodes nor any node type its autoscaler may start has a GPU; None otherwise (``cpu_beside_gpus`` says the rest).

    >>> from cluster.nodes.autoscaler import NodeType
    >>> cpu_by_choice(Placement(2, 1, False, 1.0, node_types=(NodeType("cpu_worker", {"CPU": 8.0}, 4),)), "auto")
    'raylaunch: training on CPUs: scaling.use_gpu is auto and no node has a GPU, nor any node type the autoscaler may start (cpu_worker {CPU: 8} x4)'
    """
    if placement.use_gpu or asked != "auto" or placement.node_types is None:
        return None
    types = ", ".join(t.describe() for t in placement.node_types) or "none"
    return ("raylaunch: training on CPUs: scaling.use_gpu is auto and no node has a GPU, nor any node type the "
            f"autoscaler may start ({types})")


def waiting_line(placement: Placement, fitting: int, node_types: Sequence[NodeType] | None, timeout_s: float,
                 timeout_name: str = "timeouts.placement_s") -> str:
    """What a reservation says at once when fewer than ``num_nodes`` nodes can hold a bundle now (``fitting``): on a
    cluster whose autoscaler may start node types that hold one, that it is starting them, with the numbers.

    >>> from cluster.nodes.autoscaler import NodeType
    >>> gpus = (NodeType("gpu_worker", {"CPU": 4.0, "GPU": 1.0}, 2),)
    >>> waiting_line(Placement(2, 1, True, 1.0), 0, gpus, 600)
    'raylaunch: waiting for 2 nodes with 1 GPU each: the autoscaler is starting them (node type gpu_worker; 0 of the 2 can hold one now; up to 600 s, timeouts.placement_s)'
    >>> waiting_line(Placement(2, 1, False, 1.0), 1, None, 600)
    "raylaunch: waiting for 2 nodes with {'CPU': 1.0}; 1 can hold one now, the cluster may add the rest (up to 600 s, timeouts.placement_s)"
    """
    starting = [t.name for t in node_types or () if _fits(t.resources, placement.bundle)]
    if not starting:
        return (f"raylaunch: waiting for {placement.num_nodes} nodes with {placement.bundle}; {fitting} can hold one "
                f"now, the cluster may add the rest (up to {timeout_s:g} s, {timeout_name})")
    missing = placement.num_nodes - fitting
    if placement.use_gpu:
        each = f"{placement.workers_per_node} GPU{'s' if placement.workers_per_node != 1 else ''}"
    else:
        each = f"{placement.bundle['CPU']:g} CPU{'s' if placement.bundle['CPU'] != 1 else ''}"
    return (f"raylaunch: waiting for {missing} node{'s' if missing != 1 else ''} with {each} each: the autoscaler is "
            f"starting them (node type{'s' if len(starting) != 1 else ''} {', '.join(starting)}; {fitting} of the "
            f"{placement.num_nodes} can hold one now; up to {timeout_s:g} s, {timeout_name})")


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
        types = placement.node_types if placement.node_types is not None else launchable_node_types()
        on_wait(waiting_line(placement, fitting, types, timeout_s, timeout_name))
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
