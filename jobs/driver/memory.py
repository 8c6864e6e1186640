"""The driver's side of snapshots in memory (``cluster.checkpoint.memory``): which node holds which rank's part of
which snapshot, the copy of each part on one other node, and a restart's choice of what to resume from.

A rank reports each part it wrote (``SnapshotHeld``); the book has the part's node send a copy to its peer (the next
node, by node rank), one copy in flight from a node at a time (the newest part waiting meanwhile, older ones skipped).
When an attempt fails, ``choose`` takes the newest snapshot, newer than the last committed checkpoint and of the same
world size, whose every part is held by a node that is still there (its own node, or its peer); ``assemble`` has
each node of the next attempt put it together in its memory, reading the parts it lacks from the nodes that hold
them; the ranks then load it as a committed checkpoint. Nothing in flight ever blocks the driver's loop.

After a stop notice (``stop_deadline``), ``upload_plan`` and ``upload`` have the nodes holding the parts of the
snapshot the ranks stopped at write them into a checkpoint's staging folder on the run's storage, which the driver
then commits as any checkpoint (``jobs.run.checkpoints``): what a cluster lost whole resumes from.
"""

from __future__ import annotations

import hashlib
import re
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from cluster.snapshots import SnapshotPlan
from jobs.run.events import MemoryMissed

__all__ = ["NOTICE_S", "MemoryResume", "SnapshotBook", "SnapshotUpload", "run_key", "stop_deadline", "upload_fits"]

# How long a restart waits for the nodes to put a snapshot together before it resumes from storage instead.
ASSEMBLE_S = 60.0
# The steps of the newest snapshots the book remembers.
REMEMBER = 256
# A stop notice that names no deadline (a rank's SIGTERM, a drain without one) is taken to leave this long from the
# notice: the shortest a cloud gives (Google Cloud's spot and preemptible VMs: 30 s; AWS gives 2 minutes).
NOTICE_S = 30.0
# A snapshot's commit after a stop notice is started only if its estimate ends this long before the deadline, and its
# files must be written by then (what comes after, the commit itself, needs no node).
STORE_MARGIN_S = 2.0
# The measured commits the estimate of a snapshot's commit reads (the latest).
RATES = 5


def stop_deadline(drained: dict[int, float], notice_at: float | None, now: float) -> tuple[float, str]:
    """When a stop notice's nodes go (Unix time) and whose deadline that is, in words: the earliest deadline of the
    drained nodes (``drained``: node rank -> its drain's deadline, 0 when it names none), else ``NOTICE_S`` after the
    notice (``notice_at``; ``now`` when no rank said when).

    >>> stop_deadline({1: 130.0, 2: 0.0}, 100.0, 105.0)
    (130.0, "node 1's deadline")
    >>> stop_deadline({}, 100.0, 105.0)
    (130.0, "the stop notice's deadline (it named none: taken as 30 s after it)")
    """
    named = {rank: at for rank, at in drained.items() if at > 0}
    if named:
        node = min(named, key=named.get)
        return named[node], f"node {node}'s deadline"
    return (notice_at or now) + NOTICE_S, f"the stop notice's deadline (it named none: taken as {NOTICE_S:g} s after it)"


def upload_fits(nbytes: int, rate: float | None, left_s: float) -> bool:
    """Whether a snapshot of ``nbytes`` may be committed in the ``left_s`` seconds before a deadline, at ``rate``
    (bytes a second this run's commits took, from the save to the commit; None: none measured yet, and it is tried,
    its write bounded by the deadline all the same), ``STORE_MARGIN_S`` to spare.

    >>> upload_fits(100 * 2**20, 20 * 2**20, 10.0), upload_fits(100 * 2**20, 20 * 2**20, 6.0)
    (True, False)
    >>> upload_fits(2**20, None, 5.0), upload_fits(2**20, None, 1.0)
    (True, False)
    """
    room = left_s - STORE_MARGIN_S
    return room > 0 and (rate is None or nbytes / rate <= room)


def run_key(name: str, uri: str) -> str:
    """The folder of a run's snapshots on every node: its name and a digest of its run directory.

    >>> run_key("my run/1", "/runs/my run")
    'my-run-1-11c69e6cc1'
    """
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-")[:40] or "run"
    return f"{safe}-{hashlib.sha1(uri.encode()).hexdigest()[:10]}"


@dataclass(frozen=True)
class MemoryResume:
    """A restart resuming from a snapshot: its step, each node's folder it was put together in (by node rank), and
    where its parts came from, in words."""

    step: int
    folders: dict[int, str]
    source: str


@dataclass(frozen=True)
class SnapshotUpload:
    """What committing a snapshot writes to storage: for each rank, the node (by node rank) that writes its part and
    the files of it that node writes (a file two ranks' parts hold is written once), and their bytes."""

    step: int
    world_size: int
    sends: dict[int, tuple[int, tuple[str, ...]]]
    nbytes: int


@dataclass
class _Node:
    node_id: str
    folder: str  # the run's snapshots on it: <root>/<run key>/<node id>
    actor: Any


@dataclass
class SnapshotBook:
    """Every snapshot part of the run the driver knows of, across attempts."""

    key: str
    memory_mb: float | None  # checkpoint.snapshots.memory_mb (None: auto)
    held: dict[int, dict[int, set[str]]] = field(default_factory=dict)  # step -> rank -> node ids holding it
    world: dict[int, int] = field(default_factory=dict)  # step -> its world size
    nodes: list[_Node] = field(default_factory=list)  # the attempt's nodes, by node rank
    roots: dict[str, str] = field(default_factory=dict)  # node id -> the run's folder on it, for every node seen
    _copies: dict[Any, tuple[int, int, str, int]] = field(default_factory=dict)  # ref -> (step, rank, peer, source)
    _notes: list[Any] = field(default_factory=list)  # the copy notes sent (``snapshot_part_copied``), until done
    _waiting: dict[int, int] = field(default_factory=dict)  # rank -> the newest step of its part to copy
    _node_of: dict[int, int] = field(default_factory=dict)  # rank -> its node rank, this attempt
    _pin: int | None = None  # the newest step every rank's part is held of, this attempt (``cluster.snapshots.pin``)
    _writing: dict[int, int] = field(default_factory=dict)  # rank -> the step it is writing its part of, slowly
    _pinned: tuple = ()  # what the nodes were last told to keep (``_send_pins``)
    copied: int = 0  # parts copied to a peer
    nbytes: dict[int, int] = field(default_factory=dict)  # rank -> bytes of its latest part
    every: dict[int, int] = field(default_factory=dict)  # rank -> optimizer steps between its snapshots
    taken: dict[int, float] = field(default_factory=dict)  # step -> when its last rank captured it (Unix time)
    said: bool = False  # what snapshots hold was said (``news``)
    stored: set[int] = field(default_factory=set)  # steps whose snapshot the driver committed to storage
    rates: list[float] = field(default_factory=list)  # bytes a second of the run's latest commits (save to commit)
    draining: set[int] = field(default_factory=set)  # node ranks Ray is draining, this attempt: no copy to them

    def attach(self, infos: list[Any], actors: list[Any], world_size: int, resumed: int | None = None) -> dict[int, str]:
        """An attempt's nodes (their ``NodeInfo`` and actors, by node rank), of ``world_size`` ranks, resumed at step
        ``resumed``; returns each one's folder. Parts of another world size, and parts past where it resumed (an
        earlier attempt's, which its ranks remove), are forgotten."""
        if resumed is not None:
            for step in [s for s in self.held if s > resumed or self.world.get(s) != world_size]:
                self._forget(step)
        self.nodes = [_Node(i.node_id, f"{i.snapshot_root}/{self.key}/{i.node_id}", a) for i, a in zip(infos, actors)]
        for n in self.nodes:
            self.roots[n.node_id] = n.folder
        self._notes.extend(self._copies)  # (an earlier attempt's copies still in flight: read once done, their errors
        # too, which Ray would otherwise print as unhandled when their references went)
        self._copies, self._waiting, self._world, self._pin, self._writing = {}, {}, world_size, resumed, {}
        self._pinned = ()
        self.draining = set()
        self._send_pins()  # the step resumed at stays until a newer one is whole (an earlier attempt's pin goes)
        return {rank: n.folder for rank, n in enumerate(self.nodes)}

    def writing_part(self, step: int, rank: int) -> None:
        """A rank took its part of ``step`` and is writing it, slowly (``cluster.protocol.SnapshotWriting``): the nodes
        keep the other ranks' parts of that step until it is held (one step a rank: its newest)."""
        if step in self.held and len(self.held[step]) == self._world:
            return
        self._writing[rank] = step
        self._send_pins()

    def _send_pins(self) -> None:
        """Tell the nodes what to keep, when it changed: the newest step every rank's part is held of, and the steps
        ranks are still writing newer than it."""
        writing = tuple(sorted({s for s in self._writing.values() if self._pin is None or s > self._pin}))
        if (self._pin, writing) == self._pinned:
            return
        self._pinned = (self._pin, writing)
        for n in self.nodes:
            n.actor.pin_snapshot.remote(n.folder, self._pin, writing)

    def held_part(self, step: int, rank: int, node_rank: int, nbytes: int, every: int, taken: float,
                  peer: bool = True) -> None:
        """A rank's part of ``step`` (captured at ``taken``) is on node ``node_rank``: noted, and copied to its
        peer (``peer`` False: a save's snapshot between due steps, which stays on its node)."""
        self.held.setdefault(step, {}).setdefault(rank, set()).add(self.nodes[node_rank].node_id)
        self.taken[step] = max(self.taken.get(step, taken), taken)
        self.world[step] = self._world
        self.nbytes[rank], self.every[rank] = nbytes, every
        self._node_of[rank] = node_rank
        if len(self.nodes) > 1 and peer:  # every rank's newest part waits for its copy (older ones waiting are skipped)
            self._waiting[rank] = max(self._waiting.get(rank, step), step)
        if self._writing.get(rank) is not None and self._writing[rank] <= step:
            del self._writing[rank]  # (its part of the step it was writing is held, or that write was given up)
        if len(self.held[step]) == self._world and (self._pin is None or step > self._pin):
            self._pin = step  # every rank's part is held: the nodes keep it until a newer one is whole
        self._send_pins()
        self._forget_old()
        self.poll()

    def news(self) -> str | None:
        """Once a run, when every rank has written a part: how often snapshots are taken, and the host memory one
        takes on each node (kept twice on it, and once more on its peer)."""
        if self.said or not self.nodes or len(self.nbytes) < self._world:
            return None
        self.said = True
        per_node: dict[int, int] = {}
        for rank, node in self._node_of.items():
            per_node[node] = per_node.get(node, 0) + self.nbytes.get(rank, 0)
        copies = "and once on its peer node" if len(self.nodes) > 1 else "(one node: no peer keeps a copy)"
        return (f"raylaunch: snapshots in memory every {max(self.every.values())} optimizer steps (now): "
                + ", ".join(f"node {n} {b / 2**20:.1f} MiB" for n, b in sorted(per_node.items()))
                + f" a snapshot, its newest two kept on the node {copies} (checkpoint.snapshots)")

    def poll(self) -> None:
        """Note the copies done; start the waiting ones whose node has none in flight."""
        if self._notes:  # each read once done: a note to a node gone meanwhile fails, and is simply not there
            done, self._notes = ray.wait(self._notes, num_returns=len(self._notes), timeout=0)
            for ref in done:
                try:
                    ray.get(ref)
                except Exception:  # noqa: BLE001
                    pass
        if self._copies:
            done, _ = ray.wait(list(self._copies), num_returns=len(self._copies), timeout=0)
            for ref in done:
                step, rank, peer, source = self._copies.pop(ref)
                try:
                    kept = ray.get(ref)
                except Exception:  # noqa: BLE001 - a node gone meanwhile: that copy is simply not there
                    kept = False
                src = self.nodes[source]  # its rank's snapshot's work has ended there (``auto`` measures it)
                self._notes.append(src.actor.snapshot_part_copied.remote(src.folder, step, rank))
                if kept and step in self.held:
                    self.held[step].setdefault(rank, set()).add(peer)
                    self.copied += 1
        busy = {rank for _, rank, _, _ in self._copies.values()}  # one copy in flight a rank
        for rank in [r for r in self._waiting if r not in busy]:
            self._copy(self._waiting.pop(rank), rank, self._node_of[rank])

    def settle(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the copies to the peers in flight and waiting (after a stop notice: the
        snapshot of the step the ranks stopped at leaves a drained node before it goes)."""
        deadline = time.monotonic() + timeout_s
        self.poll()
        while (self._copies or self._waiting) and time.monotonic() < deadline:
            ray.wait(list(self._copies), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            self.poll()

    def commit_took(self, nbytes: int, seconds: float) -> None:
        """A checkpoint of ``nbytes`` was committed ``seconds`` after its save was asked for: the pace a snapshot's
        commit is estimated at."""
        if nbytes > 0 and seconds > 0:
            self.rates = (self.rates + [nbytes / seconds])[-RATES:]

    def commit_rate(self) -> float | None:
        """The median bytes a second of the latest commits; None before any."""
        return sorted(self.rates)[len(self.rates) // 2] if self.rates else None

    def whole(self, after_step: int, dead: set[int]) -> SnapshotPlan | None:
        """The newest snapshot after ``after_step`` whose every part a node of this attempt holds (but the nodes
        ``dead``, by node rank)."""
        alive = {n.node_id for i, n in enumerate(self.nodes) if i not in dead}
        return self.choose(alive, self._world, after_step)

    def upload_plan(self, plan: SnapshotPlan, away: set[str], timeout_s: float = 10.0) -> SnapshotUpload:
        """Which node of this attempt writes each rank's part of ``plan`` to storage: one that holds it, a node not
        ``away`` (node ids: being drained) first, then the rank's own; its files, as that node holds them."""
        index = {n.node_id: i for i, n in enumerate(self.nodes)}
        asked = {}
        for rank in range(plan.world_size):
            holders = sorted((h for h in plan.holders[rank] if h in index),
                             key=lambda h: (h in away, index[h] != self._node_of.get(rank), index[h]))
            if not holders:
                raise FileNotFoundError(f"rank {rank}'s part of the snapshot of step {plan.step} is on no node of "
                                        "this attempt")
            node = self.nodes[index[holders[0]]]
            asked[rank] = (index[holders[0]], node.actor.snapshot_part_files.remote(node.folder, plan.step, rank))
        refs = [ref for _, ref in asked.values()]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if len(ready) < len(refs):
            raise TimeoutError(f"the nodes did not say which files the snapshot of step {plan.step} holds within "
                               f"{timeout_s:g} s")
        sends, seen, nbytes = {}, set(), 0
        for rank, (node_rank, ref) in sorted(asked.items()):
            files = ray.get(ref)
            if files is None:
                raise FileNotFoundError(f"rank {rank}'s part of the snapshot of step {plan.step} was no longer held "
                                        f"by node {node_rank}")
            mine = tuple(rel for rel in sorted(files) if rel not in seen)
            seen.update(mine)
            nbytes += sum(int(files[rel]["size"]) for rel in mine)
            sends[rank] = (node_rank, mine)
        return SnapshotUpload(plan.step, plan.world_size, sends, nbytes)

    def upload(self, up: SnapshotUpload, target_uri: str, until: float) -> dict[str, dict]:
        """Each node writes the parts ``up`` gives it into ``target_uri`` (a staging folder on storage) before
        ``until`` (Unix time); returns every file's ``{"size", "sha256"}``. Raises ``TimeoutError`` when they did not
        (what they wrote stays in staging, never committed), or what a node raised."""
        calls = [self.nodes[node].actor.store_snapshot_part.remote(self.nodes[node].folder, up.step, rank,
                                                                   list(rels), target_uri, until)
                 for rank, (node, rels) in sorted(up.sends.items())]
        ready, _ = ray.wait(calls, num_returns=len(calls), timeout=max(0.0, until - time.time()) + 1.0)
        if len(ready) < len(calls):
            raise TimeoutError(f"{len(calls) - len(ready)} of the {len(calls)} parts were not written in time")
        files: dict[str, dict] = {}
        for part in ray.get(calls):
            files.update(part)
        return files

    def _copy(self, step: int, rank: int, source: int) -> None:
        """A rank's part of ``step`` on node ``source`` copied to its peer: the next node (in node rank order) not
        being drained. Where every other node is, none: a copy there would go with it (the snapshot a stop notice's
        ranks take would send a 576 MiB part to the drained node and hold the stop for it), and the part's node is
        told its copy ended."""
        n = len(self.nodes)
        peer = next((p for p in ((source + i) % n for i in range(1, n)) if p not in self.draining), None)
        src = self.nodes[source]
        if peer is None:
            self._notes.append(src.actor.snapshot_part_copied.remote(src.folder, step, rank))
            return
        dst = self.nodes[peer]
        offer = src.actor.offer_snapshot_part.remote(src.folder, step, rank, background=True)
        ref = dst.actor.keep_peer_part.remote(dst.folder, step, rank, offer, self.memory_mb)
        self._copies[ref] = (step, rank, dst.node_id, source)

    def _forget_old(self) -> None:
        """Only the newest ``REMEMBER`` steps are kept in the book (the nodes prune their parts sooner; a part the
        book names that a node no longer holds fails the assembly, and the restart resumes from storage). The
        steps whose parts the peers hold lag the nodes' own newest: they must not be forgotten for them."""
        if len(self.held) > REMEMBER:
            for step in sorted(self.held)[:len(self.held) - REMEMBER]:
                self._forget(step)

    def _forget(self, step: int) -> None:
        self.held.pop(step, None)
        self.world.pop(step, None)
        self.taken.pop(step, None)

    def choose(self, alive: set[str], world_size: int, after_step: int) -> SnapshotPlan | None:
        """The newest snapshot after ``after_step`` (the last committed checkpoint's) of ``world_size`` whose every
        rank's part is held on a node in ``alive`` (node ids)."""
        self.poll()
        for step in sorted(self.held, reverse=True):
            if step <= after_step:
                return None
            if self.world.get(step) != world_size:
                continue
            holders = {r: tuple(sorted(n for n in self.held[step].get(r, ()) if n in alive))
                       for r in range(world_size)}
            if all(holders.values()):
                return SnapshotPlan(step, world_size, holders)
        return None

    def missed(self, alive: set[str], world_size: int, after_step: int) -> tuple[MemoryMissed, str]:
        """Why no snapshot newer than ``after_step`` is whole on the nodes ``alive`` (``choose`` found none), and
        each rank's newest part on them, in words: none had every rank's part on any node (the commit of
        ``after_step`` is the newest whole state), or one had, with a part only on a node not ``alive``.

        >>> book = SnapshotBook("run", None, held={12: {0: {"a"}}, 14: {1: {"b"}}}, world={12: 2, 14: 2})
        >>> book.missed({"a", "b"}, 2, 10)
        (<MemoryMissed.NONE_NEWER: 'none_newer'>, 'rank 0: step 12, rank 1: step 14')
        >>> book.held[14][0] = {"a"}  # (whole, with rank 1's part on node b only)
        >>> book.missed({"a"}, 2, 10)[1]
        'rank 0: step 14, rank 1: none; the snapshot of step 14 was whole with the nodes gone'
        >>> book.missed({"a"}, 2, 10)[0]
        <MemoryMissed.NODE_LOST: 'node_lost'>
        """
        newest = {r: max((s for s, parts in self.held.items() if s > after_step and self.world.get(s) == world_size
                          and parts.get(r, set()) & alive), default=None) for r in range(world_size)}
        words = ", ".join(f"rank {r}: " + ("none" if s is None else f"step {s}") for r, s in newest.items())
        anywhere = {n for parts in self.held.values() for nodes in parts.values() for n in nodes}
        if (lost := self.choose(anywhere, world_size, after_step)) is not None:
            return MemoryMissed.NODE_LOST, f"{words}; the snapshot of step {lost.step} was whole with the nodes gone"
        return MemoryMissed.NONE_NEWER, words

    def assemble(self, plan: SnapshotPlan, attempt: int, infos: list[Any], actors: list[Any]) -> MemoryResume:
        """Each node of the attempt (``infos``/``actors``, by node rank) puts the snapshot of ``plan`` together in its
        memory; raises when one cannot (a part pruned or its node gone meanwhile: the caller resumes from storage)."""
        self.attach(infos, actors, plan.world_size, resumed=plan.step)  # (its parts stay pinned while read)
        by_id = {n.node_id: n for n in self.nodes}
        plan = self._verified(plan, by_id)
        calls, fetched_from = [], set()
        for node_rank, n in enumerate(self.nodes):
            missing = [r for r in range(plan.world_size) if n.node_id not in plan.holders[r]]
            parts = []
            for r in missing:
                holder = next((by_id[h] for h in plan.holders[r] if h in by_id), None)
                if holder is None:
                    raise FileNotFoundError(f"rank {r}'s part of the snapshot of step {plan.step} is on no node of "
                                            "this attempt")
                fetched_from.add(holder.node_id)
                parts.append(holder.actor.offer_snapshot_part.remote(holder.folder, plan.step, r))
            calls.append(n.actor.assemble_snapshot.remote(n.folder, plan.step, plan.world_size, attempt, missing,
                                                          *parts))
        ready, _ = ray.wait(calls, num_returns=len(calls), timeout=ASSEMBLE_S)
        if len(ready) < len(calls):
            raise TimeoutError(f"the nodes did not put the snapshot of step {plan.step} together within {ASSEMBLE_S:g} s")
        paths = ray.get(calls)
        own = all(n.node_id in plan.holders[r] for n in self.nodes for r in range(plan.world_size))
        source = ("memory on each node" if own else
                  "memory (" + ", ".join(sorted({f"node {i}" for i, n in enumerate(self.nodes)
                                                   if n.node_id in fetched_from})) + " sent the parts others lacked)")
        return MemoryResume(plan.step, dict(enumerate(paths)), source)

    def _verified(self, plan: SnapshotPlan, by_id: dict[str, _Node]) -> SnapshotPlan:
        """``plan`` with only the holders of this attempt that still hold each part (asked, not taken from the book:
        a node prunes its peer's older copies, and a rank its own older parts, without saying so; a node the book
        named that no longer held its part failed the whole assembly, where another node held it). Raises
        ``FileNotFoundError`` when no node of the attempt holds a rank's part."""
        asked = {(r, h): by_id[h].actor.snapshot_part_files.remote(by_id[h].folder, plan.step, r)
                 for r in range(plan.world_size) for h in plan.holders[r] if h in by_id}
        ready, _ = ray.wait(list(asked.values()), num_returns=len(asked), timeout=ASSEMBLE_S)
        done = set(ready)
        holders: dict[int, tuple[str, ...]] = {}
        for r in range(plan.world_size):
            held = []
            for h in plan.holders[r]:
                if (ref := asked.get((r, h))) is None:
                    continue  # (a node not of this attempt: the parts are read from this attempt's nodes)
                try:
                    if ref in done and ray.get(ref) is not None:
                        held.append(h)
                        continue
                except Exception:  # noqa: BLE001 - that node's actor failed: not a holder
                    pass
                self.held.get(plan.step, {}).get(r, set()).discard(h)
            if not held:
                raise FileNotFoundError(f"rank {r}'s part of the snapshot of step {plan.step} is on no node of this "
                                        "attempt any more")
            holders[r] = tuple(held)
        return SnapshotPlan(plan.step, plan.world_size, holders)

    def drop(self, group: Any) -> None:
        """Every snapshot of the run on the nodes still there (at the run's end): through the node actors of
        ``group`` (None: none holds nodes now, after a node lost and no new reservation), and a task pinned to each
        other node the run used that is still alive."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        refs, done = [], set()
        if group is not None:
            for i, a in zip(group.infos, group.actors):
                refs.append(a.drop_snapshots.remote(f"{i.snapshot_root}/{self.key}"))
                done.add(i.node_id)
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        for node_id, folder in self.roots.items():
            if node_id in alive and node_id not in done:
                refs.append(_drop_run.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
                            .remote(folder.rsplit("/", 1)[0]))
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=30)


@ray.remote(num_cpus=0)
def _drop_run(folder: str) -> None:
    """A run's snapshots on the node this runs on (``cluster.snapshots.drop_run``)."""
    from cluster.snapshots import drop_run

    drop_run(folder)
