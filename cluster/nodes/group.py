"""The node actors as a group: one ``NodeActor`` per reserved bundle, started, polled, stopped and ended
together, and the job's environment they carry (``JobEnv``); reserving the bundles is ``cluster.nodes.placement``'s."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import ray
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from cluster.context import SocketInterface, WorkerContext, assign_ranks, choose_socket_interface, rendezvous_env
from cluster.hosting.rankhost import WarmHost
from cluster.layout import events_file, flight_recorder_prefix
from cluster.nodes.connect import node_environment
from cluster.nodes.node import SNAPSHOT_GROUP, NodeActor, NodeInfo, RendezvousError, wake_poll
from cluster.nodes.placement import Placement, PlacementError, fitting_nodes, reserve, resolve_placement, spare_nodes
from cluster.protocol import NodePoll, NodeState, WorkerPayload
from cluster.stacks import SAMPLE_TIMEOUT_S, RankStack

# Placement, PlacementError, fitting_nodes, resolve_placement: cluster.nodes.placement's, named here for its callers.
__all__ = ["ACTOR_NAMESPACE", "EnvSetupError", "JobEnv", "NodeGroup", "NodeLostError", "Placement", "PlacementError",
           "RendezvousError", "collect_stacks", "fitting_nodes", "resolve_placement"]


class NodeLostError(RuntimeError):
    """Node actors died before their ranks started (their node was lost during the reservation or the start):
    ``nodes``, by node rank. The driver treats it as a failed attempt that lost those nodes."""

    def __init__(self, nodes: list[int], why: str) -> None:
        super().__init__(f"node{'s' if len(nodes) > 1 else ''} {', '.join(map(str, nodes))} lost before the ranks "
                         f"started ({why})")
        self.nodes = nodes


# The Ray namespace of the named node actors.
ACTOR_NAMESPACE = "raylaunch"


# How long a node's rank server (a warm host, or the actor's own) may take to import torch, Accelerate and the rest
# before the first start of ranks: a node past it is lost for that attempt, as one whose start hangs.
PREPARE_S = 600.0


class EnvSetupError(PlacementError):
    """A node could not set up the job's environment (``env.pip``); the message names the node."""


@dataclass(frozen=True)
class JobEnv:
    """What every rank's environment gets beyond the runner's own variables.

    ``vars`` also reach the node actors (and so the choice of ``NCCL_SOCKET_IFNAME``) through Ray's runtime
    environment, with ``pip``; ``secrets`` travel only as arguments of each node's ``start`` call, into the
    ranks' environments; ``warm`` says where ranks fork from (``cluster.hosting.rankhost``)."""

    vars: dict[str, str] = field(default_factory=dict)
    secrets: dict[str, str] = field(default_factory=dict, repr=False)
    pip: list[str] = field(default_factory=list)
    warm: WarmHost = field(default_factory=WarmHost)

    def actor_runtime_env(self) -> dict | None:
        out: dict[str, Any] = {}
        if self.vars:
            out["env_vars"] = dict(self.vars)
        if self.pip:
            out["pip"] = {"packages": list(self.pip), "pip_check": False}
        return out or None

    def rank_env(self) -> dict[str, str]:
        return {**self.vars, **self.secrets}


def _env_setup_failures(refs: list, pg) -> str:
    """Which nodes could not set up the runtime environment, with the end of pip's message."""
    from ray.util import placement_group_table

    bundle_nodes = placement_group_table(pg).get("bundles_to_node_id", {})
    ips = {n["NodeID"]: n.get("NodeManagerAddress", "?") for n in ray.nodes()}
    out = []
    for i, ref in enumerate(refs):
        try:
            ray.get(ref, timeout=5)
        except ray.exceptions.RuntimeEnvSetupError as exc:
            lines = [ln for ln in str(exc).splitlines() if ln.strip()]
            why = " | ".join(ln.strip() for ln in lines if "ERROR" in ln or "No matching" in ln)[-600:]
            out.append(f"node {i} ({ips.get(bundle_nodes.get(i), '?')}): {why or lines[-1][-600:]}")
        except Exception:  # noqa: S112 - only setup failures are named here
            continue
    return "; ".join(out)


def collect_stacks(actors: list, ranks: list[list[int]], timeout_s: float = SAMPLE_TIMEOUT_S
                   ) -> tuple[list[RankStack], dict[int, bytes]]:
    """Ask every node's actor (None: a node known lost) for its ranks' stacks at once; a node
    that does not answer within ``timeout_s`` plus a margin has its ``ranks`` named as unread."""
    refs: dict[int, Any] = {}
    for i, a in enumerate(actors):
        if a is not None:
            try:
                refs[i] = a.stacks.remote(timeout_s)
            except Exception:  # the actor is already known dead
                pass
    # py-spy, then the signal fallback, each bounded by timeout_s; the margin is Ray's
    ready = set(ray.wait(list(refs.values()), num_returns=len(refs), timeout=2 * timeout_s + 5)[0]) if refs else set()
    stacks: list[RankStack] = []
    dumps: dict[int, bytes] = {}
    for i in range(len(actors)):
        why = "its node was lost"
        if i in refs and refs[i] in ready:
            try:
                got, flight = ray.get(refs[i])
                stacks += got
                dumps.update(flight)
                continue
            except ray.exceptions.RayActorError:
                why = "its node's actor died"
        elif i in refs:
            why = f"its node's actor did not answer within {2 * timeout_s + 5:g} s"
        stacks += [RankStack(r, i, how="", error=why) for r in ranks[i]]
    return sorted(stacks, key=lambda s: s.rank), dumps


# After a held poll's first answer, how long ``poll`` waits for the others' (nodes in step answer together).
GATHER_S = 0.05
# Nodes a restart may go to, warmed while the run stops (``prewarm``): node id -> the actor holding its warm rank host,
# until the next group's actors are up.
_PREWARMED: dict[str, Any] = {}
# How long the next group waits, at most, for those actors to have claimed their hosts (they were started seconds
# before, at the drain's notice; one not up by then leaves its node's host to that node's actor, as before).
PREWARM_WAIT_S = 5.0


def _get_each(refs: list) -> dict[Any, Any]:
    """``ray.get`` of ready references at once (one call, not one each: at 128 nodes the calls'
    own cost dominated); the value of a reference whose actor died is None."""
    if not refs:
        return {}
    try:
        return dict(zip(refs, ray.get(refs)))
    except ray.exceptions.RayActorError:
        out = {}
        for ref in refs:
            try:
                out[ref] = ray.get(ref)
            except ray.exceptions.RayActorError:
                out[ref] = None
        return out


class NodeGroup:
    """One placement group and one ``NodeActor`` per bundle, in node-rank order."""

    def __init__(
        self, pg, actors: list, infos: list[NodeInfo], placement: Placement, socket_ifname: str = "auto",
        env: JobEnv | None = None, actor_names: list[str] | None = None,
    ) -> None:
        self._pg = pg
        self.actors = actors
        self.infos = infos
        self.placement = placement
        self.contexts: list[WorkerContext] = []
        self.actor_names: list[str] = list(actor_names or [])  # in ACTOR_NAMESPACE
        self.env = env or JobEnv()
        # The interface each node's ranks use for the collectives (see cluster.context).
        self.sockets: list[SocketInterface] = [
            choose_socket_interface(i.ip, i.interfaces, use_gpu=placement.use_gpu, configured=socket_ifname,
                                    environ=i.socket_env)
            for i in infos
        ]
        # Polls: at most one in flight per node, with the time it was sent.
        self._inflight: dict[int, tuple[Any, float]] = {}
        self._answered = [False] * len(actors)  # since the ranks started
        self._states = [NodeState.IDLE] * len(actors)
        self._lost: set[int] = set()

    @classmethod
    def create(
        cls,
        placement: Placement,
        *,
        timeout_s: float,
        can_grow: bool,
        on_wait: Callable[[str], None] = print,
        timeout_name: str = "timeouts.placement_s",
        socket_ifname: str = "auto",
        env: JobEnv | None = None,
    ) -> "NodeGroup":
        """Reserve the nodes (``cluster.nodes.placement.reserve``) and start the actors, or raise ``PlacementError``."""
        _await_prewarmed(PREWARM_WAIT_S)
        pg = reserve(placement, timeout_s=timeout_s, can_grow=can_grow, on_wait=on_wait, timeout_name=timeout_name)
        remote_cls = _node_actor_class()
        # Named, so `raylaunch stacks` can reach them from another process on the cluster.
        token = secrets.token_hex(4)
        names = [f"raylaunch-{token}-node{i}" for i in range(placement.num_nodes)]
        actors = [
            remote_cls.options(
                num_cpus=placement.bundle["CPU"],
                num_gpus=placement.bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
                name=names[i], namespace=ACTOR_NAMESPACE,
                runtime_env=(env or JobEnv()).actor_runtime_env(),
            ).remote(i, (env or JobEnv()).warm, node_environment())
            for i in range(placement.num_nodes)
        ]
        # A runtime environment with packages can take minutes to install on a node.
        wait_s = max(60.0, timeout_s) + (600.0 if env is not None and env.pip else 0.0)
        refs = [a.describe.remote() for a in actors]
        try:
            infos = ray.get(refs, timeout=wait_s)
        except Exception as exc:
            failed = _env_setup_failures(refs, pg) if isinstance(exc, ray.exceptions.RuntimeEnvSetupError) else ""
            for a in actors:
                ray.kill(a)
            remove_placement_group(pg)
            if failed:
                pip = (env or JobEnv()).pip
                what = (f"env.pip: the job's packages {pip} could not be installed" if pip else
                        "the job's runtime environment (its working directory) could not be set up")
                raise EnvSetupError(f"{what} before any rank started: {failed}") from None
            raise
        _release_prewarmed()  # (their warm rank hosts are this group's now, where it landed on their nodes)
        return cls(pg, actors, infos, placement, socket_ifname, env=env, actor_names=names)

    def start(
        self,
        make_payload: Callable[[WorkerContext, str], WorkerPayload],
        attempt: int,
        rendezvous_timeout_s: float,
        ports: tuple[int, int] | None = None,
    ) -> list[WorkerContext]:
        """Host a fresh store on node 0 and start every rank; return the world's contexts.

        ``make_payload(context, events_path)`` builds each rank's payload; the
        events path is on the rank's own node, where its actor reads it. The
        store binds the first free port of ``ports`` (any port when None);
        ``RendezvousError`` says when none is free.
        """
        try:
            return self._start(make_payload, attempt, rendezvous_timeout_s, ports)
        except ray.exceptions.RayActorError as exc:
            raise NodeLostError(self.dead_nodes() or list(range(len(self.actors))), type(exc).__name__) from None

    def dead_nodes(self) -> list[int]:
        """The node ranks whose actor does not answer within a few seconds."""
        return [i for i, answer in enumerate(self._call_all("scratch_dir", 10, None)) if answer is None]

    def _start(self, make_payload: Callable[[WorkerContext, str], WorkerPayload], attempt: int,
               rendezvous_timeout_s: float, ports: tuple[int, int] | None) -> list[WorkerContext]:
        p = self.placement
        scratch = self.scratch_dirs()
        self.contexts = assign_ranks([p.workers_per_node] * p.num_nodes)
        # Node 0's Ray address: the one address every node already reaches it by.
        master_addr = self.infos[0].ip
        try:
            port = ray.get(self.actors[0].host_store.remote(master_addr, rendezvous_timeout_s, ports))
        except ray.exceptions.RayTaskError as exc:
            if isinstance(exc.cause, RendezvousError):
                raise RendezvousError(str(exc.cause)) from None
            raise
        # The servers the ranks fork from finish their imports first, so the starts below take a fork's time and
        # the rendezvous bound tells a hung one; imports on a starved node can take minutes, not ``PREPARE_S``.
        self._each([a.prepare.remote() for a in self.actors], PREPARE_S,
                   lambda host: f"the {host} its ranks fork from did not finish its imports within {PREPARE_S:g} s")
        threads = max(1, int(p.cpus_per_worker))
        starts = []
        for node_rank, actor in enumerate(self.actors):
            ctxs = [c for c in self.contexts if c.node_rank == node_rank]
            payloads = [
                make_payload(c, events_file(scratch[node_rank], attempt, c.world_rank))
                for c in ctxs
            ]
            envs = [
                {**self.env.rank_env(),
                 **rendezvous_env(c, master_addr, port, use_gpu=p.use_gpu, omp_threads=threads,
                                  socket=self.sockets[node_rank],
                                  flight_recorder=flight_recorder_prefix(scratch[node_rank], attempt))}
                for c in ctxs
            ]
            starts.append(actor.start.remote(payloads, envs, attempt))
        self._each(starts, rendezvous_timeout_s,
                   lambda host: f"its ranks did not start within timeouts.rendezvous_s ({rendezvous_timeout_s:g} s): "
                                f"the {host} they fork from did not answer")
        self._answered = [False] * len(self.actors)
        self._states = [NodeState.RUNNING] * len(self.actors)
        return self.contexts

    def _each(self, refs: list, bound_s: float, late: Callable[[str], str]) -> None:
        """Wait for one call a node; a node whose call failed with an OSError, or has not returned within
        ``bound_s`` (``late(what its ranks fork from)`` says why), fails the attempt as a lost node does
        (``NodeLostError``), and the next reserves afresh (new actors, new worker processes; a warm rank host that
        hung is not claimed again: ``cluster.hosting.rankhost``)."""
        failed: list[tuple[int, str]] = []
        deadline = time.monotonic() + bound_s
        for node_rank, ref in enumerate(refs):
            try:
                ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except ray.exceptions.GetTimeoutError:
                try:
                    ray.kill(self.actors[node_rank])  # its call never returns: nothing to ask it, nor wait for
                except Exception:  # gone already
                    pass
                host = self.infos[node_rank].rank_host_pid
                failed.append((node_rank, late(f"warm rank host {host}" if host else "actor's fork server")))
            except ray.exceptions.RayTaskError as exc:
                if not isinstance(exc.cause, OSError):
                    raise  # raylaunch's own failure: said as such
                # its host could not start processes (its folder gone, out of memory or processes)
                failed.append((node_rank, f"{type(exc.cause).__name__}: {exc.cause}"))
        if failed:
            raise NodeLostError([n for n, _ in failed], "its actor could not start its ranks: " +
                                "; ".join(f"node {n}: {why}" for n, why in failed))

    def _call_all(self, method: str, timeout_s: float, default: Any) -> list[Any]:
        """Call ``method`` on every actor; a dead actor or a lost node gives ``default``."""
        refs = []
        for i, a in enumerate(self.actors):
            try:
                refs.append(None if i in self._lost else getattr(a, method).remote())
            except Exception:  # the actor is already known dead: nothing to submit to
                refs.append(None)
        out = []
        for ref in refs:
            try:
                out.append(default if ref is None else ray.get(ref, timeout=timeout_s))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                out.append(default)
        return out

    def poll(self, wait_s: float = 1.0, hold_s: float = 0.0, max_age_s: float | None = None) -> list[NodePoll]:
        """Every node's news, waiting at most ``wait_s`` for the nodes to answer; with ``hold_s``, each node's
        actor holds the poll up to that long until it has news or its rows waited ``max_age_s`` (``NodeActor.poll``),
        and this returns once the first node answers (the others come back empty, their polls still in flight).

        A node whose actor died comes back as state "lost". A node that has not answered comes back empty, in its
        last state, with ``silent_s``: how long its poll has waited, once it has answered since its ranks started
        (before, the ranks spawn and import: a starved machine can take seconds, and the rendezvous bound covers a
        node that never answers). When that silence means its host or link is down is the attempt's rule
        (``jobs.driver.attempt``), which then gives the node up (``lose``).
        """
        for i, a in enumerate(self.actors):
            if i not in self._lost and i not in self._inflight:
                try:
                    self._inflight[i] = (a.poll.remote(hold_s, max_age_s), time.monotonic())
                except Exception:  # the actor is already known dead
                    self._lost.add(i)
        refs = [ref for ref, _ in self._inflight.values()]
        ready: set = set()
        if refs and hold_s > 0:  # the first answer, then whatever else comes within GATHER_S of it
            ray.wait(refs, num_returns=1, timeout=hold_s + wait_s)
            ready = set(ray.wait(refs, num_returns=len(refs), timeout=GATHER_S)[0])
        elif refs:
            ready = set(ray.wait(refs, num_returns=len(refs), timeout=wait_s)[0])
        answers = _get_each([ref for ref, _ in self._inflight.values() if ref in ready])
        now = time.monotonic()
        out = []
        for i in range(len(self.actors)):
            if i in self._lost:
                out.append(NodePoll(state=NodeState.LOST))
                continue
            ref, sent = self._inflight[i]
            if ref in ready:
                del self._inflight[i]
                p = answers[ref]
                if p is None:  # its actor died
                    self._lost.add(i)
                    p = NodePoll(state=NodeState.LOST)
                else:
                    self._answered[i], self._states[i] = True, p.state
            else:
                p = NodePoll(state=self._states[i], silent_s=now - sent if self._answered[i] else None)
            out.append(p)
        return out

    def lose(self, node_rank: int) -> None:
        """Give a node up: it is lost from now on (its poll in flight is dropped; it is never asked again)."""
        self._inflight.pop(node_rank, None)
        self._lost.add(node_rank)

    @property
    def states(self) -> list[NodeState]:
        """Each node's state as its latest answer said (``LOST`` once given up on)."""
        return [NodeState.LOST if i in self._lost else s for i, s in enumerate(self._states)]

    @property
    def ranks_by_node(self) -> list[list[int]]:
        """The world ranks each node runs, in node order."""
        p = self.placement
        contexts = assign_ranks([p.workers_per_node] * p.num_nodes)
        return [[c.world_rank for c in contexts if c.node_rank == i] for i in range(p.num_nodes)]

    def stacks(self, timeout_s: float = SAMPLE_TIMEOUT_S) -> tuple[list[RankStack], dict[int, bytes]]:
        """Every rank's stacks (and NCCL Flight Recorder dumps), all nodes at once, without
        stopping them; a lost node's ranks are named as unread."""
        actors = [None if i in self._lost else a for i, a in enumerate(self.actors)]
        return collect_stacks(actors, self.ranks_by_node, timeout_s)

    def scratch_dirs(self) -> list[str]:
        return ray.get([a.scratch_dir.remote() for a in self.actors])

    def pids(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for d in ray.get([a.pids.remote() for a in self.actors]):
            out.update(d)
        return out

    def stop(self) -> list[NodePoll]:
        """Stop every rank on every node; return what they left to read."""
        for i, info in enumerate(self.infos):
            if i in self._inflight and i not in self._lost:  # its held poll answers now, not at the end of its hold
                wake_poll(info.ip, info.wake_port)
        earlier = self._finish_polls(timeout_s=10)
        out = []
        for i, p in enumerate(self._call_all("stop", 60, None)):
            p = p if p is not None else NodePoll(state=NodeState.LOST)
            if i in earlier:  # the news of a poll that answered late comes first
                p.events[:0], p.logs[:0], p.rows[:0] = earlier[i].events, earlier[i].logs, earlier[i].rows
            out.append(p)
        return out

    def _finish_polls(self, timeout_s: float) -> dict[int, NodePoll]:
        """Wait for the polls still in flight; what they bring is read before a stop."""
        out = {}
        for i, (ref, _) in list(self._inflight.items()):
            try:
                out[i] = ray.get(ref, timeout=timeout_s)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass
        self._inflight.clear()
        return out

    def prewarm(self, exclude: set[str]) -> list[str]:
        """Start the warm rank host on every spare node a restart's ranks could go to (alive, room for a bundle, not
        this group's, not in ``exclude``: nodes being drained), once each: a replacement node's first host imports
        torch, Accelerate and transformers, 3.0 s of the 8.1 s from a drain's notice to training again in ``make
        bench-recovery`` (2026-12-07), which the run's stop and its snapshot's commit now overlap. A node actor of
        no resources claims the host there (its key, the job's, is the one the next group's actors claim) and holds
        it until the next group's actors are up. Returns the node ids warmed now."""
        if not self.env.warm.enabled:
            return []
        held = {i.node_id for i in self.infos} | set(exclude) | set(_PREWARMED)
        started = []
        remote_cls = _node_actor_class()
        for node_id in spare_nodes(self.placement, held):
            _PREWARMED[node_id] = remote_cls.options(
                num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
                namespace=ACTOR_NAMESPACE, runtime_env=self.env.actor_runtime_env(),
            ).remote(-1, self.env.warm, node_environment())
            started.append(node_id)
        return started

    def shutdown(self) -> None:
        """Stop the ranks, end the actors and release the placement group."""
        self._call_all("shutdown", 30, None)
        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:
                pass
        try:
            remove_placement_group(self._pg)
        except Exception:
            pass


def _node_actor_class() -> Any:
    """``NodeActor`` as Ray starts it. Snapshots' parts move on a thread of their own (reading and writing hundreds of
    MiB takes seconds): a poll, and the news of a rank's death it carries, never waits behind them. Every other call
    runs on the actor's main thread (``max_concurrency=0``: no thread pool for the default group,
    ``cluster.nodes.node``), where a held poll keeps Ray's 10 ms signal check asleep."""
    return ray.remote(concurrency_groups={SNAPSHOT_GROUP: 1}, max_concurrency=0)(NodeActor)


def _await_prewarmed(timeout_s: float) -> None:
    """Until every spare node's actor (``NodeGroup.prewarm``) has claimed its warm rank host, or ``timeout_s``."""
    if _PREWARMED:
        ray.wait([a.__ray_ready__.remote() for a in _PREWARMED.values()], num_returns=len(_PREWARMED),
                 timeout=timeout_s)


def _release_prewarmed() -> None:
    """End the actors that held spare nodes' warm rank hosts (``NodeGroup.prewarm``): each host stays warm for
    ``env.warm_host_idle_s``."""
    for actor in list(_PREWARMED.values()):
        try:
            actor.shutdown.remote()
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - gone already
            pass
    _PREWARMED.clear()
