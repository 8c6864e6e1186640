"""Before any rank starts: the nodes reserved, one actor on each, and every node able to read the run directory.

``reserve`` is what the driver does before its first attempt and again after a node was lost.
"""

from __future__ import annotations

import dataclasses
import time

import ray

from cluster.hosting.rankhost import WarmHost
from cluster.nodes.group import ACTOR_NAMESPACE, JobEnv, NodeGroup, Placement, PlacementError, fitting_nodes
from jobs.driver.policy import WorldSize, fit
from jobs.driver.record import Recorder
from jobs.run.storage import RunDir, StorageError
from jobs.spec import JobSpec
from jobs.spec.environment import runner_versions, with_runner_pins

__all__ = ["NodeRequest", "check_shared_storage", "reserve", "reserve_elastic"]


def _cluster_runner_versions() -> dict[str, str]:
    """torch's and Accelerate's versions on a node of the cluster (the driver may be elsewhere: a
    laptop through Ray Client), for ``env.pip``'s pins; this process's when no node answers."""
    try:
        return ray.get(ray.remote(num_cpus=0)(runner_versions).remote(), timeout=120)
    except Exception:  # noqa: BLE001 - the pins are a safeguard: the job's own packages still install
        return runner_versions()


def reserve(spec: JobSpec, placement: Placement, recorder: Recorder, token: str | None, *,
            can_grow: bool, timeout_s: float | None = None, timeout_name: str = "timeouts.placement_s") -> NodeGroup:
    """Reserve one bundle and start one actor per node; check the storage is shared."""
    env = spec.env
    group = NodeGroup.create(
        placement, timeout_s=timeout_s or spec.timeouts.placement_s, timeout_name=timeout_name,
        can_grow=can_grow, on_wait=lambda text: (recorder.waiting(), recorder.say(text)),
        socket_ifname=spec.rendezvous.socket_ifname,
        env=JobEnv(vars={k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in env.vars.items()},
                   secrets=recorder.secrets.values,
                   pip=with_runner_pins(env.requirements, _cluster_runner_versions()) if env.requirements else [],
                   warm=WarmHost(env.warm_host, env.warm_host_idle_s)),
    )
    recorder.reserved(group, live={"ray_address": ray.get_runtime_context().gcs_address, "namespace": ACTOR_NAMESPACE,
                                   "node_actors": group.actor_names, "ranks": group.ranks_by_node})
    try:
        check_shared_storage(group, recorder.run_dir, token)
    except BaseException:
        group.shutdown()
        raise
    return group


def check_shared_storage(group: NodeGroup, run_dir: RunDir, token: str | None) -> None:
    """Every node must read the marker the driver wrote: a node-local 'shared' path fails here."""
    marker = run_dir.marker_uri()
    seen = ray.get([a.read_file.remote(marker) for a in group.actors])
    bad = [i for i, v in enumerate(seen) if v != token]
    if bad:
        raise StorageError(
            f"nodes {bad} cannot read {marker}, which the driver wrote: the storage path is not "
            "shared by every node. Use an NFS mount present on every node or an object store (s3://...)."
        )


def reserve_elastic(spec: JobSpec, placement: Placement, sizes: list[WorldSize], recorder: Recorder,
                    token: str | None, *, can_grow: bool, wait_full_s: float,
                    request: "NodeRequest | None" = None) -> tuple[NodeGroup, WorldSize]:
    """An elastic run's nodes: the largest of ``sizes`` the cluster holds, after waiting up to
    ``wait_full_s`` for all of ``num_nodes``; fewer than ``min_nodes`` wait ``timeouts.placement_s``
    (or fail at once on a cluster that cannot grow), as a run that is not elastic does.

    While fewer than ``num_nodes`` can be had, ``request`` (on a cluster that can grow) asks an
    autoscaler for the rest. A size whose reservation fails (a node counted as free was not: it
    went away, or other work took it first) is not tried again: the next smaller one is."""
    full, fewest = sizes[0], sizes[-1]
    began = time.monotonic()
    deadline = began + wait_full_s
    give_up = began + wait_full_s + spec.timeouts.placement_s
    said = False
    candidates = list(sizes)
    while True:
        there = fitting_nodes(placement)
        chosen = fit(candidates, there)
        size = chosen.size
        if size is not full and request is not None:
            request.ask(full.nodes)
        if size is not None and size is not full and time.monotonic() < deadline:
            # said after a second: nodes just released (this run's own, growing back) take a moment to show as free
            recorder.waiting(at=time.time() - (time.monotonic() - began))
            if not said and time.monotonic() - began >= 1.0:
                recorder.say(f"raylaunch: elastic: waiting up to {wait_full_s:g} s (timeouts.resize_s) for "
                             f"{full.nodes} nodes; {there} can hold the job now")
                said = True
            time.sleep(1.0)
            continue
        if size is None:  # fewer than min_nodes: wait for them as any run waits for its nodes
            size = fewest
        elif size is not full:
            recorder.say(f"raylaunch: elastic: asking for {full.nodes} nodes, {there} can hold the job now: "
                         f"starting on {size.describe()}; the run grows back when nodes come"
                         + (f". {chosen.why}" if chosen.why else ""))
        try:
            group = reserve(spec, dataclasses.replace(placement, num_nodes=size.nodes), recorder, token,
                            can_grow=can_grow or size is not fewest,
                            timeout_s=None if size is fewest else spec.timeouts.resize_s,
                            timeout_name="timeouts.placement_s" if size is fewest else "timeouts.resize_s")
        except PlacementError:
            if size is fewest or time.monotonic() > give_up:
                raise
            candidates = [w for w in candidates if w.nodes < size.nodes]
            time.sleep(1.0)
            continue
        return group, size


class NodeRequest:
    """What an elastic run below ``num_nodes`` asks the cluster's autoscaler for.

    Its placement group holds only the nodes it runs on, so nothing else would tell an
    autoscaler that the run wants more: it asks, through Ray's ``request_resources``, for
    room for all of its bundles (the nodes it holds count towards them), and withdraws the
    request when it is back at ``num_nodes`` or ends. Ray keeps one such request per cluster, the
    newest; a run withdraws only a request it made.
    """

    def __init__(self, placement: Placement) -> None:
        self.placement = placement
        self.nodes = 0  # the nodes asked for now (0: none)

    def ask(self, nodes: int) -> None:
        if nodes != self.nodes:
            from ray.autoscaler.sdk import request_resources

            request_resources(bundles=[dict(self.placement.bundle) for _ in range(nodes)])
            self.nodes = nodes

    def withdraw(self) -> None:
        """Withdraw the request this run made, if any (never raises: it runs as the run ends)."""
        if self.nodes:
            try:
                self.ask(0)
            except Exception:  # noqa: BLE001 - the cluster may be gone; the request goes with it
                self.nodes = 0
