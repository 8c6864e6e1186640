"""What the cluster's autoscaler may start: its worker node types (name, resources, how many at most), read as the
head's autoscaler sees them, or None on a cluster without one."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Mapping

import ray

__all__ = ["NodeType", "head_autoscaling_config", "launchable_node_types", "node_types_from_config", "read_on_head"]

# A node type without a bound (a GCS node group's max_count of -1): more than any job asks for.
UNBOUNDED = 1 << 20
HEAD_RESOURCE = "node:__internal_head__"  # the resource Ray gives the head node, and only it


@dataclass(frozen=True)
class NodeType:
    """A node type the autoscaler may start: ``max_nodes`` nodes at most, each with ``resources`` (empty where the
    config leaves them to the provider's detection at start, so what they hold is not known ahead)."""

    name: str
    resources: Mapping[str, float] = field(default_factory=dict)
    max_nodes: int = 0

    def describe(self) -> str:
        """``gpu_worker {CPU: 48, GPU: 4} x8``

        >>> NodeType("gpu_worker", {"CPU": 48.0, "GPU": 4.0, "memory": 1e11}, 8).describe()
        'gpu_worker {CPU: 48, GPU: 4} x8'
        """
        shown = ", ".join(f"{k}: {self.resources[k]:g}" for k in ("CPU", "GPU") if k in self.resources)
        return f"{self.name} {{{shown or 'resources unknown'}}} x{self.max_nodes}"


def node_types_from_config(config: Mapping[str, Any]) -> list[NodeType]:
    """The node types a cluster config lets the autoscaler start workers of (``ray up``'s YAML as the head's
    autoscaler reads it: on the head, ``~/ray_bootstrap_config.yaml``, whose types' resources the provider has
    filled in from the instance type), each bounded by its own ``max_workers`` and the cluster's; as Ray fills them
    in, a type without ``max_workers`` may start the cluster's, the head's type none (the local provider's one
    type is both, with the cluster's). Types that may start none are left out.

    >>> node_types_from_config({"max_workers": 8, "head_node_type": "head", "available_node_types": {
    ...     "head": {"resources": {"CPU": 0}}, "gpu_worker": {"resources": {"CPU": 48, "GPU": 4}},
    ...     "idle": {"resources": {"CPU": 2}, "max_workers": 0}}})
    [NodeType(name='gpu_worker', resources={'CPU': 48.0, 'GPU': 4.0}, max_nodes=8)]
    """
    cap = config.get("max_workers")
    out = []
    for name, spec in (config.get("available_node_types") or {}).items():
        if not isinstance(spec, Mapping):
            continue
        most = spec.get("max_workers", 0 if name == config.get("head_node_type") else cap or 0)
        most = min(int(most), int(cap)) if cap is not None else int(most)
        if most > 0:
            resources = {k: float(v) for k, v in (spec.get("resources") or {}).items()
                         if isinstance(v, (int, float)) and not isinstance(v, bool)}
            out.append(NodeType(str(name), resources, most))
    return out


def _node_types_from_gcs(cluster_config: Any) -> list[NodeType]:
    """The node groups an autoscaler reported to the GCS (Ray's ``ClusterConfig``: later Ray versions' v2
    autoscaler reports its worker types there; Ray 2.60's do not)."""
    out = []
    for group in cluster_config.node_group_configs:
        most = UNBOUNDED if group.max_count < 0 else int(group.max_count)
        if most > 0:
            out.append(NodeType(group.name, {k: float(v) for k, v in group.resources.items()}, most))
    return out


def head_autoscaling_config(gcs_address: str) -> tuple[bool, dict | None]:
    """On the head's machine: whether the autoscaler process of the cluster at ``gcs_address`` runs here, and the
    config it was started with (None: it has none, the cluster does not autoscale).

    Ray's head runs its autoscaler as a process of its own (``ray/autoscaler/_private/monitor.py``, or
    ``ray/autoscaler/v2/monitor.py`` under ``ray up``'s default v2), started with ``--gcs-address`` and, where the
    cluster autoscales, ``--autoscaling-config=PATH`` (``ray up``: ``~/ray_bootstrap_config.yaml``). Every head has
    such a process; one started without a config only reports. Read from ``/proc`` (Linux, as every Ray head)."""
    import yaml

    for pid in (p for p in os.listdir("/proc") if p.isdigit()) if os.path.isdir("/proc") else ():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:
            continue
        if not any(os.path.basename(a) == "monitor.py" and "autoscaler" in a for a in argv):
            continue
        if f"--gcs-address={gcs_address}" not in argv:
            continue
        path = next((a.split("=", 1)[1] for a in argv if a.startswith("--autoscaling-config=")), "")
        if not path:
            return True, None
        if path == "~" or path.startswith("~/"):  # as the autoscaler expands it: with its own home
            path = os.path.join(_home_of(pid), path[2:])
        try:
            if not os.path.isabs(path):
                path = os.path.join(os.readlink(f"/proc/{pid}/cwd"), path)
            with open(path) as f:
                config = yaml.safe_load(f)
        except (OSError, yaml.YAMLError):
            return True, None
        return True, config if isinstance(config, dict) else None
    return False, None


def _home_of(pid: str) -> str:
    """The HOME a process runs with (this one's where it cannot be read)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            for item in f.read().split(b"\0"):
                if item.startswith(b"HOME="):
                    return item[5:].decode(errors="replace")
    except OSError:
        pass
    return os.path.expanduser("~")


def _head_node_id() -> str | None:
    return next((n["NodeID"] for n in ray.nodes() if n.get("Alive") and HEAD_RESOURCE in n.get("Resources", {})),
                None)


def launchable_node_types(timeout_s: float = 30.0) -> list[NodeType] | None:
    """The node types the connected cluster's autoscaler may start, as it sees them; None on a cluster without an
    autoscaler, or where its config cannot be read (then only the nodes alive count, as before).

    First what an autoscaler reported to the GCS (later Ray versions), then the config the head's autoscaler
    process was started with: read here when this process runs on the head (``submit``'s driver does), else by a
    task of no CPU on the head."""
    try:
        from ray._private.state import state

        reported = state.get_cluster_config()
    except Exception:  # noqa: BLE001 - a private API that may move: the head's own config is next
        reported = None
    if reported is not None and reported.node_group_configs:
        return _node_types_from_gcs(reported)
    context = ray.get_runtime_context()
    address = context.gcs_address
    seen, config = head_autoscaling_config(address)
    if not seen:
        head = _head_node_id()
        if head is None or head == context.get_node_id():
            return None
        try:
            seen, config = read_on_head(head, address, timeout_s)
        except Exception:  # noqa: BLE001 - no answer from the head: only the nodes alive count
            return None
    return None if config is None else node_types_from_config(config)


def read_on_head(head: str, gcs_address: str, timeout_s: float) -> tuple[bool, dict | None]:
    """``head_autoscaling_config`` run on the head node (``head``, its node id) by a task of no CPU: where this
    process runs elsewhere (a driver on a worker node, or through Ray Client)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    read = ray.remote(num_cpus=0, max_retries=0)(head_autoscaling_config).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(head, soft=False))
    return ray.get(read.remote(gcs_address), timeout=timeout_s)
