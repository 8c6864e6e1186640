"""``raylaunch``: a thin shell over the spec, the driver and the cluster connection."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
from typing import TYPE_CHECKING, Any, Callable

from cluster.errors import RaylaunchError
from cluster.protocol import RunStatus
from jobs.spec import JobSpec, SpecError, json_schema, load_spec, spec_from_dict

if TYPE_CHECKING:
    from jobs.driver.driver import Driver

__all__ = ["main"]


def _literals(args: argparse.Namespace) -> dict[str, str]:
    """``--storage`` and ``--name``: strings as given, never read as YAML (``--name 2024``)."""
    return {key: value for key in ("storage", "name") if (value := getattr(args, key)) is not None}


def _spec_from_args(args: argparse.Namespace) -> JobSpec:
    """The spec a verb runs: a spec file with ``--set``, a launch command's (``raylaunch launch``, or ``submit`` /
    ``validate`` of a script), or the one ``submit`` sent as JSON."""
    launch = getattr(args, "launch", None)
    if launch is not None:
        return launch.spec()
    if getattr(args, "spec_json", None):
        return spec_from_dict(json.loads(args.spec_json), "the submitted spec")
    if not args.spec:
        raise SpecError(["give the job spec (YAML), e.g. raylaunch run jobs/examples/digits.yaml"], "the command line")
    return load_spec(args.spec, list(args.set or []), literals=_literals(args))


def cmd_validate(args: argparse.Namespace) -> int:
    from cluster.train_function import check_entry

    spec = _spec_from_args(args)
    script = check_entry(spec)
    s = spec.scaling
    entry = f"script {spec.script} {shlex.join(spec.args)}".rstrip() if script else f"train_fn {spec.train_fn}"
    print(f"{args.spec or 'the launch command'}: ok ({spec.name}: {s.num_nodes} nodes x {s.workers_per_node} "
          f"workers, {entry}, storage {spec.storage})")
    if script is not None:
        print(script.describe())
    if s.elastic_min < s.num_nodes:
        from jobs.driver.policy import world_sizes

        per_node = s.workers_per_node if isinstance(s.workers_per_node, int) else None
        from jobs.spec.strategy import read_accelerate_config

        # the accumulation at num_nodes: the spec's, or a DeepSpeed config file's
        sizes = world_sizes(s, per_node or 1, read_accelerate_config(spec).gradient_accumulation_steps)
        shown = [w.describe() if per_node else f"{w.nodes} node{'s' if w.nodes != 1 else ''} (gradient "
                 f"accumulation {w.accumulation})" for w in sizes]
        left_out = sorted(set(range(s.elastic_min, s.num_nodes + 1)) - {w.nodes for w in sizes}, reverse=True)
        print(f"elastic: runs at {'; '.join(shown)}"
              + (f"; not at {', '.join(map(str, left_out))} node(s): the global batch would change there "
                 "(scaling.keep_global_batch)" if left_out else "")
              + ("" if s.keep_global_batch else "; the global batch changes with the world size "
                 "(scaling.keep_global_batch is false)"))
    env = spec.env
    if env.vars or env.secrets or env.pip:
        unset = [n for n in env.secrets if not os.environ.get(n)]
        print(f"environment: vars {', '.join(env.vars) or '-'}; secrets {', '.join(env.secrets) or '-'}"
              + (f" (not set in this shell: {', '.join(unset)})" if unset else " (set in this shell)")
              + f"; packages {', '.join(env.requirements) or '-'}")
    if spec.accelerate.fsdp is not None or spec.accelerate.config_file:
        from jobs.spec.strategy import read_accelerate_config

        accelerate = read_accelerate_config(spec)
        if note := accelerate.note():
            print(note)
        print("accelerate (resolved, as every rank gets it):\n  " + accelerate.describe().replace("\n", "\n  "))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from cluster.nodes.connect import connect
    from jobs.driver.driver import Driver

    spec = _spec_from_args(args)
    address = args.address or os.environ.get("RAY_ADDRESS") or None
    if address is not None and args.local_nodes is not None:
        raise SpecError(["--local-nodes starts an embedded cluster; leave it out when giving --address or RAY_ADDRESS"], "the command line")
    from jobs.progress import ProgressView

    view = ProgressView.for_stream(sys.stdout, quiet=args.quiet, relay=args.event_lines)
    import psutil

    driver = Driver(spec, fresh=args.fresh, out=view, on_event=view.event, started_at=psutil.Process().create_time())
    driver.preflight()  # train_fn and storage are checked before Ray starts
    if driver.done is not None:  # it already succeeded with this spec (said): nothing to start
        view.close()
        if driver.done.return_value is not None:
            print(f"raylaunch: result {json.dumps(driver.done.return_value)}")
        return 0
    upload = None
    if address is not None and "RAY_JOB_CONFIG_JSON_ENV_VAR" not in os.environ:
        from cluster.nodes.upload import plan_upload

        upload = plan_upload(os.getcwd(), storage=spec.storage)  # checked before anything is packaged
    s = spec.scaling
    per_node = s.workers_per_node * s.cpus_per_worker if isinstance(s.workers_per_node, int) else float(os.cpu_count() or 1)
    # `raylaunch stop` (Ray Jobs) and a scheduler's kill send SIGTERM: stop every rank,
    # record "stopped" and keep the last committed checkpoint.
    # A launch command's --num_machines is the embedded cluster's size unless --local-nodes says otherwise.
    local_nodes = args.local_nodes or (s.num_nodes if getattr(args, "launch", None) is not None else 1)
    with connect(address, local_nodes=local_nodes, cpus_per_node=per_node, upload=upload,
                 keep_temp=bool(getattr(args, "keep_temp", False))) as can_grow:
        signal.signal(signal.SIGTERM, _stop_on_sigterm(driver))  # after ray.init, which installs its own
        driver.can_grow = can_grow
        try:
            result = driver.run()
        finally:
            view.close()
    print(f"raylaunch: {result.status} after {result.attempts} attempt(s); run directory {result.run_dir}")
    if result.return_value is not None:
        print(f"raylaunch: result {json.dumps(result.return_value)}")
    if result.status != RunStatus.SUCCEEDED:
        error = result.error or ""
        if driver.error_said and "\n" in error:  # printed in full as its attempt ended: the cause's line here
            error = error.split("\n", 1)[0] + " (in full above)"
        print(f"raylaunch: {spec.name} {result.status}: {error}", file=sys.stderr)
        return 1
    return 0


class _Stopped(KeyboardInterrupt):
    """SIGTERM, raised where the driver is, so it stops cleanly."""


def _stop_on_sigterm(driver: "Driver") -> Callable[[int, Any], None]:
    """The SIGTERM handler: the run is recorded as stopped by SIGTERM even when the exception reaches the driver
    as a plain KeyboardInterrupt (Ray raises its own when a signal handler's exception interrupts ``ray.get``)."""
    def handler(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        driver.stop_reason = "stopped (SIGTERM)"
        raise _Stopped(driver.stop_reason)

    return handler


def _address(args: argparse.Namespace) -> str:
    address = args.address or os.environ.get("RAY_ADDRESS")
    if not address:
        raise SpecError(["--address is required (or set RAY_ADDRESS), e.g. --address http://127.0.0.1:8265 "
                         "after `ray dashboard cluster.yaml`"], "the command line")
    return address


def cmd_submit(args: argparse.Namespace) -> int:
    from jobs import submit

    address = _address(args)
    if getattr(args, "launch", None) is not None:
        request = submit.plan_submit_spec(args.launch.spec(), address, implicit_config=args.launch.implicit_config,
                                          fresh=args.fresh)
    else:
        request = submit.plan_submit(args.spec, list(args.set or []), address, literals=_literals(args),
                                     fresh=args.fresh)
    if args.dry_run:
        print(request.describe())
        print("raylaunch: --dry-run: nothing was sent")
        return 0
    job_id = submit.send(request)
    print(f"raylaunch: submitted {job_id}")
    print(f"raylaunch: run directory {request.run_dir}")
    if not args.follow:
        print(f"raylaunch: follow it with: raylaunch logs {job_id} --follow --address {address}")
        return 0
    return submit.follow(address, job_id, quiet=args.quiet, secrets=request.secrets)


def cmd_status(args: argparse.Namespace) -> int:
    from jobs import submit

    address = _address(args)
    jobs = submit.client(address)
    info = submit.call(jobs.get_job_info, address, args.job)
    print(f"{args.job}: {str(info.status).split('.')[-1]}"
          + (f" ({info.message})" if info.message else ""))
    meta = info.metadata or {}
    if "raylaunch_storage" in meta:
        from cluster.storage_io import join_uri

        print(f"run directory: {join_uri(meta['raylaunch_storage'], meta.get('raylaunch_run', ''))}")
    if not info.status.is_terminal():
        from jobs.run.events import RanksPlaced, decode_line

        text = submit.call(jobs.get_job_logs, address, args.job)
        placed = [e for e in map(decode_line, text.splitlines()) if isinstance(e, RanksPlaced)]
        if placed:  # where the ranks of the running attempt are, from the driver's own events in the job's log
            print(f"ranks of attempt {placed[-1].attempt}:")
            for line in placed[-1].lines():
                print(f"  {line}")
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    from jobs import submit

    address = _address(args)
    if args.follow:
        return submit.follow(address, args.job, quiet=args.quiet)
    jobs = submit.client(address)
    from jobs.run.events import EVENT_PREFIX

    text = submit.call(jobs.get_job_logs, address, args.job)
    print("".join(line for line in text.splitlines(keepends=True) if not line.startswith(EVENT_PREFIX)), end="")
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    from jobs import submit

    address = _address(args)
    jobs = submit.client(address)
    submit.call(jobs.get_job_status, address, args.job)
    stopped = submit.call(jobs.stop_job, address, args.job)
    print(f"raylaunch: {'stopping' if stopped else 'already ended:'} {args.job}")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from jobs import submit

    address = _address(args)
    jobs = submit.client(address)
    for info in sorted(submit.call(jobs.list_jobs, address), key=lambda i: i.start_time or 0):
        if "raylaunch_stacks_of" in (info.metadata or {}):
            continue  # a `raylaunch stacks` helper
        name = (info.metadata or {}).get("raylaunch_run", "")
        print(f"{info.submission_id or info.job_id}\t{str(info.status).split('.')[-1]}\t{name}")
    return 0


def cmd_stacks(args: argparse.Namespace) -> int:
    from jobs.driver.hangs import live_stacks
    from jobs.submit import job_stacks

    address = args.address or None
    if address and address.startswith(("http://", "https://")):
        print(job_stacks(address, args.run, full=args.full, samples=args.samples))
    else:
        print(live_stacks(args.storage, args.run, address, full=args.full, samples=args.samples))
    return 0


def cmd_runs(args: argparse.Namespace) -> int:
    from jobs.runs import format_runs

    print(format_runs(args.storage))
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from jobs.runs import format_show

    print(format_show(args.storage, args.run, per_rank=args.per_rank))
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    print(json.dumps(json_schema(), indent=2))
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from jobs.runs import plot, plot_goodput

    if args.goodput:
        if len(args.runs) != 1:
            raise SpecError(["--goodput draws one run's timeline: give one run name"], "the command line")
        b = plot_goodput(args.storage, args.runs[0], args.output)
        print(f"raylaunch: wrote {args.output} (goodput {100 * b.ratio:.0f}%: {args.runs[0]}'s timeline)")
        return 0
    curves = plot(args.storage, args.runs, args.metric, args.output, per_rank=args.per_rank)
    print(f"raylaunch: wrote {args.output} ({args.metric}: {', '.join(c.label for c in curves)})")
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="raylaunch", description="Run an Accelerate training function on a Ray cluster.")
    sub = p.add_subparsers(dest="command", required=True)

    def spec_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("spec", nargs="?" if sp.prog.endswith(" run") else None,
                        help="the job spec (YAML); submit and validate also take a launch command: "
                             "[accelerate launch options] SCRIPT.py [args]")
        sp.add_argument("--set", action="append", metavar="KEY=VALUE",
                        help="override a spec value, e.g. --set scaling.num_nodes=4 (repeatable)")
        sp.add_argument("--storage", help="override the spec's storage path or URI")
        sp.add_argument("--name", help="override the run name")

    run = sub.add_parser("run", help="run a job; the driver runs in this process")
    spec_args(run)
    run.add_argument("--spec-json", help=argparse.SUPPRESS)  # the spec `submit` built from a launch command
    # Under `submit`: the run's events as lines of the job's log, for `submit --follow` (jobs/run/events.py).
    run.add_argument("--event-lines", action="store_true", help=argparse.SUPPRESS)
    run.add_argument("--address", help="an existing Ray cluster (ray://host:10001 or auto); default: RAY_ADDRESS, "
                                       "else an embedded local cluster")
    run.add_argument("--local-nodes", type=int, metavar="N",
                     help="make the embedded cluster N real Ray nodes on this machine (default 1)")
    run.add_argument("--fresh", action="store_true",
                     help="start over in a new run directory instead of resuming (the old one is kept)")
    run.add_argument("--keep-temp", action="store_true", dest="keep_temp",
                     help="keep the embedded cluster's Ray session folder (/tmp/ray/session_*, Ray's own logs) when "
                          "the command ends (also RAYLAUNCH_KEEP_TEMP=1); by default it is removed")
    run.add_argument("--quiet", action="store_true", help="no progress bar or progress lines")
    run.set_defaults(func=cmd_run)

    sb = sub.add_parser("submit", help="send a job to a cluster through the Ray Jobs API")
    spec_args(sb)
    sb.add_argument("--address", help="the dashboard, e.g. http://127.0.0.1:8265 (default: RAY_ADDRESS)")
    sb.add_argument("--follow", action="store_true", help="show live progress and logs; exit with the job's status")
    sb.add_argument("--dry-run", action="store_true", help="print the request and send nothing")
    sb.add_argument("--fresh", action="store_true",
                    help="start over in a new run directory instead of resuming (the old one is kept)")
    sb.add_argument("--quiet", action="store_true", help="with --follow: logs and the outcome, no progress")
    sb.set_defaults(func=cmd_submit)

    for verb, func, text in [("status", cmd_status, "a job's status"), ("logs", cmd_logs, "a job's logs"),
                             ("stop", cmd_stop, "stop a job; its ranks stop and result.json says stopped")]:
        vp = sub.add_parser(verb, help=text)
        vp.add_argument("job", help="the job id that submit printed")
        vp.add_argument("--address", help="the dashboard address (default: RAY_ADDRESS)")
        if verb == "logs":
            vp.add_argument("--follow", action="store_true", help="follow live, with a progress bar")
            vp.add_argument("--quiet", action="store_true", help="with --follow: no progress")
        vp.set_defaults(func=func)
    lp = sub.add_parser("list", help="the cluster's jobs")
    lp.add_argument("--address", help="the dashboard address (default: RAY_ADDRESS)")
    lp.set_defaults(func=cmd_list)

    default_storage = os.environ.get("RAYLAUNCH_STORAGE", "~/raylaunch-runs")
    storage_help = f"the storage the runs were written to (default: RAYLAUNCH_STORAGE or {default_storage})"
    rp = sub.add_parser("runs", help="a table of the runs on a storage path")
    rp.add_argument("--storage", default=default_storage, help=storage_help)
    rp.set_defaults(func=cmd_runs)
    shp = sub.add_parser("show", help="one run: spec, result, restarts, checkpoints, where the logs are")
    shp.add_argument("run", help="the run's name (see `raylaunch runs`)")
    shp.add_argument("--storage", default=default_storage, help=storage_help)
    shp.add_argument("--per-rank", action="store_true", help="metrics per rank instead of the mean across ranks")
    shp.set_defaults(func=cmd_show)
    stp = sub.add_parser("stacks", help="where every rank of a live run is: stacks grouped by rank, "
                                        "without stopping it")
    stp.add_argument("run", metavar="RUN", help="a run's name (started with `run`), or with --address http://... "
                                               "the job id that submit printed")
    stp.add_argument("--storage", default=default_storage, help=storage_help)
    stp.add_argument("--address", help="a submitted job's dashboard (http://127.0.0.1:8265), or the Ray address of "
                                       "the run's cluster when it differs from the one the run recorded")
    stp.add_argument("--full", action="store_true", help="also every thread of every rank, frame by frame")
    stp.add_argument("--samples", type=int, default=1, metavar="N",
                     help="read every rank N times, 0.5 s apart, and name a straggler: the rank the others wait for")
    stp.set_defaults(func=cmd_stacks)
    pp = sub.add_parser("plot", help="a PNG of one metric by step for one or more runs")
    pp.add_argument("runs", nargs="+", metavar="RUN", help="run names (see `raylaunch runs`)")
    pp.add_argument("--metric", default="loss", help="the metric to plot (default: loss)")
    pp.add_argument("-o", "--output", default="plot.png", help="the PNG to write (default: plot.png)")
    pp.add_argument("--storage", default=default_storage, help=storage_help)
    pp.add_argument("--per-rank", action="store_true", help="one curve per rank instead of the mean across ranks")
    pp.add_argument("--goodput", action="store_true",
                    help="the run's timeline instead: attempts along a time axis, coloured by where the time went")
    pp.set_defaults(func=cmd_plot)

    val = sub.add_parser("validate", help="check a spec and its train_fn without running anything")
    spec_args(val)
    val.set_defaults(func=cmd_validate)
    sub.add_parser("schema", help="print the job spec's JSON Schema, for editors (a copy ships as "
                                  "jobs/spec.schema.json)").set_defaults(func=cmd_schema)
    # Listed for --help; main() reads a launch command with Accelerate's own parser (jobs.spec.launch).
    sub.add_parser("launch", help="run an `accelerate launch` script unchanged: raylaunch launch [raylaunch options] "
                                  "[accelerate launch options] SCRIPT.py [script args]", add_help=False)
    return p


# The verbs that import the user's training function, and so need the working directory.
_USER_CODE_VERBS = {"run", "submit", "validate", "launch"}


def _set_path(command: str) -> None:
    """The working directory on ``sys.path`` only for the verbs that import the user's code,
    after the runner's own packages (and the storage layer's pyarrow) are loaded, so a project's
    own ``cluster/``, ``jobs/`` or ``train_fn/`` folder cannot stand in for them, and a stray
    ``pyarrow.py`` cannot reach ``runs``/``show``/``plot`` at all."""
    cwd = os.getcwd()
    sys.path[:] = [p for p in sys.path if p not in ("", cwd)]
    if command in _USER_CODE_VERBS:
        import cluster  # noqa: F401  (pinned before the folder joins the path)
        import jobs.run.storage  # noqa: F401
        import train_fn  # noqa: F401

        # The project's modules are what every node gets (uploaded with the job, or on the
        # embedded cluster's PYTHONPATH), so the driver finds them too.
        sys.path.insert(0, cwd)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    verb = argv[0] if argv else ""
    from jobs.spec.launch import is_script_command, verb_args

    if verb == "launch" or (verb in ("submit", "validate") and is_script_command(argv[1:])):
        try:
            # imports Accelerate: before the project's folder is on the path
            args = verb_args(verb, argv[1:], {"launch": cmd_run, "submit": cmd_submit, "validate": cmd_validate})
        except RaylaunchError as exc:
            print(f"raylaunch: {exc}{exc.hint}", file=sys.stderr)
            return exc.exit_code
        _set_path(verb)
    else:
        args = _parser().parse_args(argv)
        _set_path(args.command)
    if getattr(args, "local_nodes", None) is not None and args.local_nodes < 1:
        print("raylaunch: --local-nodes must be at least 1", file=sys.stderr)
        return 2
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except RaylaunchError as exc:
        print(f"raylaunch: {exc}{exc.hint}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
