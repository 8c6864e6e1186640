"""Submission from a laptop through Ray's Jobs API: plan (pure), then act.

``plan_submit`` checks the spec exactly as ``raylaunch validate`` does, works
out what the working-directory upload will hold, and builds the request; it
sends nothing, which gives ``--dry-run``. ``send`` submits it; ``follow``
shows a live progress bar from the driver's output and returns the job's
exit status.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import re
import secrets
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from cluster.errors import RaylaunchError
from cluster.nodes.connect import AuthTokenMissing, check_auth_token
from cluster.nodes.upload import UploadPlan, plan_upload
from cluster.storage_io import join_uri
from jobs.spec import JobSpec, SpecError, load_spec, spec_to_dict
from jobs.spec.environment import Secrets
from jobs.spec.strategy import read_accelerate_config

__all__ = [
    "JobsError",
    "SubmitRequest",
    "client",
    "follow",
    "job_stacks",
    "plan_submit",
    "send",
]



# How long submit waits for the job agent of a cluster that has just started.
AGENT_WAIT_S = 60.0


class JobsError(RaylaunchError, RuntimeError):
    """A Jobs API problem, with the one line a user needs."""


@dataclass(frozen=True)
class SubmitRequest:
    """Everything ``send`` will do; printing it is ``--dry-run``."""

    address: str
    submission_id: str
    entrypoint: list[str]
    runtime_env: dict
    metadata: dict
    run_dir: str
    upload: UploadPlan
    spec: JobSpec = field(repr=False)
    secrets: Secrets = field(default_factory=Secrets, repr=False)

    def describe(self) -> str:
        lines = [
            f"address:       {self.address}",
            f"submission id: {self.submission_id}",
            f"entrypoint:    {shlex.join(self.entrypoint)}",
            *self.upload.describe(),
            f"run directory: {self.run_dir} (on the cluster's storage)",
        ]
        env = self.spec.env
        if env.vars or env.secrets or env.pip:
            lines.append(f"environment:   vars {', '.join(env.vars) or '-'}; secrets {', '.join(env.secrets) or '-'} "
                         "(values from this shell, in the job's runtime environment, never printed); "
                         f"packages {', '.join(env.requirements) or '-'}")
        return "\n".join(lines)


def plan_submit(
    spec_path: str,
    overrides: list[str],
    address: str,
    cwd: str | Path | None = None,
    literals: dict[str, str] | None = None,
    fresh: bool = False,
) -> SubmitRequest:
    """Check everything locally and build the request; sends nothing.

    ``literals`` are ``--name``/``--storage`` style values, taken as strings as they are; ``fresh``: the driver
    starts a new run directory (``run --fresh``).
    """
    cwd = Path(cwd or os.getcwd()).resolve()
    literals = dict(literals or {})
    spec = load_spec(spec_path, overrides, literals=literals)
    spec_abs = Path(spec_path).resolve()
    try:
        spec_rel = spec_abs.relative_to(cwd)
    except ValueError:
        raise SpecError([f"the spec must be inside the working directory that is uploaded ({cwd}); "
                         "run submit from the project folder"], spec_path) from None
    # An argument list; Ray Jobs takes one string, so it is quoted by shlex, never
    # pasted together from user input.
    # --event-lines: the run's events reach `submit --follow` as lines of the job's log (jobs/run/events.py).
    entrypoint = ["python", "-m", "jobs.cli", "run", "--event-lines", str(spec_rel)]
    for item in overrides:
        entrypoint += ["--set", item]
    for key, value in literals.items():
        entrypoint += [f"--{key}", value]
    return _plan(spec, entrypoint + ["--fresh"] * fresh, address, cwd)


def plan_submit_spec(spec: JobSpec, address: str, cwd: str | Path | None = None,
                     implicit_config: str | None = None, fresh: bool = False) -> SubmitRequest:
    """The request for a spec built where the job is launched (``raylaunch submit`` of a script): the cluster's
    driver runs that spec, sent whole, so it never reads a launch command or a config file of its own.

    ``implicit_config``: the file `accelerate config` saved, which the command read without ``--config_file``;
    outside the project it does not travel, and that is said."""
    cwd = Path(cwd or os.getcwd()).resolve()
    config_file = spec.accelerate.config_file
    if config_file is not None:
        where = Path(config_file).expanduser().resolve()
        try:
            rel = where.relative_to(cwd)
        except ValueError:
            if config_file == implicit_config:
                print(f"raylaunch: {config_file} (saved by `accelerate config`) is on this machine, not in the "
                      "project folder that is uploaded: the job runs without it. To use it on the cluster, copy it "
                      "into the project and pass --config_file", file=sys.stderr, flush=True)
                spec = dataclasses.replace(spec, accelerate=dataclasses.replace(spec.accelerate, config_file=None))
                return plan_submit_spec(spec, address, cwd, fresh=fresh)
            raise SpecError([f"accelerate.config_file: {config_file} is on this machine, outside the project folder "
                             f"that is uploaded ({cwd}), so the cluster would not have it. Copy it into the project "
                             f"(cp {config_file} accelerate_config.yaml) and pass --config_file "
                             "accelerate_config.yaml"], "the launch command") from None
        spec = dataclasses.replace(spec, accelerate=dataclasses.replace(spec.accelerate, config_file=str(rel)))
    entrypoint = ["python", "-m", "jobs.cli", "run", "--event-lines", "--spec-json", json.dumps(spec_to_dict(spec))]
    return _plan(spec, entrypoint + ["--fresh"] * fresh, address, cwd)


def _plan(spec: JobSpec, entrypoint: list[str], address: str, cwd: Path) -> SubmitRequest:
    from cluster.train_function import check_entry

    job_secrets = Secrets.read(spec.env)  # from this shell; a missing one stops here, before anything is sent
    check_entry(spec, base=cwd)
    config_file = spec.accelerate.config_file
    if config_file is None or not Path(config_file).expanduser().is_absolute():
        # a file of the project (uploaded with it): a bad one is refused here, not on the cluster
        read_accelerate_config(spec, base=cwd)
    upload = plan_upload(cwd, storage=spec.storage)
    upload.check()
    submission_id = f"raylaunch-{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    runtime_env = {
        **upload.runtime_env(),
        # Time for the driver to stop every rank and record "stopped" after SIGTERM; the values
        # of env.secrets, which the driver reads from its environment as `raylaunch run` does.
        "env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "30", **job_secrets.values},
    }
    storage = spec.storage
    return SubmitRequest(
        address=address,
        submission_id=submission_id,
        entrypoint=entrypoint,
        runtime_env=runtime_env,
        metadata={"raylaunch_run": spec.name, "raylaunch_storage": storage},
        run_dir=join_uri(storage, spec.name),
        upload=upload,
        spec=spec,
        secrets=job_secrets,
    )


# --- talking to the cluster ----------------------------------------------------------


def client(address: str):
    """A ``JobSubmissionClient``, or a ``JobsError`` that says what to do."""
    from ray.job_submission import JobSubmissionClient

    # Ray's client logs every packaging step at INFO; the laptop wants our lines only.
    for name in ("ray", "ray.dashboard.modules.dashboard_sdk", "ray._private.runtime_env.packaging",
                 "ray._private.runtime_env.working_dir", "ray.dashboard.modules.job.sdk"):
        logging.getLogger(name).setLevel(logging.ERROR)

    try:
        check_auth_token()
    except AuthTokenMissing as exc:
        raise JobsError(str(exc)) from None
    try:
        return JobSubmissionClient(address)
    except Exception as exc:  # connection refused, version mismatch, auth
        raise _translate(exc, address) from None


def _translate(exc: Exception, address: str) -> JobsError:
    """What a Jobs API error means, in words that say what to do. HTTP statuses are whole numbers of the text (a
    port such as 28403 in the address is no 403: a dead address was reported as refused authentication).

    >>> str(_translate(ConnectionError("Failed to connect to http://127.0.0.1:28403"), "http://127.0.0.1:28403"))[:44]
    'no Ray dashboard answers at http://127.0.0.1'
    >>> str(_translate(RuntimeError("Request failed with status code 403"), "http://h:8265"))[:40]
    'the cluster at http://h:8265 requires Ra'
    """
    text = str(exc)
    low = text.lower()
    if "authentication" in low or "unauthenticated" in low or re.search(r"\b40[13]\b", low):
        return JobsError(
            f"the cluster at {address} requires Ray's token authentication and refused this client. "
            "Set RAY_AUTH_MODE=token and put the cluster's token in ~/.ray/auth_token (or RAY_AUTH_TOKEN); "
            "`ray get-auth-token` on the head prints it."
        )
    if "connect" in low or "refused" in low or "timed out" in low or "max retries" in low:
        return JobsError(f"no Ray dashboard answers at {address}. Is the cluster up, and the tunnel open "
                         "(`ray dashboard cluster.yaml`)?")
    if "version" in low:
        return JobsError(f"the cluster at {address} runs another Ray version: {text.splitlines()[0]}")
    if "does not exist" in low or "not found" in low or re.search(r"\b404\b", low):
        return JobsError(text.splitlines()[0] if text else "no such job")
    return JobsError(f"{type(exc).__name__}: {text.splitlines()[0] if text else ''} (address {address})")


def call(fn, address: str, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except JobsError:
        raise
    except Exception as exc:
        raise _translate(exc, address) from None


def send(request: SubmitRequest, jobs=None) -> str:
    """Submit; returns the job id."""
    jobs = jobs or client(request.address)
    deadline = time.monotonic() + AGENT_WAIT_S
    while True:
        try:
            return jobs.submit_job(
                entrypoint=shlex.join(request.entrypoint),
                submission_id=request.submission_id,
                runtime_env=request.runtime_env,
                metadata=request.metadata,
            )
        except Exception as exc:
            # A cluster just started has no job agent for a few seconds.
            if "No available agent" not in str(exc) or time.monotonic() > deadline:
                raise _translate(exc, request.address) from None
            time.sleep(1.0)


# --- following a job ------------------------------------------------------------------

_TERMINAL = {"SUCCEEDED": 0, "FAILED": 1, "STOPPED": 3}


def follow(address: str, job_id: str, out: TextIO = sys.stdout, jobs=None, quiet: bool = False,
           secrets: Secrets | None = None) -> int:
    """Show the job live until it ends; its exit status (0 succeeded, 1 failed, 3 stopped).

    A bar on a terminal, plain lines otherwise (see ``jobs.progress``).
    Ctrl-C detaches and leaves the job running. The driver masks ``env.secrets`` in what it
    prints; ``secrets`` (the values this shell sent) are masked here too.
    """
    secrets = secrets or Secrets()
    from jobs.progress import ProgressView

    jobs = jobs or client(address)
    call(jobs.get_job_status, address, job_id)  # a clear error for a job that does not exist
    progress = ProgressView.for_stream(out, quiet)

    async def tail() -> None:
        async for chunk in jobs.tail_job_logs(job_id):
            progress.write(secrets.mask(chunk))

    try:
        asyncio.run(tail())
    except KeyboardInterrupt:
        progress.close()
        print(f"\nraylaunch: detached; {job_id} is still running.\n"
              f"  follow again: raylaunch logs {job_id} --follow --address {address}\n"
              f"  stop it:      raylaunch stop {job_id} --address {address}", file=out)
        return 130
    finally:
        progress.close()
    status = str(call(jobs.get_job_status, address, job_id)).split(".")[-1]
    deadline = time.monotonic() + 30
    while status not in _TERMINAL and time.monotonic() < deadline:
        time.sleep(0.5)
        status = str(call(jobs.get_job_status, address, job_id)).split(".")[-1]
    print(f"raylaunch: job {job_id} {status.lower()}", file=out)
    return _TERMINAL.get(status, 1)


def job_stacks(address: str, job_id: str, full: bool = False, samples: int = 1, timeout_s: float = 120.0) -> str:
    """``live_stacks`` for a submitted job, from outside the cluster: a short helper job on the
    cluster (with the job's own uploaded code) reads the stacks and prints them."""
    from jobs.driver.hangs import StacksError

    jobs = client(address)
    info = call(jobs.get_job_info, address, job_id)
    meta = info.metadata or {}
    if "raylaunch_run" not in meta:
        raise StacksError(f"job {job_id} was not submitted by raylaunch (its metadata names no run)")
    argv = ["python", "-m", "jobs.cli", "stacks", meta["raylaunch_run"], "--storage", meta["raylaunch_storage"],
            "--samples", str(samples)]
    helper = f"{job_id}-stacks-{secrets.token_hex(2)}"
    env = {k: v for k, v in (info.runtime_env or {}).items() if k in ("working_dir", "py_modules", "env_vars")}
    call(jobs.submit_job, address, entrypoint=shlex.join(argv + (["--full"] if full else [])),
                submission_id=helper, runtime_env=env, metadata={"raylaunch_stacks_of": job_id})
    deadline = time.monotonic() + timeout_s
    while not (status := jobs.get_job_status(helper)).is_terminal():
        if time.monotonic() > deadline:
            jobs.stop_job(helper)
            raise StacksError(f"the helper job {helper} did not finish within {timeout_s:g} s")
        time.sleep(0.5)
    # The helper is not deleted: Ray keeps listing a deleted job's driver, without the metadata
    # by which `raylaunch list` leaves helpers out.
    logs = jobs.get_job_logs(helper).rstrip()
    if str(status).split(".")[-1] != "SUCCEEDED":
        raise StacksError(f"the helper job {helper} that reads the stacks on the cluster failed:\n{logs}")
    return logs
