"""The driver: the loop over the attempts of one run.

Each attempt reserves its nodes when it must (``jobs.driver.preflight``), starts every rank with a
fresh rendezvous, restoring the latest committed checkpoint, and runs as a ``jobs.driver.attempt.Attempt``
(which polls the node actors, routes what they report through ``jobs.driver.routing`` and decides how
the attempt ended). After each attempt ``jobs.driver.policy.next_step`` says what follows: finish,
restart on the same nodes, reserve anew, or give up.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Callable, TextIO

import psutil
import ray
import yaml

from cluster.snapshots import SnapshotPlan
from cluster.context import WorkerContext
from cluster.layout import checkpoint_name
from cluster.nodes.connect import holds_embedded_cluster, job_workdir, machine_gpus
from cluster.nodes.group import NodeGroup, NodeLostError, RendezvousError
from cluster.nodes.placement import (Placement, PlacementError, cpu_beside_gpus, cpu_by_choice, fitting_nodes,
                                     resolve_placement)
from cluster.protocol import RunStatus, ScriptCall, WorkerPayload
from cluster.storage_io import join_uri
from cluster.train_function import check_entry
from jobs.driver.attempt import Attempt
from jobs.driver.hangs import where_ranks_are
from jobs.driver.memory import STORE_MARGIN_S, MemoryResume, SnapshotBook, run_key, stop_deadline, upload_fits

# How long a restart waits for the copies of the last snapshots to their peers still in flight.
SETTLE_S = 30.0
from jobs.driver.policy import Action, AttemptOutcome, Step, WorldSize, grow_to, next_step, resize_reason, world_sizes
from jobs.driver.preflight import NodeRequest, reserve, reserve_elastic
from jobs.driver.record import Recorder, RunResult
from jobs.driver.routing import AttemptRouter, AttemptState, group_failures
from jobs.run.events import AttemptEnded, AttemptStarted, Committed, MemoryMissed, Outcome, RunEvent, SessionEnded
from jobs.run.storage import CheckpointError, RunDir, StorageError
from jobs.spec import JobSpec, spec_to_dict
from jobs.spec.environment import Secrets, check_requirements
from jobs.spec.strategy import AccelerateConfig, read_accelerate_config

__all__ = ["Driver", "RunResult", "group_failures"]


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
        on_event: Callable[[RunEvent], None] | None = None,
        started_at: float | None = None,
    ) -> None:
        self.spec = spec
        self.can_grow = can_grow
        self.fresh = fresh
        # Why the run is being stopped, set by whoever stops it from outside (the CLI's SIGTERM handler) before the
        # KeyboardInterrupt it raises reaches ``run``; None: Ctrl-C.
        self.stop_reason: str | None = None
        self.poll_interval_s = poll_interval_s
        # When the command began (the CLI gives its process's start); the books count from there, else from run().
        self.started_at = started_at
        self.run_dir = RunDir(spec.storage, spec.name)
        self.recorder = Recorder(self.run_dir, out, on_event)
        self._token: str | None = None
        self.group: NodeGroup | None = None  # the nodes of the current attempt
        # An elastic run's world sizes, largest first (one size when it is not elastic), and the current one.
        self.sizes: list[WorldSize] = []
        self.size: WorldSize | None = None
        self.accelerate: AccelerateConfig | None = None  # the accelerate section and its config file, in preflight
        self.node_request: NodeRequest | None = None  # an elastic run's ask to the autoscaler while below num_nodes
        self._open: int | None = None  # the attempt begun and not yet ended (for its AttemptEnded)
        # The run as it ended, when this spec already succeeded in this run directory: nothing is started (preflight)
        self.done: RunResult | None = None
        self._route: AttemptRouter | None = None  # the running attempt's router
        # The run's error was printed in full when its last attempt ended: the command's last line gives only its
        # first line (the cause), so a traceback is printed once.
        self.error_said = False
        snaps = spec.checkpoint.snapshots
        # Snapshots in memory between commits (cluster/checkpoint/memory.py), unless checkpoint.snapshots.every is 0
        self.snapshots: SnapshotBook | None = None if snaps.every == 0 else SnapshotBook(
            run_key(spec.name, self.run_dir.uri), None if snaps.memory_mb == "auto" else float(snaps.memory_mb))
        self._memory: MemoryResume | None = None  # the attempt's resume from a snapshot, once put together
        # a restart with snapshots on that resumes from storage: why not from memory, and each rank's newest part
        self._missed: tuple[MemoryMissed, str] | None = None
        self._lost_ids: set[str] = set()  # the nodes the last attempt lost (their snapshots with them)

    @property
    def secrets(self) -> Secrets:
        """env.secrets' values, read in preflight."""
        return self.recorder.secrets

    def _say(self, text: str) -> None:
        self.recorder.say(text)

    def _say_idle_gpus(self, placement: Placement) -> None:
        """A run on CPUs where GPUs are (on the cluster's nodes, or on this machine) says so once, and why; so does an
        ``auto`` one on a cluster whose autoscaler can start no node with a GPU."""
        here = len(machine_gpus(override=False))
        if note := (cpu_beside_gpus(placement, self.spec.scaling.use_gpu, here, holds_embedded_cluster())
                    or cpu_by_choice(placement, self.spec.scaling.use_gpu)):
            self._say(note)

    # --- the whole run ------------------------------------------------------------

    def preflight(self) -> None:
        """Check the train_fn and prepare the run directory; no cluster needed.

        Raises ``ImportError``/``AttributeError`` for a train_fn that does not
        exist and ``StorageError`` for storage that cannot be written.
        """
        if self._token is not None or self.done is not None:
            return
        # before anything is written: a missing one is a spec error
        self.recorder.secrets = Secrets.read(self.spec.env)
        if (script := check_entry(self.spec)) is not None:
            self._say(f"raylaunch: script {script.path}: {script.describe()}")
        self.accelerate = read_accelerate_config(self.spec)
        if note := self.accelerate.note():
            self._say(note)
        if warning := check_requirements(self.spec.env.requirements):
            self._say(warning)
        if not self.fresh and (done := self._succeeded_before()) is not None:
            # #56.8: running a finished run again retrained it from its last checkpoint (from scratch when nothing
            # was committed) and said only "succeeded after 2 attempt(s)"
            self.done = done
            self._say(f"raylaunch: {self.spec.name} already succeeded ({done.attempts} attempt(s), ended "
                      f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(done.end_time))}) with this spec: nothing "
                      f"was started. Its result: {self.run_dir.uri}/result.json (raylaunch show {self.spec.name} "
                      f"--storage {self.spec.storage}); --fresh runs it again in a new run directory")
            return
        if self.fresh and self.run_dir.exists():
            name = f"{self.spec.name}-{time.strftime('%Y%m%d-%H%M%S')}"
            self._say(f"raylaunch: --fresh: starting a new run directory {name} (the old one is kept)")
            self.spec = dataclasses.replace(self.spec, name=name)
            self.run_dir = self.recorder.run_dir = RunDir(self.spec.storage, name)
            self.recorder.result.run_dir = self.run_dir.uri
        self._token = self.run_dir.prepare(spec_to_dict(self.spec))

    def _succeeded_before(self) -> RunResult | None:
        """The run as ``result.json`` holds it, when this run directory already succeeded with this very spec; None
        otherwise (a new run, one that failed or was stopped, or a changed spec: those resume from the latest
        committed checkpoint)."""
        if not self.run_dir.exists():
            return None
        result = self.run_dir.read_result() or {}
        if result.get("status") != RunStatus.SUCCEEDED:
            return None
        if self.run_dir.read_spec() != yaml.safe_load(yaml.safe_dump(spec_to_dict(self.spec), sort_keys=False)):
            return None
        known = {f.name for f in dataclasses.fields(RunResult)}
        return RunResult(**{**{k: v for k, v in result.items() if k in known}, "status": RunStatus.SUCCEEDED})

    def run(self) -> RunResult:
        """Run to the end; returns the result, which is also in ``result.json`` (a run that already succeeded with
        this spec: as it ended, and nothing starts)."""
        self.preflight()
        if self.done is not None:
            return self.done
        rec = self.recorder
        r = rec.result
        r.start_time = time.time()
        r.timeline = {"process_start": psutil.Process().create_time(), "driver_ready": r.start_time}
        started = self.started_at or r.start_time
        # A rerun of the same run continues its attempt numbers, so metrics.jsonl
        # rows from before and after the resume stay apart, and its books.
        r.attempts = int((self.run_dir.read_result() or {}).get("attempts") or 0)
        rec.begin_session(started)
        rec.open_board()
        try:
            s = self.spec.scaling
            placement = resolve_placement(s.num_nodes, s.workers_per_node, s.use_gpu, s.cpus_per_worker,
                                          can_grow=self.can_grow)
            r.num_nodes, r.world_size = placement.num_nodes, placement.world_size
            self._say(
                f"raylaunch: {self.spec.name}: {placement.num_nodes} nodes x {placement.workers_per_node} "
                f"workers = world size {placement.world_size} ({'GPU, nccl' if placement.use_gpu else 'CPU, gloo'})"
            )
            if not placement.use_gpu:
                self._say_idle_gpus(placement)
            self._say(f"raylaunch: run directory {self.run_dir.uri}")
            if refused := self.accelerate.device_problem(placement.use_gpu):  # DeepSpeed on CPU nodes
                r.status, r.error = RunStatus.FAILED, refused
            else:
                self._attempts(placement)
        except (PlacementError, RendezvousError, StorageError, CheckpointError) as exc:
            r.status, r.error = RunStatus.FAILED, str(exc)
        except KeyboardInterrupt as exc:
            r.status, r.error = RunStatus.STOPPED, self.stop_reason or str(exc) or "interrupted (Ctrl-C)"
            self._say(f"raylaunch: {r.error}: stopping every rank")
            if self.group is not None and self.group.contexts:
                # A run is usually stopped because it looks stuck: say where it was.
                where = where_ranks_are(self.group, self.run_dir, r.attempts)
                r.error += "\n" + where
                self._say(f"raylaunch: {where}")
        except Exception as exc:  # the runner's own failure: the run still ends recorded, never "running"
            import traceback

            r.status = RunStatus.FAILED
            r.error = f"the driver failed: {type(exc).__name__}: {str(exc)[:2000]}"
            print(self.secrets.mask(f"raylaunch: {r.error}; every rank is stopped, what was committed stays. The driver's "
                  f"traceback (a bug in raylaunch, please report it):\n{traceback.format_exc()}"),
                  file=sys.stderr)
        finally:
            r.live = {}
            if self._open is not None:
                self._end_attempt(Outcome.STOPPED if r.status == RunStatus.STOPPED else Outcome.FAILED)
            if self.group is not None:
                self.group.shutdown()
                self.group = None
            # The run is over: its snapshots leave the nodes' memory, once its ranks have ended (dropped while a
            # stopped run's ranks still trained, the snapshot they wrote next stayed in /dev/shm for good)
            if self.snapshots is not None:
                try:
                    self.snapshots.drop(None)
                except Exception as exc:  # noqa: BLE001
                    self._say(f"raylaunch: the run's snapshots could not be removed from the nodes' memory: {exc}")
            if self.node_request is not None:
                self.node_request.withdraw()
            rec.event(SessionEnded(time=time.time(), status=r.status))
            r.end_time = time.time()
            # What the ranks returned or raised is written and printed with env.secrets masked.
            r.error, r.return_value, r.rank_results = rec.mask((r.error, r.return_value, r.rank_results))
            # Each of these on its own: storage that refuses one (full, say) must not keep result.json from the end.
            try:
                self.run_dir.clear_staging()  # no rank runs now: what a failed save left goes
            except OSError as exc:
                self._say(f"raylaunch: could not clear the staging folder of {self.run_dir.uri}: {exc}")
            rec.board.close()  # says, never raises, when its files cannot be written
            try:
                rec.write_result()
            except OSError as exc:
                self._say(f"raylaunch: could not write result.json to {self.run_dir.uri}: {exc}")
            try:
                self.run_dir.close()
            except OSError as exc:
                self._say(f"raylaunch: metrics, events or logs held while {self.run_dir.uri} refused writes are "
                          f"lost: {exc}")
        return r

    def _attempts(self, placement: Placement) -> None:
        rec = self.recorder
        r = rec.result
        s = self.spec.scaling
        self.sizes = world_sizes(s, placement.workers_per_node, self.accelerate.gradient_accumulation_steps)
        elastic = len(self.sizes) > 1 or s.elastic_min < s.num_nodes
        if elastic:
            self._say("raylaunch: elastic: can run at " + ", ".join(w.describe() for w in self.sizes)
                      + ("" if s.keep_global_batch else " (scaling.keep_global_batch is false: the global batch "
                         "changes with the world size)"))
        action, step = Action.RESERVE, None
        while True:
            self._open = r.attempts + 1
            began = time.time()
            rec.begin_attempt(self._open)
            latest = plan = self._memory = self._missed = None
            # The attempt's event is written once where it resumes from is final (its nodes reserved, a snapshot put
            # together or not), at ``began``; also when it fails or is stopped before (what it would have loaded).
            try:
                # Every rank of the previous attempt is stopped (and no commit comes while nodes are reserved): what
                # it left half-saved goes, and the checkpoint this attempt resumes from is known before it is said.
                try:
                    self.run_dir.clear_staging()
                    latest = self.run_dir.checkpoints.loadable(warn=self._say)
                    plan = self._snapshot_plan(latest.step if latest else 0) if step is not None else None
                except BaseException:  # no checkpoint it may load (latest.json names one that is gone): the attempt
                    r.attempts += 1  # counts, failed before any node was reserved
                    raise
                if step is not None and (line := step.line(plan.step if plan else latest.step if latest else None,
                                                           memory=plan is not None)):
                    self._say(line)  # the restart, once what it means to resume from is known
                if action is Action.RESERVE:
                    self._reserve(placement, elastic, step)
                r.attempts += 1
                # a snapshot that cannot be put together (a part pruned, a node's actor failed, the nodes too slow):
                # the attempt resumes from the last commit, and its event says so
                self._memory = self._put_together(plan, r.attempts) if plan is not None else None
            finally:
                m = self._memory
                missed = self._missed[0] if self._missed and latest is not None and m is None else None
                rec.event(AttemptStarted(time=began, attempt=self._open, restarts=r.restarts,
                                         max_restarts=self.spec.failure.max_restarts, world_size=r.world_size,
                                         resume_step=m.step if m else latest.step if latest else None,
                                         resume_from="memory" if m else "storage" if latest else None,
                                         resume_state_time=self.snapshots.taken.get(m.step) if m else None,
                                         memory_missed=missed))
            resume_step = self._memory.step if self._memory else latest.step if latest else None
            if r.resizes and r.resizes[-1]["attempt"] == r.attempts:
                r.resizes[-1]["step"] = resume_step or 0
            if self._memory is not None:
                self._say(f"raylaunch: attempt {r.attempts}: resuming from the snapshot of step {self._memory.step} "
                          f"in {self._memory.source}"
                          + (f"; the last committed checkpoint is step {latest.step}" if latest else "; nothing "
                             "was committed"))
            elif latest is not None:
                self._say(f"raylaunch: attempt {r.attempts}: resuming from {latest.uri} (step {latest.step})"
                          + (f" on world size {self.size.world_size}" if elastic else "")
                          + (f"; not from memory: {self._missed_words(latest.step)}" if self._missed else ""))
            r.status = RunStatus.RUNNING
            rec.write_result()
            rec.board.start_attempt(resume_step)
            outcome = self._attempt(self.group, r.attempts, latest.uri if latest else None, resume_step or 0)
            if not outcome.ok and self._route is not None and self._route.a.first_step is None:
                self.run_dir.checkpoints.forget()  # (its ranks may have refused what they were to load)
            if self.snapshots is not None and outcome.drained:
                # the copies of the last snapshots to their peers, before the nodes are let go (a drained node's
                # snapshot leaves it here, before its deadline; a lost node's never will)
                self.snapshots.settle(SETTLE_S)
            if self.snapshots is not None and outcome.ended is Outcome.PREEMPTED:
                self._store_snapshot(outcome, r.attempts)  # and to storage, if the notice's deadline allows
            # a lost node may still be listed alive (a cut link, until Ray's health checks give up on it): no holder
            self._lost_ids = {self.group.infos[i].node_id for i in outcome.lost_nodes if i < len(self.group.infos)}
            # What next is one pure function of how the attempt ended and the budgets (jobs/driver/policy.py).
            step = next_step(outcome, r.attempts, r.restarts, r.preemptions, self.spec.failure,
                             self.spec.timeouts.resize_s, r.infra_restarts)
            action = step.action
            r.restarts, r.preemptions, r.infra_restarts = step.restarts, step.preemptions, step.infra_restarts
            r.error = None if outcome.ok or step.grew else outcome.error
            if action is Action.RESERVE:  # the bundles of lost nodes are gone; growing needs a larger group
                self.group.shutdown()
                self.group = None
            self._end_attempt(outcome.ended)
            if (status := action.status) is not None:
                r.status = status
                if status is RunStatus.FAILED:
                    self.error_said = outcome.said
                    if line := step.line():
                        self._say(line)  # why it is not restarted, and how to ask for it
                return

    def _reserve(self, placement: Placement, elastic: bool, step: Step | None) -> None:
        """The attempt's nodes (``self.group``, ``self.size``): the whole placement, or an elastic run's largest size
        the cluster allows; a change of world size is recorded."""
        rec, r, old = self.recorder, self.recorder.result, self.size
        if elastic:
            if self.can_grow and self.node_request is None:  # an autoscaler adds what the run is short of
                self.node_request = NodeRequest(placement)
            self.group, self.size = reserve_elastic(self.spec, placement, self.sizes, rec, self._token,
                                                    can_grow=self.can_grow,
                                                    wait_full_s=step.wait_full_s if step else 0.0,
                                                    request=self.node_request)
            if self.node_request is not None and self.size == self.sizes[0]:
                self.node_request.withdraw()
        else:
            self.group = reserve(self.spec, placement, rec, self._token, can_grow=self.can_grow)
            self.size = self.sizes[0]
        r.num_nodes, r.world_size = self.size.nodes, self.size.world_size
        if old is not None and old != self.size:
            rec.resized(old, self.size, r.attempts + 1, resize_reason(step, old.nodes, self.size.nodes))

    def _snapshot_plan(self, committed_step: int) -> SnapshotPlan | None:
        """For a restart: the newest snapshot in memory newer than the last committed checkpoint whose every part a
        node still there holds (the nodes of the last attempt, when it keeps them; else the cluster's live nodes)."""
        if self.snapshots is None or self.size is None:
            return None
        try:
            if self.group is not None:
                dead = set(self.group.dead_nodes())
                alive = {i.node_id for n, i in enumerate(self.group.infos) if n not in dead}
            else:
                alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
            alive -= set(ray._private.state.state.get_draining_nodes() or {})  # their memory goes with them
            alive -= self._lost_ids
            # A snapshot of the last commit's own step is the same state (a save's snapshot is its own capture, and a
            # step a rank saves takes none of its own; a stop notice's snapshot committed to storage is that commit):
            # it is read from memory, not from storage again (on an object store, a download of the whole state; in
            # make bench-recovery, where the function commits about every step, most restarts)
            after = committed_step - 1
            plan = self.snapshots.choose(alive, self.size.world_size, after)
            if plan is None:
                self._missed = self.snapshots.missed(alive, self.size.world_size, after)
            return plan
        except Exception as exc:  # noqa: BLE001 - storage's checkpoint is still there to resume from
            self._say(f"raylaunch: the snapshots in memory cannot be read ({type(exc).__name__}: {exc}); resuming "
                      "from storage")
            return None

    def _store_snapshot(self, outcome: AttemptOutcome, attempt: int) -> None:
        """After a stop notice ended ``attempt``: the newest snapshot every rank's part of is held (the step the ranks
        stopped at), committed to storage as a checkpoint of that step through the ranks' own staging and commit
        (its files written by the nodes that hold them, manifest last, then latest.json), when the notice's deadline
        leaves time for it at the pace of this run's commits; said either way. It is what a cluster lost whole
        resumes from; the next attempt still reads the snapshot from memory."""
        book, group, rec = self.snapshots, self.group, self.recorder
        notice = self._route.a.notice_at if self._route is not None else None
        deadline, whose = stop_deadline(outcome.drained, notice, time.time())
        step = None
        try:
            latest = self.run_dir.checkpoints.latest()
            plan = book.whole(latest.step if latest else 0, set(group.dead_nodes()))
            if plan is None:  # nothing newer than the last commit is whole on the nodes: nothing to add
                return
            step = plan.step
            away = {group.infos[i].node_id for i in outcome.drained if i < len(group.infos)}
            upload = book.upload_plan(plan, away)
            left, rate = deadline - time.time(), book.commit_rate()
            if not upload_fits(upload.nbytes, rate, left):
                size = f"{upload.nbytes / 2**20:.1f} MiB"
                why = (f"{size} would take about {upload.nbytes / rate:.1f} s at the {rate / 2**20:.1f} MiB/s of this "
                       f"run's commits, and {whose} is in {left:.0f} s" if rate else
                       f"{whose} is in {left:.0f} s, too soon to write {size}")
                self._say(f"raylaunch: the snapshot of step {step} is not committed to storage: {why}; a restart reads "
                          "it from memory, a cluster lost whole resumes from "
                          + (f"the commit of step {latest.step}" if latest else "the beginning"))
                return
            self.run_dir.clear_staging()  # no rank runs: what a save of this attempt left half-written goes
            staging = join_uri(self.run_dir.staging_uri(attempt), checkpoint_name(step))
            began = time.time()
            files = book.upload(upload, staging, deadline - STORE_MARGIN_S)
            c = self.run_dir.checkpoints.commit(staging, step, attempt, plan.world_size, self.spec.checkpoint.keep,
                                                reported=files)
        except TimeoutError as exc:
            self._say(f"raylaunch: the snapshot of step {step} could not be written to storage before {whose} "
                      f"({exc}): it is not committed (what was written stays in staging, which is never loaded)")
            return
        except Exception as exc:  # noqa: BLE001 - the snapshot in memory is still what the restart reads
            what = f"the snapshot of step {step}" if step is not None else "the snapshot the ranks stopped at"
            self._say(f"raylaunch: {what} could not be committed to storage ({type(exc).__name__}: "
                      f"{str(exc)[:300]}); the restart resumes from memory")
            return
        book.stored.add(step)
        rec.event(Committed(time=time.time(), attempt=attempt, step=step, state_time=book.taken.get(step, began)))
        self._say(f"raylaunch: committed the snapshot of step {step} to storage before {whose} "
                  f"({c.nbytes / 2**20:.1f} MiB in {time.time() - began:.2f} s, {deadline - time.time():.0f} s to "
                  f"spare): {c.uri}")

    def _put_together(self, plan: SnapshotPlan, attempt: int) -> MemoryResume | None:
        """Every node of the attempt puts the snapshot of ``plan`` together in its memory; None (said) when it
        cannot: the attempt resumes from the last committed checkpoint instead."""
        group = self.group
        try:
            if group is None or self.size is None or self.size.world_size != plan.world_size:
                raise RuntimeError("the attempt's world size is not the snapshot's")
            return self.snapshots.assemble(plan, attempt, group.infos, group.actors)
        except Exception as exc:  # noqa: BLE001
            self._say(f"raylaunch: attempt {attempt}: the snapshot of step {plan.step} could not be put together "
                      f"({type(exc).__name__}: {str(exc)[:200]}); resuming from storage instead")
            self._missed = (MemoryMissed.NOT_PUT_TOGETHER,
                            f"the snapshot of step {plan.step} could not be put together")
            return None

    def _missed_words(self, committed_step: int) -> str:
        """Why a restart with snapshots on resumes from the commit of ``committed_step``, in words."""
        why, words = self._missed
        if why is MemoryMissed.NONE_NEWER:
            return (f"no snapshot of step {committed_step} or newer had every rank's part in memory, the newest "
                    f"parts of each rank: {words} (a rank takes none before its attempt's first save, nor while a "
                    "save of its is being written)")
        if why is MemoryMissed.NODE_LOST:
            return f"a part of each newer snapshot was on a node gone ({words})"
        return words

    def _end_attempt(self, outcome: Outcome) -> None:
        """Say how the open attempt ended (and where its training stood), and write result.json's books."""
        rec, number = self.recorder, self._open
        self._open = None
        route, self._route = self._route, None
        if route is not None:
            route.finish()
        rec.event(AttemptEnded(time=time.time(), attempt=number or 0, outcome=outcome,
                               restarts=rec.result.restarts))
        try:
            rec.write_result()
        except OSError as exc:
            self._say(f"raylaunch: could not write result.json to {self.run_dir.uri}: {exc}")

    def _grown(self, group: NodeGroup) -> WorldSize | None:
        """A larger size the cluster's nodes allow now, if this elastic run is below num_nodes."""
        if self.size is None or len(self.sizes) < 2 or self.size == self.sizes[0]:
            return None
        held = {i.node_id for i in group.infos}
        return grow_to(self.sizes, self.size, fitting_nodes(group.placement, held=held))

    # --- one attempt ------------------------------------------------------------------

    def _attempt(self, group: NodeGroup, attempt: int, restore_uri: str | None, resume_step: int) -> AttemptOutcome:
        """Start attempt number ``attempt``'s ranks on ``group`` and run it (``Attempt``) to how it ended."""
        spec = self.spec
        staging = self.run_dir.staging_uri(attempt)
        use_gpu = group.placement.use_gpu
        accumulation = self.size.accumulation if self.size else self.accelerate.gradient_accumulation_steps
        script = None
        if spec.script is not None:
            script = ScriptCall(spec.script, tuple(spec.args), spec.resume_arg, workdir=job_workdir(),
                                accumulation=accumulation,
                                full_accumulation=self.accelerate.gradient_accumulation_steps)

        # checkpoint.every auto: the time between failures of this run's own books once it has failed
        books = self.recorder.ledger()
        mtbf_s = books.wall_s / books.failures if books.failures else spec.checkpoint.mtbf_s

        snaps = spec.checkpoint.snapshots
        folders = (self.snapshots.attach(group.infos, group.actors, self.size.world_size if self.size else 0,
                                         resumed=resume_step)
                   if self.snapshots is not None else {})
        memory = self._memory

        def payload(ctx: WorkerContext, events_path: str) -> WorkerPayload:
            return WorkerPayload(
                context=ctx,
                attempt=attempt,
                train_fn=spec.train_fn,
                config=dict(spec.config),
                events_path=events_path,
                staging_uri=staging,
                restore_uri=memory.folders[ctx.node_rank] if memory is not None else restore_uri,
                backend="nccl" if use_gpu else "gloo",
                collective_timeout_s=spec.timeouts.collective_s,
                accelerate=self.accelerate.at(accumulation),
                script=script,
                checkpoint_async=spec.checkpoint.async_,
                checkpoint_every=spec.checkpoint.every,
                mtbf_s=mtbf_s,
                snapshot_dir=folders.get(ctx.node_rank),
                snapshot_every=None if snaps.every == "auto" else int(snaps.every),
                snapshot_start=max(self.snapshots.every.values(), default=1) if self.snapshots is not None else 1,
                snapshot_memory_mb=None if snaps.memory_mb == "auto" else float(snaps.memory_mb),
            )

        try:
            contexts = group.start(payload, attempt, spec.timeouts.rendezvous_s, spec.rendezvous.port_range)
        except NodeLostError as exc:  # a node lost between its reservation and its ranks' start
            self._say(f"raylaunch: attempt {attempt}: {exc}")
            return AttemptOutcome(Outcome.FAILED, str(exc), tuple(exc.nodes), said=True)
        self.recorder.mark("ranks_started")
        state = AttemptState(attempt, staging, {c.world_rank: c.node_rank for c in contexts}, resume_step=resume_step)
        self._route = AttemptRouter(state, self.recorder, self.run_dir, spec.checkpoint.keep,
                                    hosts={i: (n.hostname, n.ip) for i, n in enumerate(group.infos)},
                                    snapshots=self.snapshots)
        return Attempt(group, self._route, recorder=self.recorder, run_dir=self.run_dir,
                       heartbeat_s=spec.timeouts.heartbeat_s, rendezvous_s=spec.timeouts.rendezvous_s,
                       grown=lambda: self._grown(group), mask=self.secrets.mask,
                       poll_interval_s=self.poll_interval_s).run()
