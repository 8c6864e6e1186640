"""The driver: reserves the nodes, runs attempts, gathers metrics, commits checkpoints.

It is a small loop over attempts. Each attempt starts every rank with a
fresh rendezvous and restores the latest committed checkpoint; the driver
polls the node actors, writes what the ranks report into the run directory,
and ends the attempt as soon as any rank fails (stopping every other rank on
every node), or when all succeed.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, TextIO

import psutil
import ray

from cluster.context import WorkerContext, WorkerPayload
from cluster.files import join_uri
from cluster.group import ACTOR_NAMESPACE, JobEnv, NodeGroup, Placement, PlacementError, RendezvousError, resolve_placement
from cluster.node import NodePoll, RankFailure
from cluster.worker import check_train_fn
from jobs.board import Board
from jobs.environment import Secrets, check_requirements
from jobs.hangs import HEARTBEAT_LOST, is_hang, where_ranks_are
from jobs.spec import JobSpec, spec_to_dict
from jobs.storage import RECORD_KEYS, CheckpointError, RunDir, StorageError
from jobs.strategy import AccelerateConfig, read_accelerate_config

__all__ = ["Driver", "RunError", "RunResult", "group_failures"]

# How long the other ranks get to report their own failure once one rank failed.
FAILURE_GRACE_S = 2.0
# How often the TensorBoard files are brought up to date while an attempt runs.
BOARD_FLUSH_S = 2.0


class RunError(RuntimeError):
    """The run could not start or did not succeed; the message is for the user."""


@dataclass
class RunResult:
    status: str  # running | succeeded | failed | stopped
    run_dir: str
    attempts: int = 0
    restarts: int = 0
    preemptions: int = 0
    num_nodes: int = 0
    world_size: int = 0
    last_step: int | None = None
    last_metrics: dict = field(default_factory=dict)
    checkpoints: list[str] = field(default_factory=list)
    start_time: float = 0.0
    end_time: float = 0.0
    error: str | None = None
    return_value: Any = None  # rank 0's
    rank_results: dict = field(default_factory=dict)  # every rank's return value
    nodes: list[dict] = field(default_factory=list)
    # When the first attempt got where (Unix times): process_start, driver_ready (imports and
    # ray.init done), reserved, ranks_started, arrived, joined (last rank), first_step (rank 0).
    timeline: dict = field(default_factory=dict)
    # While the run runs: how `raylaunch stacks` reaches its node actors (ray_address,
    # namespace, node_actors: their names in node order, ranks: each node's world ranks).
    live: dict = field(default_factory=dict)


@dataclass
class _Attempt:
    """What the driver tracks while one attempt runs."""

    number: int
    staging: str
    node_of: dict[int, int]  # world rank -> node rank
    arrived: set[int] = field(default_factory=set)  # ranks at the rendezvous
    joined: set[int] = field(default_factory=set)  # ranks in the process group
    preempted: set[int] = field(default_factory=set)  # ranks that checkpointed in a grace period and stopped
    # step -> rank -> the files of its saved part it reported ({rel: {size, sha256}}; empty on a local path)
    parts: dict[int, dict[int, dict]] = field(default_factory=lambda: defaultdict(dict))
    steps: dict[int, int] = field(default_factory=dict)  # rank -> the latest step it logged

    @property
    def world(self) -> int:
        return len(self.node_of)


@dataclass
class _Outcome:
    ok: bool
    error: str | None = None
    lost_nodes: list[int] = field(default_factory=list)
    preempted: bool = False  # a rank was ended by SIGTERM: the attempt was preempted, it did not fail


def group_failures(failures: list[RankFailure]) -> str:
    """``[ranks 0, 1] ValueError: ...`` once per distinct error, with one traceback each."""
    groups: dict[str, list[RankFailure]] = defaultdict(list)
    for f in failures:
        groups[f.message].append(f)
    parts = []
    for message, fs in groups.items():
        ranks = sorted(f.rank for f in fs)
        label = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        tb = next((f.traceback for f in fs if f.traceback), "")
        parts.append(f"[{label}] {message}" + (f"\n{tb.rstrip()}" if tb else ""))
    return "\n".join(parts)


class Driver:
    """Runs one job spec on the connected Ray cluster.

    >>> # result = Driver(spec, can_grow=False).run()   # needs ray.init() first
    """

    def __init__(
        self,
        spec: JobSpec,
        *,
        can_grow: bool = True,
        fresh: bool = False,
        out: TextIO | None = None,
        poll_interval_s: float = 0.25,
    ) -> None:
        self.spec = spec
        self.can_grow = can_grow
        self.fresh = fresh
        self.out = out
        self.poll_interval_s = poll_interval_s
        self.run_dir = RunDir(spec.storage, spec.name)
        self._result = RunResult(status="failed", run_dir=self.run_dir.uri)
        self._token: str | None = None
        self._last_print = 0.0
        self._board: Board | None = None
        self._store_errors: set[str] = set()
        self.group: NodeGroup | None = None  # the nodes of the current attempt
        self.secrets = Secrets()  # env.secrets' values, read in preflight
        self.accelerate: AccelerateConfig | None = None  # the accelerate section and its config file, in preflight

    def _say(self, text: str) -> None:
        print(self.secrets.mask(text), file=self.out or sys.stdout, flush=True)

    # --- the whole run ------------------------------------------------------------

    def preflight(self) -> None:
        """Check the train_fn and prepare the run directory; no cluster needed.

        Raises ``ImportError``/``AttributeError`` for a train_fn that does not
        exist and ``StorageError`` for storage that cannot be written.
        """
        if self._token is not None:
            return
        self.secrets = Secrets.read(self.spec.env)  # before anything is written: a missing one is a spec error
        check_train_fn(self.spec.train_fn)
        self.accelerate = read_accelerate_config(self.spec)
        if note := self.accelerate.note():
            self._say(note)
        if warning := check_requirements(self.spec.env.requirements):
            self._say(warning)
        if self.fresh and self.run_dir.exists():
            name = f"{self.spec.name}-{time.strftime('%Y%m%d-%H%M%S')}"
            self._say(f"raylaunch: --fresh: starting a new run directory {name} (the old one is kept)")
            self.spec = dataclasses.replace(self.spec, name=name)
            self.run_dir = RunDir(self.spec.storage, name)
            self._result.run_dir = self.run_dir.uri
        self._token = self.run_dir.prepare(spec_to_dict(self.spec))

    def run(self) -> RunResult:
        """Run to the end; returns the result, which is also in ``result.json``."""
        self.preflight()
        r = self._result
        r.start_time = time.time()
        r.timeline = {"process_start": psutil.Process().create_time(), "driver_ready": r.start_time}
        # A rerun of the same run continues its attempt numbers, so metrics.jsonl
        # rows from before and after the resume stay apart.
        r.attempts = int((self.run_dir.read_result() or {}).get("attempts") or 0)
        self._board = Board(self.run_dir)
        try:
            s = self.spec.scaling
            placement = resolve_placement(s.num_nodes, s.workers_per_node, s.use_gpu, s.cpus_per_worker)
            r.num_nodes, r.world_size = placement.num_nodes, placement.world_size
            self._say(
                f"raylaunch: {self.spec.name}: {placement.num_nodes} nodes x {placement.workers_per_node} "
                f"workers = world size {placement.world_size} ({'GPU, nccl' if placement.use_gpu else 'CPU, gloo'})"
            )
            self._say(f"raylaunch: run directory {self.run_dir.uri}")
            try:
                self.accelerate.check_devices(placement.use_gpu)
            except ValueError as exc:
                raise RunError(str(exc)) from None
            self._attempts(placement)
        except (PlacementError, RendezvousError, StorageError, CheckpointError, RunError) as exc:
            r.status, r.error = "failed", str(exc)
        except KeyboardInterrupt as exc:
            r.status, r.error = "stopped", str(exc) or "interrupted (Ctrl-C)"
            self._say(f"raylaunch: {r.error}: stopping every rank")
            if self.group is not None and self.group.contexts:
                # A run is usually stopped because it looks stuck: say where it was.
                where = where_ranks_are(self.group, self.run_dir, r.attempts)
                r.error += "\n" + where
                self._say(f"raylaunch: {where}")
        except Exception as exc:  # the runner's own failure: the run still ends recorded, never "running"
            import traceback

            r.status = "failed"
            r.error = f"the driver failed: {type(exc).__name__}: {str(exc)[:2000]}"
            print(self.secrets.mask(f"raylaunch: {r.error}; every rank is stopped, what was committed stays. The driver's "
                  f"traceback (a bug in raylaunch, please report it):\n{traceback.format_exc()}"),
                  file=sys.stderr)
        finally:
            r.live = {}
            if self.group is not None:
                self.group.shutdown()
                self.group = None
            r.end_time = time.time()
            # What the ranks returned or raised is written and printed with env.secrets masked.
            r.error, r.return_value, r.rank_results = self._masked((r.error, r.return_value, r.rank_results))
            try:
                self.run_dir.clear_staging()  # no rank runs now: what a failed save left goes
                self._board.close()
                self._write_result()
                self.run_dir.close()
            except OSError as exc:
                self._say(f"raylaunch: could not write result.json to {self.run_dir.uri}: {exc}")
        return r

    def _masked(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.secrets.mask(value)
        if isinstance(value, (list, tuple)):
            return type(value)(self._masked(v) for v in value)
        if isinstance(value, dict):
            return {k: self._masked(v) for k, v in value.items()}
        return value

    def _write_result(self) -> None:
        """``result.json`` as the run stands: written when each attempt starts, and at the end."""
        try:
            self._result.checkpoints = [c.uri for c in self.run_dir.committed_checkpoints()]
        except OSError as exc:  # the outcome is still recorded, with the checkpoints last seen
            self._say(f"raylaunch: could not list the committed checkpoints: {exc}")
        self.run_dir.write_result(dataclasses.asdict(self._result))

    def _reserve(self, placement: Placement) -> NodeGroup:
        """Reserve one bundle and start one actor per node; check the storage is shared."""
        env = self.spec.env
        group = NodeGroup.create(
            placement, timeout_s=self.spec.timeouts.placement_s, can_grow=self.can_grow, on_wait=self._say,
            socket_ifname=self.spec.rendezvous.socket_ifname,
            env=JobEnv(vars={k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in env.vars.items()},
                       secrets=self.secrets.values, pip=env.requirements),
        )
        self.group = group
        self._mark("reserved")
        self._result.live = {"ray_address": ray.get_runtime_context().gcs_address, "namespace": ACTOR_NAMESPACE,
                             "node_actors": group.actor_names, "ranks": group.ranks_by_node}
        self._result.nodes = [
            {"node_rank": i, "node_id": info.node_id, "ip": info.ip, "hostname": info.hostname,
             "socket_ifname": socket.name}
            for i, (info, socket) in enumerate(zip(group.infos, group.sockets))
        ]
        for i, (info, socket) in enumerate(zip(group.infos, group.sockets)):
            self._say(f"raylaunch: node {i} ({info.ip}, {info.hostname}): {socket.describe()}")
        self._check_shared_storage(group, self._token)
        return group

    def _check_shared_storage(self, group: NodeGroup, token: str | None) -> None:
        """Every node must read the marker the driver wrote: a node-local 'shared' path fails here."""
        marker = self.run_dir.marker_uri()
        seen = ray.get([a.read_file.remote(marker) for a in group.actors])
        bad = [i for i, v in enumerate(seen) if v != token]
        if bad:
            raise StorageError(
                f"nodes {bad} cannot read {marker}, which the driver wrote: the storage path is not "
                "shared by every node. Use an NFS mount present on every node or an object store (s3://...)."
            )

    def _attempts(self, placement: Placement) -> None:
        r = self._result
        policy = self.spec.failure
        while True:
            if self.group is None:
                self._reserve(placement)
            r.attempts += 1
            # Every rank of the previous attempt is stopped: what it left half-saved goes.
            self.run_dir.clear_staging()
            latest = self.run_dir.loadable_checkpoint(warn=self._say)
            if latest is not None:
                self._say(f"raylaunch: attempt {r.attempts}: resuming from {latest.uri} (step {latest.step})")
            r.status = "running"
            self._write_result()
            self._board.start_attempt(latest.step if latest else None)
            outcome = self._attempt(self.group, r.attempts, latest.uri if latest else None)
            if outcome.ok:
                r.status, r.error = "succeeded", None
                return
            r.error = outcome.error
            if outcome.lost_nodes:
                # The placement group's bundles on lost nodes are gone: reserve anew,
                # on the nodes that are left or that the cluster adds.
                self.group.shutdown()
                self.group = None
            if outcome.preempted and r.preemptions < policy.max_preemptions:
                r.preemptions += 1
                self._say(f"raylaunch: attempt {r.attempts} was preempted (SIGTERM); restarting from the last "
                          f"committed checkpoint ({r.preemptions} of {policy.max_preemptions} preemptions; "
                          "restarts are not used up)")
            elif r.restarts < policy.max_restarts:
                r.restarts += 1
                self._say(f"raylaunch: attempt {r.attempts} failed; restarting from the last committed "
                          f"checkpoint ({r.restarts} of {policy.max_restarts} restarts)")
            else:
                r.status = "failed"
                return

    # --- one attempt ------------------------------------------------------------------

    def _attempt(self, group: NodeGroup, attempt: int, restore_uri: str | None) -> "_Outcome":
        spec = self.spec
        staging = self.run_dir.staging_uri(attempt)
        use_gpu = group.placement.use_gpu

        def payload(ctx: WorkerContext, events_path: str) -> WorkerPayload:
            return WorkerPayload(
                context=ctx,
                attempt=attempt,
                train_fn=spec.train_fn,
                config=dict(spec.config),
                events_path=events_path,
                staging_uri=staging,
                restore_uri=restore_uri,
                backend="nccl" if use_gpu else "gloo",
                rendezvous_timeout_s=spec.timeouts.rendezvous_s,
                collective_timeout_s=spec.timeouts.collective_s,
                accelerate=self.accelerate.section,
            )

        contexts = group.start(payload, attempt, spec.timeouts.rendezvous_s, spec.rendezvous.port_range)
        self._mark("ranks_started")
        a = _Attempt(attempt, staging, {c.world_rank: c.node_rank for c in contexts})
        started = last_board = time.monotonic()
        states = ["running"] * len(group.actors)
        returns: dict[int, Any] = {}
        failures: list[RankFailure] = []
        lost: list[int] = []
        while True:
            polls = group.poll(lost_after_s=spec.timeouts.heartbeat_s)
            for node_rank, p in enumerate(polls):
                self._forward(node_rank, p, a)
                states[node_rank] = p.state
                returns.update(p.returns)
                failures.extend(p.failures)
                if p.state == "lost":
                    lost.append(node_rank)
                failures.extend(self._silent(group, node_rank, p, a, known={f.rank for f in failures}))
            if failures:
                break
            if all(s == "succeeded" for s in states):
                if a.preempted:
                    step = self._result.last_step
                    return _Outcome(False, f"preempted: ranks {sorted(a.preempted)} checkpointed "
                                           f"within the grace period at step {step} and stopped", preempted=True)
                break
            if len(a.joined) < a.world and time.monotonic() - started > spec.timeouts.rendezvous_s:
                # Name the ranks that never reached the rendezvous; if all did, the group itself did not form.
                missing = sorted(set(a.node_of) - a.arrived) or sorted(set(a.node_of) - a.joined)
                nodes = sorted({a.node_of[m] for m in missing})
                where = where_ranks_are(group, self.run_dir, attempt)
                group.stop()
                return _Outcome(False, (
                    f"ranks {missing} on nodes {nodes} did not join the process group within "
                    f"{spec.timeouts.rendezvous_s:g} s (timeouts.rendezvous_s); no rank trained\n{where}"
                ))
            if time.monotonic() - last_board > BOARD_FLUSH_S:
                self._board.flush()
                last_board = time.monotonic()
            time.sleep(self.poll_interval_s)
        if failures:
            # The same bug usually fails every rank within moments: wait briefly for the
            # other nodes to report theirs, so the error is grouped, not one rank's alone.
            grace = time.monotonic() + FAILURE_GRACE_S
            while time.monotonic() < grace and any(s == "running" for s in states):
                time.sleep(self.poll_interval_s)
                for node_rank, p in enumerate(group.poll(lost_after_s=spec.timeouts.heartbeat_s)):
                    if states[node_rank] != "running":
                        continue
                    self._forward(node_rank, p, a)
                    states[node_rank] = p.state
                    failures.extend(p.failures)
            # A hang: where was every rank? Read before they are stopped.
            where = where_ranks_are(group, self.run_dir, attempt, failures) if is_hang(failures) else ""
            # Stop everyone else now: a rank blocked in a collective would wait forever.
            for node_rank, p in enumerate(group.stop()):
                self._forward(node_rank, p, a)
            error = self.secrets.mask(group_failures(failures) + (f"\n{where}" if where else ""))
            print(f"raylaunch: attempt {attempt} failed:\n{error}", file=sys.stderr, flush=True)
            # A rank ended by SIGTERM (a spot node's shutdown) is the cause; its peers' collective
            # errors ("Connection reset by peer") are consequences and may be reported first.
            preempted = any(f.message == "killed by signal SIGTERM" for f in failures)
            return _Outcome(False, error, lost, preempted and not lost)
        self._result.return_value = _jsonable(returns.get(0))
        self._result.rank_results = {str(k): _jsonable(v) for k, v in sorted(returns.items())}
        return _Outcome(True)

    def _forward(self, node_rank: int, p, a: _Attempt) -> None:
        """Print and store one node's logs; handle its events."""
        by_rank: dict[int, list[str]] = defaultdict(list)
        for rank, _, line in p.logs:
            line = self.secrets.mask(line)  # before it is stored too
            self._say(f"[node {node_rank} rank {rank}] {line}")
            by_rank[rank].append(line)
        for rank, lines in by_rank.items():
            self._store(self.run_dir.append_log, rank, lines)
        self._events(p.events, a)

    def _events(self, events: list[dict], a: _Attempt) -> None:
        records = []
        for e in events:
            rank = e.get("rank", 0)
            kind = e.get("kind")
            if kind == "arrived":
                a.arrived.add(rank)
                if len(a.arrived) == a.world:
                    self._mark("arrived", e["time"])
            elif kind == "preempted":
                a.preempted.add(rank)
            elif kind == "preempt_notice":
                self._say(f"raylaunch: rank {rank} got a stop notice (SIGTERM): checkpointing at the next step")
            elif kind == "joined":
                a.joined.add(rank)
                if len(a.joined) == a.world:
                    self._mark("joined", e["time"])
            elif kind == "metrics":
                record = {"step": e.get("step"), "rank": rank, "node": a.node_of.get(rank), "attempt": a.number,
                          "time": e["time"], **e.get("values", {})}
                records.append(record)
                if record["step"] is not None:
                    a.steps[rank] = max(int(record["step"]), a.steps.get(rank, 0))
                if rank == 0:
                    self._mark("first_step", e["time"])
                    self._progress(record)
            elif kind == "resources" and rank in a.steps:
                # Peak memory, at the rank's latest step, beside its metrics.
                records.append({"step": a.steps[rank], "rank": rank, "node": a.node_of.get(rank),
                                "attempt": a.number, "time": e["time"],
                                **{k: v for k, v in e.items() if k.startswith("peak_")}})
            elif kind == "checkpoint":
                step = int(e["step"])
                a.parts[step][rank] = e.get("files") or {}
                if len(a.parts[step]) == a.world:
                    c = self.run_dir.commit_checkpoint(
                        join_uri(a.staging, f"checkpoint-{step:08d}"), step, a.number, a.world,
                        self.spec.checkpoint.keep, reported=_agreed(a.parts.pop(step).values())
                    )
                    self._say(f"raylaunch: committed checkpoint of step {step}: {c.uri}")
        self._store(self.run_dir.append_metrics, records)
        self._board.add(records)

    def _silent(self, group: NodeGroup, node_rank: int, p: NodePoll, a: _Attempt, known: set[int]) -> list[RankFailure]:
        """The ranks of a node that is lost, or that stopped beating, as failures (not those in ``known``)."""
        heartbeat_s = self.spec.timeouts.heartbeat_s
        if p.state == "lost":
            info = group.infos[node_rank]
            why = "was lost" if p.silent_s is None else (
                f"did not answer for {p.silent_s:.0f} s (timeouts.heartbeat_s is {heartbeat_s:g}): "
                "its host or its network link is down; treated as lost")
            return [RankFailure(rank=r, exitcode=-9, traceback="",
                                message=f"node {node_rank} ({info.node_id[:12]}, {info.ip}) {why}")
                    for r, n in sorted(a.node_of.items()) if n == node_rank]
        return [RankFailure(rank=rank, exitcode=-1, traceback="",
                            message=f"{HEARTBEAT_LOST} {age:.0f} s (timeouts.heartbeat_s is {heartbeat_s:g}): "
                                    "the process is stopped or frozen")
                for rank, age in p.beat_age_s.items() if age > heartbeat_s and rank not in known]

    def _mark(self, phase: str, at: float | None = None) -> None:
        """The first time the run got to ``phase`` (the first attempt's start-up, for `show` and the bench)."""
        self._result.timeline.setdefault(phase, at or time.time())

    def _store(self, write, *args) -> None:
        """Write metrics or logs; storage that fails (full, say) is reported, and the driver
        keeps supervising the ranks, whose own errors say more."""
        try:
            write(*args)
        except OSError as exc:
            if str(exc) not in self._store_errors:
                self._store_errors.add(str(exc))
                self._say(f"raylaunch: could not write to the run directory {self.run_dir.uri}: {exc}")

    def _progress(self, record: dict) -> None:
        r = self._result
        if record.get("step") is not None:
            r.last_step = max(r.last_step or 0, int(record["step"]))
        values = {k: v for k, v in record.items() if k not in RECORD_KEYS}
        r.last_metrics.update(values)
        now = time.monotonic()
        # At most one progress line a second, but never drop an evaluation.
        if now - self._last_print < 1.0 and not any("eval" in k for k in values):
            return
        self._last_print = now
        shown = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items())
        self._say(f"raylaunch: step {record.get('step')} {shown}")


def _jsonable(value: Any) -> Any:
    import json

    try:
        json.dumps(value)
        return value
    except TypeError:
        return repr(value)


def _agreed(reports) -> dict[str, dict]:
    """The files the ranks reported for one checkpoint; a file two ranks reported
    differently (both wrote it, with ``save_on_each_node``) is left out, so the commit
    hashes what storage holds."""
    out: dict[str, dict] = {}
    clash: set[str] = set()
    for files in reports:
        for rel, meta in files.items():
            if out.setdefault(rel, meta) != meta:
                clash.add(rel)
    return {rel: meta for rel, meta in out.items() if rel not in clash}
