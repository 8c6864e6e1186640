"""``raylaunch``: a thin shell over the spec, the driver and the cluster connection."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable

from jobs.spec import JobSpec, SpecError, load_spec

__all__ = ["main"]


def _spec_from_args(args: argparse.Namespace) -> JobSpec:
    overrides = list(args.set or [])
    if args.storage:
        overrides.append(f"storage={args.storage}")
    if args.name:
        overrides.append(f"name={args.name}")
    return load_spec(args.spec, overrides)


def cmd_validate(args: argparse.Namespace) -> int:
    from cluster.worker import check_train_fn

    spec = _spec_from_args(args)
    check_train_fn(spec.train_fn)
    s = spec.scaling
    print(f"{args.spec}: ok ({spec.name}: {s.num_nodes} nodes x {s.workers_per_node} workers, "
          f"train_fn {spec.train_fn}, storage {spec.storage})")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from cluster.local import connect
    from jobs.driver import Driver

    spec = _spec_from_args(args)
    address = args.address or os.environ.get("RAY_ADDRESS") or None
    if address is not None and args.local_nodes is not None:
        raise SpecError(["--local-nodes starts an embedded cluster; leave it out when giving --address or RAY_ADDRESS"], "the command line")
    driver = Driver(spec, fresh=args.fresh)
    driver.preflight()  # train_fn and storage are checked before Ray starts
    s = spec.scaling
    per_node = s.workers_per_node * s.cpus_per_worker if isinstance(s.workers_per_node, int) else float(os.cpu_count() or 1)
    with connect(address, local_nodes=args.local_nodes or 1, cpus_per_node=per_node) as can_grow:
        driver.can_grow = can_grow
        result = driver.run()
    print(f"raylaunch: {result.status} after {result.attempts} attempt(s); run directory {result.run_dir}")
    if result.return_value is not None:
        print(f"raylaunch: result {json.dumps(result.return_value)}")
    if result.status != "succeeded":
        print(f"raylaunch: {spec.name} {result.status}: {result.error}", file=sys.stderr)
        return 1
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="raylaunch", description="Run an Accelerate training function on a Ray cluster.")
    sub = p.add_subparsers(dest="command", required=True)

    def spec_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("spec", help="the job spec (YAML)")
        sp.add_argument("--set", action="append", metavar="KEY=VALUE",
                        help="override a spec value, e.g. --set scaling.num_nodes=4 (repeatable)")
        sp.add_argument("--storage", help="override the spec's storage path or URI")
        sp.add_argument("--name", help="override the run name")

    run = sub.add_parser("run", help="run a job; the driver runs in this process")
    spec_args(run)
    run.add_argument("--address", help="an existing Ray cluster (ray://host:10001 or auto); default: RAY_ADDRESS, "
                                       "else an embedded local cluster")
    run.add_argument("--local-nodes", type=int, metavar="N",
                     help="make the embedded cluster N real Ray nodes on this machine (default 1)")
    run.add_argument("--fresh", action="store_true",
                     help="start over in a new run directory instead of resuming (the old one is kept)")
    run.set_defaults(func=cmd_run)

    val = sub.add_parser("validate", help="check a spec and its train_fn without running anything")
    spec_args(val)
    val.set_defaults(func=cmd_validate)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if getattr(args, "local_nodes", None) is not None and args.local_nodes < 1:
        print("raylaunch: --local-nodes must be at least 1", file=sys.stderr)
        return 2
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except SpecError as exc:
        print(f"raylaunch: {exc}", file=sys.stderr)
        return 2
    except (ImportError, AttributeError) as exc:
        if "train_fn" not in str(exc):
            raise
        print(f"raylaunch: {exc}. Fix `train_fn` in the spec (module:function).", file=sys.stderr)
        return 2
    except Exception as exc:
        from jobs.storage import StorageError

        if isinstance(exc, StorageError):
            print(f"raylaunch: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
