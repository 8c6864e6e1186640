"""The driver at scale: `make bench-scale`, the real driver against simulated nodes, no torch.

The driver code that runs is the one `raylaunch run` runs (``jobs.driver.driver.Driver``: its attempt
loop, event routing, metrics.jsonl, TensorBoard, heartbeat and liveness checks, checkpoint
commits, progress line), and so is the polling (``cluster.nodes.group.NodeGroup.poll`` and ``stop``,
over real Ray calls). Only the nodes are simulated: each node is a ``SimNode`` hosted by one
of a few ``SimNodes`` Ray actors (128 node actors would be 128 processes, more than this
machine holds), and answers the driver's calls as ``cluster.nodes.node.NodeActor`` does: a
``NodePoll`` with the events its ranks wrote since the last poll (arrived, joined, metrics at
every step, resources every 5 s, a checkpoint report every ``CHECKPOINT_EVERY`` steps with its
part written to staging), their log lines and their heartbeats' ages; the metrics rows rendered
on the node by the node actor's own code (``cluster.metric_rows.RowBatcher``).

Each size runs in its own driver process; a monitor process beside it samples the driver
process's CPU time and resident memory (the simulated nodes and the monitor are other
processes, not counted) and tails metrics.jsonl, so the lag is the time from a rank's event
(its ``time``) to its row being readable in metrics.jsonl.

SCALE_BENCH_S: seconds of training per size (default 40); SCALE_BENCH_SIZES: ranks per size
(default 16,128,1024,4096); 8 ranks per node; SCALE_BENCH_STORAGE: where the run directories go (default
/dev/shm: ``storage_root``); SCALE_BENCH_PROFILE: a folder for the driver's cProfile stats. Writes
bench/results-scale.md.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RANKS_PER_NODE = 8
STEPS_PER_S = 10.0
CHECKPOINT_EVERY = 100  # steps: a checkpoint report from every rank every 10 s
RESOURCES_EVERY_S = 5.0  # as cluster.rank.worker's heartbeat thread
BEAT_EVERY_S = 0.5
LOG_EVERY_S = 10.0  # one line of output per rank
SIM_PROCESSES = 4  # Ray actors hosting the simulated nodes
WARMUP_S = 3.0  # after the first metrics row: not counted in the driver's cores



def storage_root() -> str | None:
    """Where each size's run directory goes: SCALE_BENCH_STORAGE, else a memory file system where there is one.
    The simulated ranks write their checkpoint parts there, 4,096 files a checkpoint, which on a cluster are
    other machines' writes: on this machine's disk their creation took seconds of its two cores at every
    checkpoint and held the simulated nodes' answers (the driver idle meanwhile), the bench's lag, not the
    driver's. None: the system's temporary folder."""
    if os.environ.get("SCALE_BENCH_STORAGE"):
        return os.environ["SCALE_BENCH_STORAGE"]
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def train_fn(config: dict) -> None:
    """What the spec names (the driver checks it exists); the simulated ranks never run it."""


# --- the simulated side -------------------------------------------------------------------


class SimNode:
    """One node's ranks as the driver sees them through ``NodeActor.poll``."""

    def __init__(self, node_rank: int, ranks: list[int], staging_uri: str, total_steps: int, attempt: int,
                 world_size: int) -> None:
        from cluster.metric_rows import RowBatcher
        from cluster.protocol import NodeState

        self.node_rank, self.ranks, self.staging, self.total = node_rank, ranks, staging_uri, total_steps
        self.batcher = RowBatcher(attempt, world_size, {r: node_rank for r in ranks})  # as a node actor's
        self.t0 = time.time()
        self.step = 0  # the last step every rank has logged
        self.greeted = False
        self.resources_at = self.t0
        self.log_at = self.t0
        self.state = NodeState.RUNNING
        self.due: list[int] = []  # steps whose checkpoint parts are to be written
        self.writes: list = []  # their writes under way (``SimNodes._polled``)

    def _at(self, step: int, rank: int) -> float:
        return self.t0 + 1.0 + step / STEPS_PER_S + (rank % 16) * 0.001

    def poll(self):
        from cluster.protocol import NodePoll, NodeState

        out = NodePoll(state=self.state)
        if self.state != NodeState.RUNNING:
            return out
        now = time.time()
        if not self.greeted:
            self.greeted = True
            for kind in ("arrived", "joined"):
                out.events += [{"time": now, "kind": kind, "rank": r} for r in self.ranks]
        target = min(self.total, int((now - self.t0 - 1.0) * STEPS_PER_S))
        for step in range(self.step + 1, target + 1):
            for r in self.ranks:
                out.events.append({"time": self._at(step, r), "kind": "metrics", "rank": r, "step": step,
                                   "values": {"loss": 1.0 / step, "lr": 1e-4, "samples_per_s": 512.0}})
            if step % CHECKPOINT_EVERY == 0:
                self.due.append(step)  # its parts written off the actor's event loop (``SimNodes._polled``)
        self.step = max(self.step, target)
        if now - self.resources_at >= RESOURCES_EVERY_S:
            self.resources_at = now
            out.events += [{"time": now, "kind": "resources", "rank": r, "peak_rss_mb": 2048.0} for r in self.ranks]
        if now - self.log_at >= LOG_EVERY_S:
            self.log_at = now
            out.logs += [(r, "stdout", f"epoch 0 step {self.step}: loss {1.0 / max(1, self.step):.4f}")
                         for r in self.ranks]
        out.beat_age_s = {r: (now - self.t0) % BEAT_EVERY_S for r in self.ranks}
        if self.step >= self.total and not self.due and not self.writes:  # its last parts reported first
            out.events += [{"time": now, "kind": "finished", "rank": r} for r in self.ranks]
            out.state = self.state = NodeState.SUCCEEDED
            out.returns = {r: None for r in self.ranks}
            out.beat_age_s = {}
        return out

    def _checkpoint(self, step: int) -> list[dict]:
        """Each rank writes its part (random_states_<rank>.pkl) to staging and reports it."""
        folder = os.path.join(self.staging, f"checkpoint-{step:08d}")
        os.makedirs(folder, exist_ok=True)
        events = []
        for r in self.ranks:
            data = f"rank {r} step {step}".encode()
            with open(os.path.join(folder, f"random_states_{r}.pkl"), "wb") as f:
                f.write(data)
            files = {f"random_states_{r}.pkl": {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}}
            events.append({"time": time.time(), "kind": "checkpoint", "rank": r, "step": step,
                           "uri": folder, "files": files})
        return events


class SimNodes:
    """A Ray actor hosting several simulated nodes; methods take the node rank first."""

    def __init__(self, total_steps: int) -> None:
        os.nice(10)  # the nodes are other machines: the driver comes first on this one
        self.total = total_steps
        self.nodes: dict[int, SimNode] = {}

    def start(self, node_rank: int, ranks: list[int], staging_uri: str, attempt: int, world_size: int) -> None:
        self.nodes[node_rank] = SimNode(node_rank, ranks, staging_uri, self.total, attempt, world_size)

    async def poll(self, node_rank: int, hold_s: float = 0.0, max_age_s: float | None = None):
        """A node's news, held as ``cluster.nodes.node.NodeActor.poll`` holds it (an async actor: one node's held poll
        does not hold the others'): read every ``POLL_TICK_S``, answered on news other than routine rows
        (``needs_driver``), once its oldest row waited ``max_age_s`` or when the hold ends (``next_look``)."""
        import asyncio

        from cluster.nodes.node import needs_driver, next_look, oldest_time
        from cluster.protocol import NodePoll, NodeState

        node = self.nodes.get(node_rank)
        if node is None:
            return NodePoll()
        out = await self._polled(node)
        max_age_s = hold_s if max_age_s is None else max_age_s
        deadline = time.monotonic() + hold_s
        fresh = out.events
        while out.state == NodeState.RUNNING and not needs_driver(fresh):
            pause = next_look(deadline - time.monotonic(), oldest_time(out.events), time.time(), max_age_s)
            if pause <= 0:
                break
            await asyncio.sleep(pause)
            more = await self._polled(node)
            fresh = more.events
            out.events += more.events
            out.logs += more.logs
            out.beat_age_s = more.beat_age_s
            out.state, out.returns = more.state, more.returns
        out.events, rows = node.batcher.take(out.events)  # the metrics rows rendered as a node actor renders them
        if rows:
            out.rows.append(rows)
        return out

    @staticmethod
    async def _polled(node: SimNode):
        """``node.poll()``; the checkpoint parts its ranks reached are written in threads, and reported by the
        poll after their write ends. On a cluster each rank writes its own part and its node actor's polls go on
        meanwhile; here four actors write the parts of 4,096 ranks into one folder, which took this machine's
        file system seconds (waiting for them held every row of those nodes: the bench's lag, not the driver's)."""
        import asyncio

        out = node.poll()
        node.writes += [asyncio.ensure_future(asyncio.to_thread(node._checkpoint, step)) for step in node.due]
        node.due.clear()
        for write in [w for w in node.writes if w.done()]:
            node.writes.remove(write)
            out.events += write.result()
        return out

    def stop(self, node_rank: int):
        from cluster.protocol import NodePoll, NodeState

        node = self.nodes.pop(node_rank, None)
        return NodePoll(state=NodeState.STOPPED if node and node.state == NodeState.RUNNING else NodeState.IDLE)

    def shutdown(self, node_rank: int) -> None:
        self.nodes.pop(node_rank, None)


class _Call:
    def __init__(self, actor, name: str, node_rank: int) -> None:
        self.actor, self.name, self.node_rank = actor, name, node_rank

    def remote(self, *args):
        return getattr(self.actor, self.name).remote(self.node_rank, *args)


class _NodeHandle:
    """Looks like a node actor's handle to ``NodeGroup``: ``handle.poll.remote()``."""

    def __init__(self, actor, node_rank: int) -> None:
        self._actor, self._node_rank = actor, node_rank

    def __getattr__(self, name: str) -> _Call:
        return _Call(self._actor, name, self._node_rank)


def _sim_group(placement, total_steps: int):
    """A ``NodeGroup`` whose polls, stops and shutdowns are the real ones, over simulated nodes."""
    import ray

    from cluster.context import assign_ranks
    from cluster.nodes.group import NodeGroup
    from cluster.nodes.node import NodeInfo
    from cluster.protocol import NodeState

    class SimGroup(NodeGroup):
        def __init__(self) -> None:
            n = placement.num_nodes
            hosts = [ray.remote(num_cpus=0)(SimNodes).remote(total_steps) for _ in range(min(n, SIM_PROCESSES))]
            ray.get([h.__ray_ready__.remote() for h in hosts])
            self._pg = None
            self.actors = [_NodeHandle(hosts[i % len(hosts)], i) for i in range(n)]
            self.hosts = hosts
            self.infos = [NodeInfo(node_id=f"sim-node-{i}", ip="127.0.0.1", hostname=f"sim{i}", pid=0, gpu_ids=())
                          for i in range(n)]
            self.sockets, self.actor_names = [], []
            self.placement = placement
            self.contexts = []
            self._inflight, self._lost = {}, set()
            self._answered, self._states = [False] * n, [NodeState.IDLE] * n

        def start(self, make_payload, attempt, rendezvous_timeout_s, ports=None):
            p = self.placement
            self.contexts = assign_ranks([p.workers_per_node] * p.num_nodes)
            staging = make_payload(self.contexts[0], "").staging_uri  # the real payload, as the driver builds it
            ray.get([a.start.remote([c.world_rank for c in self.contexts if c.node_rank == i], staging, attempt,
                                    len(self.contexts))
                     for i, a in enumerate(self.actors)])
            self._answered = [False] * len(self.actors)
            self._states = [NodeState.RUNNING] * len(self.actors)
            return self.contexts

        def shutdown(self) -> None:
            self._call_all("shutdown", 30, None)
            for h in self.hosts:
                ray.kill(h)

    return SimGroup()


# --- one size, in its own driver process -------------------------------------------------


def _trace_memory(seconds: float, ranks: int):
    """SCALE_BENCH_TRACEMALLOC=1: the driver's Python allocations at a third of the run and near its end; what grew
    most between the two, by line, goes to bench/results-scale-memory-<ranks>.txt. A thread of the driver's process
    (tracemalloc slows every allocation: its figures of CPU and lag are not the bench's)."""
    import threading
    import tracemalloc

    tracemalloc.start(8)

    def sample() -> None:
        time.sleep(5 + seconds / 3)
        first = tracemalloc.take_snapshot()
        time.sleep(seconds * 2 / 3 - 3)
        last = tracemalloc.take_snapshot()
        keep = [tracemalloc.Filter(False, tracemalloc.__file__)]
        diff = last.filter_traces(keep).compare_to(first.filter_traces(keep), "traceback")
        lines = [f"The driver at {ranks} ranks: Python allocations that grew most between {5 + seconds / 3:.0f} s "
                 f"and {5 + seconds - 3:.0f} s (tracemalloc, 8 frames)", ""]
        for stat in diff[:8]:
            lines.append(f"{stat.size_diff / 2**20:+.2f} MiB in {stat.count_diff:+d} blocks (now {stat.size / 2**20:.2f} MiB)")
            lines += [f"    {frame.filename}:{frame.lineno}" for frame in stat.traceback[-8:]]
        (ROOT / "bench" / f"results-scale-memory-{ranks}.txt").write_text("\n".join(lines) + "\n")

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    return thread


def run_size(ranks: int, seconds: float, ray_address: str, out_json: str) -> None:
    import ray

    import jobs.driver.driver
    from jobs.driver.driver import Driver
    from jobs.spec import load_spec_text

    ray.init(address=ray_address, logging_level="ERROR", log_to_driver=False)
    storage = tempfile.mkdtemp(prefix="raylaunch-scale-", dir=storage_root())
    total = int(seconds * STEPS_PER_S)
    spec = load_spec_text(
        f"name: scale-{ranks}\ntrain_fn: bench.scale:train_fn\n"
        f"scaling: {{num_nodes: {ranks // RANKS_PER_NODE}, workers_per_node: {RANKS_PER_NODE}}}\n"
        f"checkpoint: {{keep: 2}}\nfailure: {{max_restarts: 0}}\nstorage: {storage}\n"
    )

    def reserve(spec, placement, recorder, token, *, can_grow):
        recorder.mark("reserved")
        return _sim_group(placement, total)

    # Where the nodes come from is the one thing replaced: everything after is the driver's own.
    jobs.driver.driver.reserve = reserve

    metrics = os.path.join(storage, spec.name, "metrics.jsonl")
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    stop = ctx.Event()
    monitor = ctx.Process(target=_monitor, args=(os.getpid(), metrics, stop, results), daemon=True)
    monitor.start()
    with open(os.path.join(storage, "driver.out"), "w") as out:
        driver = Driver(spec, can_grow=False, out=out)
        traced = _trace_memory(seconds, ranks) if os.environ.get("SCALE_BENCH_TRACEMALLOC") else None
        if os.environ.get("SCALE_BENCH_PROFILE"):  # a folder: the driver's cProfile stats per size
            import cProfile

            with cProfile.Profile() as prof:
                result = driver.run()
            os.makedirs(os.environ["SCALE_BENCH_PROFILE"], exist_ok=True)
            prof.dump_stats(os.path.join(os.environ["SCALE_BENCH_PROFILE"], f"driver-{ranks}.prof"))
        else:
            result = driver.run()
    stop.set()
    if traced is not None:
        traced.join(30)
    m = results.get(timeout=60)
    monitor.join(10)
    rows_expected = ranks * total
    m.update(ranks=ranks, nodes=ranks // RANKS_PER_NODE, seconds=seconds, status=result.status,
             error=result.error, checkpoints=len(result.checkpoints), rows_expected=rows_expected)
    with open(out_json, "w") as f:
        json.dump(m, f)
    ray.shutdown()
    shutil.rmtree(storage, ignore_errors=True)


def _monitor(pid: int, metrics: str, stop, results) -> None:
    """Beside the driver: its CPU and memory every 0.5 s, and each metrics row's lag."""
    import psutil

    os.nice(10)
    proc = psutil.Process(pid)
    samples: list[tuple[float, float, int, int]] = []  # (time, cpu seconds, rss, rss not shared)
    lags: list[float] = []
    seen_at: list[float] = []
    rows = 0
    first_row = last_row = None
    f = None
    buf = b""
    next_sample = 0.0
    while True:
        last = stop.is_set()  # one more pass after the driver ended: its last rows
        now = time.time()
        if now >= next_sample:
            try:
                t, mem = proc.cpu_times(), proc.memory_info()
                # growth: of its own memory (not the pages of Ray's shared object store it maps)
                samples.append((now, t.user + t.system, mem.rss, mem.rss - mem.shared))
            except psutil.Error:
                break
            next_sample = now + 0.5
        if f is None and os.path.exists(metrics):
            f = open(metrics, "rb")
        if f is not None:
            buf += f.read()
            lines = buf.split(b"\n")
            buf = lines.pop()
            seen = time.time()
            for line in lines:
                if b'"loss"' in line:  # a metrics row (not a resources row)
                    # its "time" read without parsing the row: at 4,096 ranks 40,000 rows a second pass here, on
                    # the cores the driver and the simulated nodes share (json.loads took 0.3 cores of two)
                    at = line.index(b'"time": ') + 8
                    lags.append(seen - float(line[at:line.index(b",", at)]))
                    seen_at.append(seen)
                    rows += 1
                    first_row = first_row or seen
                    last_row = seen
        if last:
            break
        time.sleep(0.05)
    if f is not None:
        f.close()
    out: dict = {"rows": rows}
    if first_row and samples:
        a, b = first_row + WARMUP_S, last_row
        steady = [s for s in samples if a <= s[0] <= b]
        if len(steady) >= 2:
            out["driver_cores"] = (steady[-1][1] - steady[0][1]) / (steady[-1][0] - steady[0][0])
            rows_in = sum(1 for t in seen_at if steady[0][0] <= t <= steady[-1][0])
            # load-independent: the driver's CPU for each 1,000 rows it wrote (a starved driver
            # uses fewer cores and falls behind; this stays)
            out["cpu_ms_per_1000_rows"] = 1e6 * (steady[-1][1] - steady[0][1]) / max(1, rows_in)
            third = steady[len(steady) // 3]
            out["rss_growth_mb_per_min"] = (steady[-1][3] - third[3]) / 2**20 / max(1e-9, (steady[-1][0] - third[0]) / 60)
        out["peak_rss_mb"] = max(s[2] for s in samples) / 2**20
    if lags:
        lags.sort()
        out["lag_p50_s"] = lags[len(lags) // 2]
        out["lag_p99_s"] = lags[int(len(lags) * 0.99)]
        out["lag_max_s"] = lags[-1]
    results.put(out)


# --- all sizes -------------------------------------------------------------------------------


def line(r: dict) -> str:
    if r.get("status") != "succeeded" or "driver_cores" not in r:
        return f"{r['ranks']:>5} ranks: {r.get('status')}: {r.get('error')}"
    return (f"{r['ranks']:>5} ranks ({r['nodes']:>3} nodes): driver {r['driver_cores']:.2f} cores "
            f"({r['cpu_ms_per_1000_rows']:.0f} ms CPU per 1,000 rows), "
            f"peak memory {r['peak_rss_mb']:.0f} MB (growth {r['rss_growth_mb_per_min']:+.1f} MB/min), "
            f"lag p50 {r['lag_p50_s']:.2f} s p99 {r['lag_p99_s']:.2f} s max {r['lag_max_s']:.2f} s, "
            f"{r['rows']}/{r['rows_expected']} rows")


def write_markdown(results: list[dict], seconds: float, path: Path) -> None:
    rows = "\n".join(
        f"| {r['ranks']} | {r['nodes']} | {r.get('driver_cores', float('nan')):.2f} | "
        f"{r.get('cpu_ms_per_1000_rows', float('nan')):.0f} | {r.get('peak_rss_mb', 0):.0f} | "
        f"{r.get('rss_growth_mb_per_min', float('nan')):+.1f} | {r.get('lag_p50_s', float('nan')):.2f} | "
        f"{r.get('lag_p99_s', float('nan')):.2f} | {r.get('lag_max_s', float('nan')):.2f} | "
        f"{r.get('rows', 0)}/{r['rows_expected']} |"
        for r in results
    )
    load = os.getloadavg()
    path.write_text(
        f"# The driver at scale (`make bench-scale`)\n\n"
        f"The real driver against simulated nodes ({RANKS_PER_NODE} ranks a node, every rank logging metrics "
        f"at every step, {STEPS_PER_S:g} steps/s, a checkpoint every {CHECKPOINT_EVERY} steps, {seconds:g} s "
        f"of training per size). Driver cores: the driver process's CPU time over its steady steps; memory: "
        f"its peak resident memory, and how it grew over the last two thirds of the run; lag: from a rank's "
        f"event to its row in metrics.jsonl.\n\n"
        f"| ranks | nodes | driver cores | CPU ms / 1,000 rows | peak memory (MB) | growth (MB/min) | "
        f"lag p50 (s) | lag p99 (s) | lag max (s) | rows written |\n|---|---|---|---|---|---|---|---|---|---|\n"
        f"{rows}\n\n"
        f"Storage: {storage_root() or tempfile.gettempdir()} (`storage_root`). "
        f"Machine: {os.cpu_count()} cores, {platform.python_version()}, load average at the end "
        f"{load[0]:.1f} (shared with other work). Goals (#46): a lag p99 under 1 s at 1,024 ranks and under 2 s "
        f"at 4,096, the driver under 1 core at 4,096, memory that does not grow with the run's length.\n"
    )


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--size":
        run_size(int(sys.argv[2]), float(os.environ.get("SCALE_BENCH_S", "40")), sys.argv[3], sys.argv[4])
        return
    import ray

    seconds = float(os.environ.get("SCALE_BENCH_S", "40"))
    sizes = [int(s) for s in os.environ.get("SCALE_BENCH_SIZES", "16,128,1024,4096").split(",")]
    tmp = tempfile.mkdtemp(prefix="raylaunch-scale-ray-")
    ctx = ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR",
                   _temp_dir=tmp, log_to_driver=False)
    address = ctx.address_info["gcs_address"]
    results = []
    try:
        for ranks in sizes:
            out = os.path.join(tmp, f"size-{ranks}.json")
            subprocess.run([sys.executable, "-m", "bench.scale", "--size", str(ranks), address, out],
                           cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
            with open(out) as f:
                r = json.load(f)
            print(line(r), flush=True)
            results.append(r)
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    write_markdown(results, seconds, ROOT / "bench" / "results-scale.md")
    print(f"wrote {ROOT / 'bench' / 'results-scale.md'}")


if __name__ == "__main__":
    main()
