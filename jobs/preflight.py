"""Before any rank starts: the nodes reserved, one actor on each, and every node able to read the run directory.

``reserve`` is what the driver does before its first attempt and again after a node was lost.
"""

from __future__ import annotations

import ray

from cluster.group import ACTOR_NAMESPACE, JobEnv, NodeGroup, Placement
from jobs.record import Recorder
from jobs.spec import JobSpec
from jobs.storage import RunDir, StorageError

__all__ = ["check_shared_storage", "reserve"]


def reserve(spec: JobSpec, placement: Placement, recorder: Recorder, token: str | None, *,
            can_grow: bool) -> NodeGroup:
    """Reserve one bundle and start one actor per node; check the storage is shared."""
    env = spec.env
    group = NodeGroup.create(
        placement, timeout_s=spec.timeouts.placement_s, can_grow=can_grow, on_wait=recorder.say,
        socket_ifname=spec.rendezvous.socket_ifname,
        env=JobEnv(vars={k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in env.vars.items()},
                   secrets=recorder.secrets.values, pip=env.requirements),
    )
    recorder.mark("reserved")
    r = recorder.result
    r.live = {"ray_address": ray.get_runtime_context().gcs_address, "namespace": ACTOR_NAMESPACE,
              "node_actors": group.actor_names, "ranks": group.ranks_by_node}
    r.nodes = [
        {"node_rank": i, "node_id": info.node_id, "ip": info.ip, "hostname": info.hostname,
         "socket_ifname": socket.name}
        for i, (info, socket) in enumerate(zip(group.infos, group.sockets))
    ]
    for i, (info, socket) in enumerate(zip(group.infos, group.sockets)):
        recorder.say(f"raylaunch: node {i} ({info.ip}, {info.hostname}): {socket.describe()}")
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
