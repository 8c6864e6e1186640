"""Run history on storage: ``raylaunch runs``, ``show`` and ``plot``.

Everything here reads what the driver wrote (``spec.yaml``, ``result.json``,
``metrics.jsonl``, checkpoint manifests) through ``RunDir``, so it works on
any storage the runner supports, on runs still running and on runs that
failed. Metrics are the mean across the ranks that logged them, unless
asked per rank.
"""

from __future__ import annotations

import datetime as _dt
import time
from collections import defaultdict
from dataclasses import dataclass, field

from cluster.errors import RaylaunchError
from cluster.layout import LOGS, METRICS, TENSORBOARD
from cluster.protocol import RunStatus
from jobs.driver.pace import judge, pace_of_records
from jobs.run.events import AttemptStarted, MemoryMissed, RanksPlaced, SessionStarted, decode
from jobs.run.ledger import CATEGORIES, Category, Ledger, ledger, suggestion
from jobs.run.storage import RunDir, numeric_metrics
from jobs.spec import run_name_problem

__all__ = ["RunNotFound", "Series", "format_runs", "format_show", "plot", "plot_goodput", "series",
           "summaries"]


class RunNotFound(RaylaunchError, LookupError):
    """A run or a metric that does not exist; the message lists what does."""

    exit_code = 2


@dataclass(frozen=True)
class Series:
    """One curve: ``values[i]`` at ``steps[i]``; ``restarts`` are the steps where a later attempt took over."""

    label: str
    steps: list[int]
    values: list[float]
    restarts: list[int]
    resizes: list[tuple[int, int]] = field(default_factory=list)  # (step, new world size) where it changed


def _open(storage: str, name: str) -> RunDir:
    wrong = run_name_problem(name)
    if wrong:
        raise RunNotFound(f"run name {wrong}; see `raylaunch runs --storage {storage}`")
    run = RunDir(storage, name)
    if run.read_spec() is None:
        names = RunDir.names(storage)
        raise RunNotFound(f"no run {name!r} in {storage}" + (f"; runs there: {', '.join(names)}" if names
                                                              else "; it holds no runs"))
    return run


def series(records: list[dict], metric: str, per_rank: bool = False, label: str = "") -> list[Series]:
    """The curve of ``metric`` by step: the mean across ranks, or one curve per rank.

    Steps run again after a restart take the later attempt's values (what the
    final model saw); ``restarts`` marks where each later attempt began.
    """
    # (rank or None) -> step -> (attempt, [values])
    curves: dict[int | None, dict[int, tuple[int, list[float]]]] = defaultdict(dict)
    first_step: dict[int, int] = {}
    for r in records:
        if r.get("step") is None or not isinstance(r.get(metric), (int, float)):
            continue
        step, attempt = int(r["step"]), int(r.get("attempt", 1))
        first_step[attempt] = min(step, first_step.get(attempt, step))
        key = r.get("rank", 0) if per_rank else None
        held = curves[key].get(step)
        if held is None or attempt > held[0]:
            curves[key][step] = (attempt, [float(r[metric])])
        elif attempt == held[0]:
            held[1].append(float(r[metric]))
    restarts = sorted(s for a, s in first_step.items() if a > min(first_step))
    resizes = world_changes(records)
    out = []
    for key in sorted(curves, key=lambda k: -1 if k is None else k):
        points = sorted(curves[key].items())
        name = label if key is None else f"{label} rank {key}".strip()
        out.append(Series(name, [s for s, _ in points], [sum(v) / len(v) for _, (_, v) in points], restarts,
                          resizes))
    return out


def world_changes(records: list[dict]) -> list[tuple[int, int]]:
    """``(step, world size)`` where an attempt began at another world size than the one before it
    (an elastic run's resizes), from the metrics rows' ``world_size``."""
    first: dict[int, tuple[int, int]] = {}  # attempt -> (first step, world size)
    for r in records:
        if r.get("step") is None or not isinstance(r.get("world_size"), int):
            continue
        attempt, step = int(r.get("attempt", 1)), int(r["step"])
        if attempt not in first or step < first[attempt][0]:
            first[attempt] = (step, r["world_size"])
    out, before = [], None
    for _, (step, world) in sorted(first.items()):
        if before is not None and world != before:
            out.append((step, world))
        before = world
    return out


def metric_names(records: list[dict]) -> list[str]:
    return sorted({k for r in records for k in numeric_metrics(r)})


@dataclass(frozen=True)
class Summary:
    name: str
    status: str
    nodes: int | None
    workers: int | None
    steps: int | None
    last_loss: float | None
    best: tuple[str, float] | None
    duration_s: float | None
    started: float | None
    goodput: float | None = None  # result.json's goodput ratio: training / wall clock


def _best(records: list[dict]) -> tuple[str, float] | None:
    """The best value of the evaluation metric (``eval*``): highest, or lowest for losses and errors."""
    names = [n for n in metric_names(records) if n.startswith("eval")]
    if not names:
        return None
    name = next((n for n in names if "acc" in n), names[0])
    values = series(records, name)[0].values
    lower = any(w in name for w in ("loss", "err", "perplexity", "wer"))
    return name, (min(values) if lower else max(values))


def summaries(storage: str) -> list[Summary]:
    """One line of facts per run under ``storage``, oldest first."""
    out = []
    for name in RunDir.names(storage):
        run = RunDir(storage, name)
        result = run.read_result() or {}
        spec = run.read_spec() or {}
        records = run.read_metrics()
        loss = series(records, "loss")
        nodes = result.get("num_nodes") or spec.get("scaling", {}).get("num_nodes")
        world = result.get("world_size")
        workers = world // nodes if world and nodes else spec.get("scaling", {}).get("workers_per_node")
        steps = max((int(r["step"]) for r in records if r.get("step") is not None), default=None)
        out.append(Summary(name, result.get("status", "running"), nodes,
                           workers if isinstance(workers, int) else None, steps,
                           loss[0].values[-1] if loss else None, _best(records), _duration(result),
                           result.get("start_time") or None, (result.get("goodput") or {}).get("ratio")))
    return sorted(out, key=lambda s: (s.started or 0, s.name))


def _duration(result: dict) -> float | None:
    """Seconds the run took, or has taken so far while it runs."""
    start, end = result.get("start_time"), result.get("end_time")
    if not start:
        return None
    status = RunStatus.of(result, missing=RunStatus.RUNNING)
    ended = status is None or status.is_terminal  # None: a spelling this version does not know, written at an end
    return (end if end and ended else time.time()) - start


def _dur(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    return f"{h}h{rest // 60:02d}m" if h else f"{rest // 60}m{rest % 60:02d}s"


def _when(t: float | None) -> str:
    return _dt.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M") if t else "-"


def format_runs(storage: str) -> str:
    """The ``raylaunch runs`` table."""
    rows = [("NAME", "STATUS", "NODES x WORKERS", "STEPS", "LAST LOSS", "BEST", "DURATION", "GOODPUT", "STARTED")]
    for s in summaries(storage):
        rows.append((
            s.name, s.status,
            f"{s.nodes} x {s.workers}" if s.nodes and s.workers else "-",
            str(s.steps) if s.steps is not None else "-",
            f"{s.last_loss:.4g}" if s.last_loss is not None else "-",
            f"{s.best[0]}={s.best[1]:.4g}" if s.best else "-",
            _dur(s.duration_s), f"{100 * s.goodput:.0f}%" if s.goodput is not None else "-", _when(s.started),
        ))
    if len(rows) == 1:
        return f"no runs in {storage}"
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def format_show(storage: str, name: str, per_rank: bool = False) -> str:
    """The ``raylaunch show`` report of one run."""
    import yaml

    run = _open(storage, name)
    result = run.read_result() or {}
    records = run.read_metrics()
    status = result.get("status", "running")
    lines = [f"run {name}: {status}", f"  directory   {run.uri}"]
    if result:
        lines.append(f"  world       {result.get('num_nodes')} nodes, world size {result.get('world_size')}")
        lines.append(f"  attempts    {result.get('attempts')} (restarts {result.get('restarts')}, "
                     f"preemptions {result.get('preemptions', 0)})")
        lines.extend(_format_resumes(run))
        for z in result.get("resizes") or []:
            lines.append(f"  resized     attempt {z.get('attempt')} from step {z.get('step')}: world size "
                         f"{z.get('old_world_size')} -> {z.get('new_world_size')} ({z.get('reason')})"
                         + ("" if z.get("global_batch_kept", True) else "; the global batch changed"))
        lines.append(f"  started     {_when(result.get('start_time'))}, duration {_dur(_duration(result))}")
        timeline = result.get("timeline") or {}
        if "process_start" in timeline and len(timeline) > 1:
            t0 = timeline["process_start"]
            lines.append("  start-up    " + ", ".join(f"{k.replace('_', ' ')} {v - t0:.1f} s" for k, v in
                                                     sorted(timeline.items(), key=lambda kv: kv[1]) if k != "process_start")
                         + " after the driver's process started")
        lines.extend(_format_books(run))
        if result.get("error"):
            lines.append("  error       " + result["error"].replace("\n", "\n              "))
        if result.get("return_value") is not None:
            lines.append(f"  result      {result['return_value']}")
    lines.append(f"  steps       {max((r['step'] for r in records if r.get('step') is not None), default='-')}")
    lines.append("  metrics (last value, " + ("per rank" if per_rank else "mean across ranks") + "):")
    for metric in metric_names(records):
        for s in series(records, metric, per_rank=per_rank, label=metric):
            lines.append(f"    {s.label:<28} {s.values[-1]:.6g} at step {s.steps[-1]}")
    lines.extend(_format_pace(records))
    if per_rank:
        lines.extend(_format_ranks(run, status))
    checkpoints = run.checkpoints.committed()
    lines.append(f"  checkpoints ({len(checkpoints)} committed):")
    for c in checkpoints:
        manifest = run.checkpoints.manifest(c)
        size = sum(f["size"] for f in manifest.get("files", {}).values())
        timing = manifest.get("timing") or {}
        held = (f"  held {timing['blocked_s']:.2f} s, committed after {timing['to_commit_s']:.2f} s"
                if "blocked_s" in timing and "to_commit_s" in timing else "")
        lines.append(f"    step {c.step:<8} {size / 2**20:9.1f} MiB  {c.uri}{held}")
    logs = run.log_uris()
    lines.append(f"  logs        {run.uri}/{LOGS}/ ({', '.join(u.rsplit('/', 1)[-1] for u in logs) or 'no output yet'})")
    lines.append(f"  metrics     {run.uri}/{METRICS}")
    lines.append(f"  tensorboard tensorboard --logdir {run.uri}/{TENSORBOARD}")
    lines.append("  spec:")
    lines.extend("    " + line for line in yaml.safe_dump(run.read_spec(), sort_keys=False).splitlines())
    return "\n".join(lines)


def _format_ranks(run: RunDir, status: str) -> list[str]:
    """Where the latest attempt's ranks run (node, host, address, process): to find the one to stop or inspect."""
    placed = [e for e in map(decode, run.read_events()) if isinstance(e, RanksPlaced)]
    if not placed:
        return ["  ranks       not placed yet"]
    last = placed[-1]
    now = "running" if status == RunStatus.RUNNING else f"ended: the run {status}"
    return [f"  ranks       attempt {last.attempt} ({now}):"] + [f"    {line}" for line in last.lines()]


def _format_resumes(run: RunDir) -> list[str]:
    """Where each attempt after the first resumed from: a snapshot in memory, a committed checkpoint, or the
    beginning (``events.jsonl``'s ``attempt`` events)."""
    out = []
    for e in map(decode, run.read_events()):
        if isinstance(e, AttemptStarted) and e.attempt > 1:
            missed = e.memory_missed.words() if isinstance(e.memory_missed, MemoryMissed) else e.memory_missed
            where = ("the beginning" if e.resume_step is None else
                     f"the snapshot of step {e.resume_step} in memory" if e.resume_from == "memory" else
                     f"checkpoint {e.resume_step} (storage" + (f": {missed})" if missed else ")"))
            out.append(f"  resumed     attempt {e.attempt} from {where}")
    return out


def _format_books(run: RunDir) -> list[str]:
    """Where the wall clock went: seconds, share and a bar per category, and what the books suggest."""
    events = [e for e in map(decode, run.read_events()) if e is not None]
    b = ledger(events, live=RunStatus.of(run.read_result(), missing=RunStatus.RUNNING) is RunStatus.RUNNING)
    if b.wall_s <= 0:
        return []
    sessions = sum(1 for e in events if isinstance(e, SessionStarted))
    lines = [f"  goodput     {100 * b.ratio:.0f}% of {_dur(b.wall_s)} trained the model that came out "
             f"(training / wall clock{f', {sessions} commands' if sessions > 1 else ''}):"]
    for cat in CATEGORIES:
        secs = b.seconds[cat]
        if secs > 0 or cat == Category.TRAINING:
            share = secs / b.wall_s
            lines.append(f"    {cat:<11} {secs:9.1f} s {100 * share:4.0f}%  {'#' * round(40 * share)}")
    if note := suggestion(b):
        lines.append(f"  suggestion  {note}")
    return lines


def _format_pace(records: list[dict]) -> list[str]:
    """Each rank's waits over the last attempt, and who is starved for data or waited for."""
    pace = pace_of_records(records)
    if not pace:
        return []
    lines = ["  pace (last attempt, mean share of each rank's step time spent waiting):"]
    lines.extend(f"    rank {rank:<4} for its data {100 * p['data_wait']:3.0f}%   for the other ranks "
                 f"{100 * p['sync_wait']:3.0f}%" for rank, p in pace.items())
    lines.extend(f"  {line}" for line in judge(pace).lines)
    return lines


def plot(storage: str, names: list[str], metric: str, out: str, per_rank: bool = False) -> list[Series]:
    """Write a PNG of ``metric`` by step for each run; restarts are marked on the curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves: list[Series] = []
    for name in names:
        records = _open(storage, name).read_metrics()
        found = series(records, metric, per_rank=per_rank, label=name)
        if not found:
            available = metric_names(records)
            raise RunNotFound(f"run {name!r} has no metric {metric!r}"
                              + (f"; it has: {', '.join(available)}" if available else "; it logged no metrics yet"))
        curves.extend(found)
    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    for s in curves:
        (line,) = ax.plot(s.steps, s.values, label=s.label)
        marks = [(st, v) for st, v in zip(s.steps, s.values) if st in s.restarts]
        if marks:
            ax.plot([m[0] for m in marks], [m[1] for m in marks], "x", color=line.get_color(), markersize=10,
                    label=f"{s.label}: restart")
        for step, world in s.resizes:  # an elastic run changed its world size here
            ax.axvline(step, color=line.get_color(), linestyle=":", alpha=0.7)
            ax.annotate(f"world {world}", (step, 1), xycoords=("data", "axes fraction"), rotation=90,
                        va="top", ha="right", fontsize=8, color=line.get_color())
    ax.set_xlabel("step")
    ax.set_ylabel(metric + ("" if per_rank else " (mean across ranks)"))
    ax.set_title(f"{metric} by step")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return curves


# Colours of the goodput timeline, one per category (training green, losses warm, waits grey).
_COLOURS = {Category.TRAINING: "#2ca02c", Category.RECOMPUTE: "#d62728", Category.STARTUP: "#1f77b4",
            Category.RESTORE: "#17becf", Category.CHECKPOINT: "#9467bd", Category.DATA_WAIT: "#ff7f0e",
            Category.FAILURE: "#8c564b", Category.WAITING: "#7f7f7f", Category.OTHER: "#c7c7c7"}


def plot_goodput(storage: str, name: str, out: str) -> Ledger:
    """Write a PNG of the run's timeline: each command that drove it a row, its attempts along a time axis,
    coloured by the ledger's categories."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    run = _open(storage, name)
    events = [e for e in map(decode, run.read_events()) if e is not None]
    b = ledger(events)
    if not b.segments:
        raise RunNotFound(f"run {name!r} has no events to draw (it ran before raylaunch kept them, or not yet)")
    starts = [e.time for e in events if isinstance(e, SessionStarted)]
    fig, ax = plt.subplots(figsize=(11, 1.8 + 0.6 * len(starts)), dpi=100)
    for row, t0 in enumerate(starts):
        t1 = starts[row + 1] if row + 1 < len(starts) else float("inf")
        segs = [s for s in b.segments if t0 <= s.start < t1]
        ax.broken_barh([(s.start - t0, s.end - s.start) for s in segs], (row - 0.4, 0.8),
                       facecolors=[_COLOURS[s.category] for s in segs])
        seen: set[int] = set()
        for s in segs:  # each attempt's start, labelled
            if s.attempt is not None and s.attempt not in seen:
                seen.add(s.attempt)
                ax.axvline(s.start - t0, ymin=0, ymax=1, color="black", linewidth=0.5, alpha=0.5)
                ax.annotate(f"attempt {s.attempt}", (s.start - t0, row + 0.42), fontsize=7, va="bottom")
    ax.set_yticks(range(len(starts)), [f"command {i + 1}" for i in range(len(starts))])
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the command's start")
    ax.set_title(f"{name}: goodput {100 * b.ratio:.0f}% of {_dur(b.wall_s)}")
    used = [c for c in CATEGORIES if b.seconds[c] > 0]
    ax.legend(handles=[Patch(color=_COLOURS[c], label=f"{c} {b.seconds[c]:.0f} s") for c in used],
              loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return b
