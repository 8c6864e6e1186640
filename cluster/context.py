"""Who is who in a world: ranks by node, then local index, as pure functions.

Node ``n`` holds world ranks ``sum(workers of nodes < n) ...``; node 0 holds
ranks ``0..k-1`` and hosts the rendezvous store. Nothing here starts a
process or talks to Ray, so it is tested on its own.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

# Entries of NCCL's Flight Recorder ring buffer per rank on GPU nodes (each a few hundred
# bytes, written only when a collective is enqueued: no measurable cost).
FLIGHT_RECORDER_ENTRIES = 2000

__all__ = ["RECORD_KEYS", "SocketInterface", "WorkerContext", "assign_ranks", "choose_socket_interface",
           "rendezvous_env"]

# What every metrics.jsonl row carries besides its metrics: a rank's metric of one of these
# names is stored apart (``logged_<name>``), never over the row's own value.
RECORD_KEYS = ("step", "rank", "node", "attempt", "time")


@dataclass(frozen=True)
class WorkerContext:
    """Where one worker process sits in the world.

    >>> assign_ranks([2, 2])[3]
    WorkerContext(world_rank=3, local_rank=1, node_rank=1, world_size=4, local_world_size=2, num_nodes=2)
    """

    world_rank: int
    local_rank: int
    node_rank: int
    world_size: int
    local_world_size: int
    num_nodes: int


def assign_ranks(workers_per_node: list[int]) -> list[WorkerContext]:
    """Every worker's context, in world-rank order, for nodes in node-rank order."""
    if not workers_per_node or any(n < 1 for n in workers_per_node):
        raise ValueError(f"every node needs at least one worker, got {workers_per_node}")
    world_size = sum(workers_per_node)
    out = []
    for node_rank, local_world_size in enumerate(workers_per_node):
        for local_rank in range(local_world_size):
            out.append(
                WorkerContext(
                    world_rank=len(out),
                    local_rank=local_rank,
                    node_rank=node_rank,
                    world_size=world_size,
                    local_world_size=local_world_size,
                    num_nodes=len(workers_per_node),
                )
            )
    return out


@dataclass(frozen=True)
class SocketInterface:
    """The interface one node's ranks use for the collective backend's own connections.

    Without it gloo binds to whatever the hostname resolves to, and Debian puts
    ``127.0.1.1 <hostname>`` in ``/etc/hosts``: peers on other hosts are then told to
    connect to a loopback address and the group hangs at its first collective.

    >>> choose_socket_interface("10.0.0.2", {"lo": ["127.0.0.1"], "eth1": ["10.0.0.2"]}, use_gpu=False)
    SocketInterface(variable='GLOO_SOCKET_IFNAME', name='eth1', source='ray-address', ip='10.0.0.2')
    """

    variable: str  # GLOO_SOCKET_IFNAME (CPU, gloo) or NCCL_SOCKET_IFNAME (GPU, nccl)
    name: str | None  # None: no interface carries the node's Ray address
    source: str  # spec | environment | ray-address | none
    ip: str  # the node's Ray address

    @property
    def env(self) -> dict[str, str]:
        """What a rank's environment gets (nothing when no interface was found)."""
        if self.name is None:
            return {}
        # NCCL matches a bare name as a prefix (eth1 would also take eth10); "=" means exactly.
        exact = self.variable == "NCCL_SOCKET_IFNAME" and self.source == "ray-address"
        return {self.variable: f"={self.name}" if exact else self.name}

    def describe(self) -> str:
        if self.name is None:
            return (f"no interface carries its Ray address {self.ip}, so {self.variable} is left unset and "
                    "the backend binds to what the hostname resolves to; if ranks on different nodes cannot "
                    "connect, set rendezvous.socket_ifname")
        why = {"spec": "rendezvous.socket_ifname", "environment": "from the node's environment",
               "ray-address": f"the interface of its Ray address {self.ip}"}[self.source]
        return f"{self.variable}={self.name} ({why})"


def choose_socket_interface(
    ip: str,
    if_addrs: Mapping[str, Iterable[Any]],
    *,
    use_gpu: bool,
    configured: str = "auto",
    environ: Mapping[str, str] | None = None,
) -> SocketInterface:
    """The spec's interface, else the node environment's, else the one that carries ``ip``.

    ``if_addrs`` maps interface names to addresses, as ``psutil.net_if_addrs()``
    does (entries with an ``.address``) or as plain strings.
    """
    variable = "NCCL_SOCKET_IFNAME" if use_gpu else "GLOO_SOCKET_IFNAME"
    if configured != "auto":
        return SocketInterface(variable, configured, "spec", ip)
    named = (environ or {}).get(variable, "").strip()
    if named:
        return SocketInterface(variable, named, "environment", ip)
    want = _ip(ip)
    for name, addrs in if_addrs.items():
        if want is not None and any(_ip(getattr(a, "address", a)) == want for a in addrs):
            return SocketInterface(variable, name, "ray-address", ip)
    return SocketInterface(variable, None, "none", ip)


def _ip(text: Any) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(str(text).split("%", 1)[0])  # fe80::1%eth0 -> fe80::1
    except ValueError:  # a MAC address (AF_PACKET) or anything else that is no IP
        return None


def rendezvous_env(
    ctx: WorkerContext,
    master_addr: str,
    master_port: int,
    *,
    use_gpu: bool,
    omp_threads: int,
    socket: SocketInterface | None = None,
    flight_recorder: str | None = None,
) -> dict[str, str]:
    """The environment that makes an unchanged ``Accelerator()`` join the group.

    ``flight_recorder``: on GPU nodes, the path prefix of NCCL Flight Recorder dumps.

    Node 0 already hosts the TCPStore at ``master_addr:master_port``, so every
    rank connects as a client (``TORCHELASTIC_USE_AGENT_STORE``): the port was
    held from the moment it was chosen and nobody can take it in between.
    """
    env = {
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "RANK": str(ctx.world_rank),
        "WORLD_SIZE": str(ctx.world_size),
        "LOCAL_RANK": str(ctx.local_rank),
        "LOCAL_WORLD_SIZE": str(ctx.local_world_size),
        "NODE_RANK": str(ctx.node_rank),
        "GROUP_RANK": str(ctx.node_rank),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        # torchrun bounds threads too; unbounded threads made an 8-GPU job's
        # optimizer construction 40x slower.
        "OMP_NUM_THREADS": str(max(1, omp_threads)),
    }
    if not use_gpu:
        # Without this, Accelerate on a GPU-less node silently trains alone.
        env["ACCELERATE_USE_CPU"] = "true"
    elif flight_recorder:
        # NCCL's Flight Recorder: the last collectives of each rank, kept in a small ring
        # buffer and written to <flight_recorder><rank> when a collective times out.
        env.update({"TORCH_NCCL_TRACE_BUFFER_SIZE": str(FLIGHT_RECORDER_ENTRIES), "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                    "TORCH_FR_DUMP_TEMP_FILE": flight_recorder})
    if socket is not None:
        env.update(socket.env)
    return env
