"""One attempt of a run, as an object: its ranks are started on a group of nodes; ``Attempt.step`` polls every node
once, routes what they said (``jobs.driver.routing``) and decides whether the attempt is over; ``Attempt.run``
steps until it is and returns the typed outcome that ``jobs.driver.policy.next_step`` consumes.

Everything that ends an attempt is decided here, each rule in one method:

- a rank failed (its node said so, or the silence rule made one): the others get ``FAILURE_GRACE_S`` to report
  theirs, then every rank is stopped (``_fail``); how it ended, a failure or a preemption, is
  ``policy.attempt_ended``'s, the one place a preemption is decided, and whose fault it was ``policy.blame``'s;
- silence (``_silence``): a node whose poll waited past ``timeouts.heartbeat_s`` is lost, a rank whose heartbeat
  is older is stopped or frozen; both become rank failures (``RankFailure.node_lost``, ``RankFailure.silent``);
- every node's ranks returned: succeeded, or preempted when they checkpointed within a stop notice's grace period;
- the group did not form within ``timeouts.rendezvous_s``;
- an elastic run below ``num_nodes`` saw nodes come back, and a checkpoint was committed since: it stops to grow.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable

import ray

from cluster.nodes.group import NodeGroup
from cluster.nodes.node import NodeInfo
from cluster.protocol import FailureCause, NodePoll, NodeState, RankFailure
from jobs.driver.hangs import is_hang, where_ranks_are
from jobs.driver.policy import AttemptOutcome, WorldSize, attempt_ended, blame
from jobs.driver.record import Recorder
from jobs.driver.routing import AttemptRouter, AttemptState, group_failures
from jobs.run.events import Outcome
from jobs.run.storage import RunDir

__all__ = ["Attempt"]

# How long a node's actor holds the driver's poll while its ranks report only metrics and log lines: it answers
# at once when a rank ends or says anything else (``cluster.nodes.node.NodeActor.poll``), so this is the lag of metrics
# rows and log lines, and each node is called about once a second instead of four times (bench/results.md: the
# CPU beside the ranks).
POLL_HOLD_S = 1.0
# How long a node holds its ranks' routine rows (metrics, pace, resources) before answering a held poll. On a job of
# FRESH_ROWS_NODES nodes or fewer, the whole hold: one poll a second per node, what keeps raylaunch's CPU beside the
# ranks at torchrun's + 0.012 cores (make bench, world size 2; answering at 0.5 s doubled the driver's and the node
# actor's share). On larger jobs ROW_AGE_S, so a row reaches metrics.jsonl within a second at 1,024 ranks
# (make bench-scale: p99 3.3 s when every node held its rows a second and the driver polled every n / 128 s).
ROW_AGE_S = 0.5
FRESH_ROWS_NODES = 8
# How long the other ranks get to report their own failure once one rank failed: none where every failure so far
# is a rank killed outright or a node lost (``_fail``).
FAILURE_GRACE_S = 2.0
# How often the TensorBoard files are brought up to date while an attempt runs.
BOARD_FLUSH_S = 2.0
# How often, at most, where training stands goes to events.jsonl (what a killed driver's books can miss).
WORK_EVERY_S = 5.0
# How often an elastic run below num_nodes looks for nodes to grow back onto.
GROW_CHECK_S = 2.0
# How often the driver asks Ray which nodes it drains (a preemption with a deadline, the autoscaler's scale-down).
DRAIN_CHECK_S = 1.0


class Attempt:
    """One attempt whose ranks ``group`` has started (their rendezvous under way).

    ``grown`` says which larger world size the cluster's nodes allow now (None: none, or the run is not elastic);
    ``mask`` hides env.secrets' values in the error it prints.
    """

    def __init__(self, group: NodeGroup, route: AttemptRouter, *, recorder: Recorder, run_dir: RunDir,
                 heartbeat_s: float, rendezvous_s: float, grown: Callable[[], WorldSize | None],
                 mask: Callable[[str], str], poll_interval_s: float = 0.25) -> None:
        self.group = group
        self.route = route
        self.recorder = recorder
        self.run_dir = run_dir
        self.heartbeat_s = heartbeat_s  # timeouts.heartbeat_s: the silence rule's one number
        self.rendezvous_s = rendezvous_s
        self._grown = grown
        self._mask = mask
        self.poll_interval_s = poll_interval_s
        self.returns: dict[int, Any] = {}  # world rank -> what it returned
        self.failures: list[RankFailure] = []
        self.lost: list[int] = []  # node ranks
        self.grow: WorldSize | None = None  # the larger size seen, grown to at the next committed checkpoint
        self._grow_seen = 0.0  # when nodes to grow onto were first seen
        self.started = self._last_board = self._last_grow_check = self._last_work = time.monotonic()
        self._last_drain_check = self.started
        self.drained: dict[int, float] = {}  # node rank -> its drain's deadline (Unix time; 0: none)
        self._prewarm = True  # spare nodes' warm rank hosts are started during a drain (``NodeGroup.prewarm``)
        self._max_age_s = ROW_AGE_S if len(group.actors) > FRESH_ROWS_NODES else POLL_HOLD_S

    @property
    def state(self) -> AttemptState:
        return self.route.a

    @property
    def number(self) -> int:
        return self.route.a.number

    def run(self) -> AttemptOutcome:
        """Step until the attempt ends: a round every ``poll_interval_s`` at most, however many nodes (held polls
        pace the rounds: a node answers when it has news, or its rows waited their age), so no row waits a round
        of n / 128 s."""
        while True:
            began = time.monotonic()
            if (outcome := self.step()) is not None:
                return outcome
            time.sleep(max(0.0, self.poll_interval_s - (time.monotonic() - began)))

    def step(self) -> AttemptOutcome | None:
        """Poll every node once, route what they said, decide: how the attempt ended, or None while it runs."""
        self._take(self.group.poll(hold_s=POLL_HOLD_S, max_age_s=self._max_age_s))
        return self._decide()

    # --- what the nodes said ----------------------------------------------------------

    def _take(self, polls: list[NodePoll], nodes: set[int] | None = None) -> None:
        """Route each node's poll (only ``nodes``, when given) and collect its returns and failures, with those of
        the silence rule."""
        for node_rank, p in enumerate(polls):
            if nodes is not None and node_rank not in nodes:
                continue
            self.route.forward(node_rank, p)
            self.returns.update(p.returns)
            self.failures.extend(p.failures)
            self.failures.extend(self._silence(node_rank, p))

    def _silence(self, node_rank: int, p: NodePoll) -> list[RankFailure]:
        """The silence rule, for one node's poll: a node whose actor died, or whose poll waited past
        ``timeouts.heartbeat_s`` (its host or its link is down: its calls neither return nor fail), is lost, and
        its ranks fail with it; a rank whose heartbeat is older than that is stopped or frozen. Ranks that already
        failed are not named again."""
        heartbeat_s = self.heartbeat_s
        if p.state is not NodeState.LOST and p.silent_s is not None and p.silent_s > heartbeat_s:
            self.group.lose(node_rank)
            why = (f"did not answer for {p.silent_s:.0f} s (timeouts.heartbeat_s is {heartbeat_s:g}): its host or "
                   "its network link is down; treated as lost")
            return self._node_lost(node_rank, self.group.infos[node_rank], why)
        if p.state is NodeState.LOST:
            return self._node_lost(node_rank, self.group.infos[node_rank], "was lost")
        stale = [(rank, age) for rank, age in p.beat_age_s.items() if age > heartbeat_s]
        if not stale:
            return []
        known = {f.rank for f in self.failures}
        return [RankFailure.silent(rank, age, heartbeat_s) for rank, age in stale if rank not in known]

    def _node_lost(self, node_rank: int, info: NodeInfo, why: str) -> list[RankFailure]:
        """A lost node's ranks as failures, once: when it is first found lost."""
        if node_rank in self.lost:
            return []
        self.lost.append(node_rank)
        node = f"node {node_rank} ({info.node_id[:12]}, {info.ip})"
        return [RankFailure.node_lost(rank, node, why)
                for rank, n in sorted(self.state.node_of.items()) if n == node_rank]

    # --- what follows ------------------------------------------------------------------

    def _decide(self) -> AttemptOutcome | None:
        a, rec, group = self.state, self.recorder, self.group
        if self.failures:
            a.failed_at = a.failed_at or time.time()  # the goodput books' end of an attempt that showed no step
            return self._fail()
        if all(s == NodeState.SUCCEEDED for s in group.states):
            return self._succeeded()
        now = time.monotonic()
        if len(a.joined) < a.world and now - self.started > self.rendezvous_s:
            return self._not_formed()
        if now - self._last_grow_check > GROW_CHECK_S:
            self._last_grow_check = now
            seen = self._grown()
            if seen is not None and (self.grow is None or seen.nodes > self.grow.nodes):
                self.grow, self._grow_seen = seen, time.time()
                rec.say(f"raylaunch: elastic: nodes came back; growing to {seen.describe()} at the next committed "
                        "checkpoint")
        if now - self._last_drain_check > DRAIN_CHECK_S:
            self._last_drain_check = now
            self._drains()
        if self.grow is not None and a.last_commit is not None and a.last_commit[1] > self._grow_seen:
            self._stop()
            return AttemptOutcome(Outcome.GROW, f"stopped at the checkpoint of step {a.last_commit[0]} to grow to "
                                                f"world size {self.grow.world_size}", grow=self.grow)
        if now - self._last_board > BOARD_FLUSH_S:
            rec.board.flush()
            self._last_board = now
        if now - self._last_work > WORK_EVERY_S:
            if w := self.route.work():
                rec.event(w)
            self._last_work = now
        return None

    def _drains(self) -> None:
        """Nodes of the attempt that Ray began to drain (a preemption with a deadline, what Ray Train's
        get_preemption_info reads): their ranks get a stop notice (SIGTERM), which every rank agrees on at a step
        whose snapshot it writes (or a cooperative function's save), and the next attempt goes to other nodes."""
        try:
            draining = ray._private.state.state.get_draining_nodes() or {}
        except Exception:  # noqa: BLE001 - Ray that cannot say: nothing is drained as far as the run knows
            return
        for node_rank, info in enumerate(self.group.infos):
            if info.node_id not in draining or node_rank in self.drained:
                continue
            deadline = draining[info.node_id] / 1000.0
            self.drained[node_rank] = deadline
            if self.route.snapshots is not None:  # the stop's snapshot leaves it: none is copied to it
                self.route.snapshots.draining.add(node_rank)
            left = f", its deadline in {deadline - time.time():.0f} s" if deadline else ""
            self.recorder.say(f"raylaunch: node {node_rank} ({info.hostname}, {info.ip}) is being drained by Ray"
                              f"{left}: its ranks get a stop notice; the run stops at a step every rank agrees on "
                              "and resumes there on other nodes")
            self.group.actors[node_rank].stop_notice.remote()
        if self.drained and self._prewarm:  # the restart goes to other nodes: their hosts start while the run stops
            try:
                self.group.prewarm(exclude=set(draining))
            except Exception as exc:  # noqa: BLE001 - a restart without it starts them itself, as before
                self._prewarm = False
                self.recorder.say(f"raylaunch: spare nodes could not be warmed for the restart: {exc!r}")

    def _stop(self) -> set[int]:
        """Stop every rank on every node, routing what they left to read; the nodes that could not be reached to
        stop them (their actor dead, or no answer) are returned."""
        gone = set()
        for node_rank, p in enumerate(self.group.stop()):
            self.route.forward(node_rank, p)
            if p.state is NodeState.LOST:
                gone.add(node_rank)
        return gone

    def _succeeded(self) -> AttemptOutcome:
        a, r = self.state, self.recorder.result
        ended = attempt_ended([], lost_nodes=False, preempted=bool(a.preempted))
        if ended is Outcome.PREEMPTED:
            return AttemptOutcome(ended, f"preempted: ranks {sorted(a.preempted)} stopped at step {r.last_step} on a "
                                         "stop notice, with that step saved or snapshotted within the grace period",
                                  drained=dict(self.drained))
        # Rank return values are JSON data already (``cluster.rank.worker`` made them so).
        r.return_value = self.returns.get(0)
        r.rank_results = {str(k): v for k, v in sorted(self.returns.items())}
        return AttemptOutcome(ended)

    def _not_formed(self) -> AttemptOutcome:
        """Name the ranks that never reached the rendezvous; if all did, the group itself did not form."""
        a = self.state
        missing = sorted(set(a.node_of) - a.arrived) or sorted(set(a.node_of) - a.joined)
        nodes = sorted({a.node_of[m] for m in missing})
        where = where_ranks_are(self.group, self.run_dir, a.number)
        self.group.stop()
        return AttemptOutcome(Outcome.FAILED, (
            f"ranks {missing} on nodes {nodes} did not join the process group within {self.rendezvous_s:g} s "
            f"(timeouts.rendezvous_s); no rank trained\n{where}"
        ))

    def _fail(self) -> AttemptOutcome:
        group, failures = self.group, self.failures
        # The same bug usually fails every rank within moments: wait briefly for the other nodes to report theirs,
        # so the error is grouped, not one rank's alone. Not after a SIGKILL (the OOM killer's, an operator's) or a
        # node lost: the others only lose their peer at their next collective, a step later, and the restart waited
        # for that (0.9-2.2 s of the 2.8-4.0 s from a rank killed to training again, at 576 MiB a rank and 0.6 s
        # steps in ``make bench-recovery``), to add a line saying so.
        grace = time.monotonic() + (0.0 if all(_killed_outright(f) for f in failures) else FAILURE_GRACE_S)
        while time.monotonic() < grace and any(s == NodeState.RUNNING for s in group.states):
            time.sleep(self.poll_interval_s)
            running = {i for i, s in enumerate(group.states) if s == NodeState.RUNNING}
            self._take(group.poll(), nodes=running)
        # A hang: where was every rank? Read before they are stopped.
        where = where_ranks_are(group, self.run_dir, self.number, failures) if is_hang(failures) else ""
        # Stop everyone else now: a rank blocked in a collective would wait forever.
        gone = self._stop()
        # A node whose death was known only after its peers failed (they lost their connections to it first), or
        # only when it could not be stopped (a host gone without a word: Ray learns it after its health checks),
        # is lost all the same: the next attempt needs other nodes, and the failure was not the code's.
        self.lost += [i for i, s in enumerate(group.states) if (s == NodeState.LOST or i in gone) and i not in self.lost]
        error = self._mask(group_failures(failures) + (f"\n{where}" if where else ""))
        print(f"raylaunch: attempt {self.number} failed:\n{error}", file=sys.stderr, flush=True)
        lost = bool(self.lost)
        return AttemptOutcome(attempt_ended(failures, lost_nodes=lost), error, tuple(self.lost),
                              fault=blame(failures, lost_nodes=lost), said=True, drained=dict(self.drained))


def _killed_outright(failure: RankFailure) -> bool:
    """A rank ended by SIGKILL, or one whose node is gone: no error of its code that the other ranks would share.

    >>> _killed_outright(RankFailure.killed(1, -9, "SIGKILL")), _killed_outright(RankFailure.killed(1, -11, "SIGSEGV"))
    (True, False)
    >>> _killed_outright(RankFailure.raised(0, 1, "ValueError: bad shape", ""))
    False
    """
    return failure.cause is FailureCause.NODE_LOST or (failure.cause is FailureCause.SIGNAL
                                                       and failure.signal == "SIGKILL")
