"""Soak: many jobs, back to back, on one warm cluster; what stays behind after each (`make soak`).

One cluster started as a user starts theirs (`ray start --head` and a second `ray start` on this machine: two
nodes of 2 CPUs, token authentication, Ray's temporary folders and the nodes' TMPDIR in one ``mkdtemp`` folder of
this run), then ``SOAK_JOBS`` jobs (45 by default, about 15 minutes here) submitted through the Jobs API
(`raylaunch submit --follow`), in a cycle of the kinds a real cluster sees (``KINDS``): the digits example
succeeding, the digits script (`raylaunch submit ... SCRIPT.py`), a function failing in every rank, a rank
SIGKILLed after a commit (restarted, then succeeding), a job stopped (`raylaunch stop`), the driver SIGKILLed and
the job submitted again (resuming), the digits example with an `env.vars` value of its own (a warm rank host made
for it, the previous one retired), the digits example on an object store (moto's S3 server), and a package the
project lacks in `env.pip` (Ray builds its environment once and reuses it; a job with its own Python starts its
ranks from its node actor's fork server, not a warm host). Every job's own outcome is checked (its status and exit
code, committed checkpoints verify, nothing left in ``.staging``).

After every job, on this machine: the bytes raylaunch leaves in the nodes' temporary folder (node actors' scratch,
warm hosts' folders, checkpoint copies) and the bytes of Ray's session folder (Ray's own logs: each job's driver
log is kept by Ray, reported, not judged); the processes under the raylets and raylaunch's own among them (warm
rank hosts, node actors, ranks); the warm hosts' resident memory and open files; the peak resident memory of the
job's driver on the head (result.json's ``driver.peak_rss_mb``; judged against the first job of the same kind).
Writes bench/results-soak.md
(``--out``): a row per job (a row per 10 jobs past 30), and the slope of each figure over the jobs after the first
third; exits 1 when one of raylaunch's figures grows there (disk by more than 1 MiB, processes by one, open files by
8, warm hosts' memory by 5% of its value at the start of that window, a driver's by 5 MB over the first of its
kind) or when a job's outcome is wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from bench.chaos import ObjectStore, dummy_aws_credentials, storage_checks  # noqa: E402
from cluster.nodes.connect import stop_processes_under  # noqa: E402

KINDS = ("ok", "script", "fail", "rank_kill", "stop", "driver_kill", "env", "s3", "pip")
SMALL = ["--set", "config.epochs=1", "--set", "config.train_samples=256", "--set", "scaling.num_nodes=2"]
# The spec a job submits must be in the uploaded folder: the example's, its training function and config replaced.
EXAMPLE = "jobs/examples/digits.yaml"


def steady_args(name: str, pids: Path, steps: int) -> list[str]:
    """tests/fns.py's steady job (a rank's pid in ``pids``): 0.1 s a step, a checkpoint every 10 steps."""
    return [EXAMPLE, "--name", name, "--set", "train_fn=tests.fns:steady", "--set", f"config.steps={steps}",
            "--set", "config.every=10", "--set", "config.step_s=0.1", "--set", f"config.pid_dir={pids}",
            "--set", "scaling.num_nodes=2", "--set", "failure.max_restarts=1"]


def free_ports(n: int) -> list[int]:
    import socket

    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class WarmCluster:
    """Two `ray start` nodes on this machine, stopped by PID at the end."""

    def __init__(self) -> None:
        self.temp = Path(tempfile.mkdtemp(prefix="rl-soak-", dir="/tmp"))  # short: Ray's socket paths
        self.tmpdir = self.temp / "tmp"  # the nodes' TMPDIR: where raylaunch's own temporary folders go
        self.tmpdir.mkdir()
        self.token = secrets.token_hex(16)
        gcs, dash, *agents = free_ports(10)  # GCS, dashboard; 4 agent and metrics ports on each node
        self.env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token, "TMPDIR": str(self.tmpdir),
                    "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                    "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        ray = str(Path(sys.executable).parent / "ray")
        common = ["--num-cpus=2", "--disable-usage-stats", f"--temp-dir={self.temp}"]
        self._start([ray, "start", "--head", f"--port={gcs}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
                     "--include-dashboard=true", f"--dashboard-agent-listen-port={agents[0]}",
                     f"--dashboard-agent-grpc-port={agents[1]}", f"--runtime-env-agent-port={agents[2]}",
                     f"--metrics-export-port={agents[3]}", *common])
        self._start([ray, "start", f"--address=127.0.0.1:{gcs}", f"--dashboard-agent-listen-port={agents[4]}",
                     f"--dashboard-agent-grpc-port={agents[5]}", f"--runtime-env-agent-port={agents[6]}",
                     f"--metrics-export-port={agents[7]}", *common])
        self.address = f"http://127.0.0.1:{dash}"

    def _start(self, cmd: list[str]) -> None:
        done = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=180)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[:3])} failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")

    def raylets(self) -> list[psutil.Process]:
        return [p for p in psutil.process_iter(["cmdline"])
                if (p.info["cmdline"] or [""])[0].endswith("raylet") and str(self.temp) in " ".join(p.info["cmdline"])]

    def ours(self, p: psutil.Process) -> bool:
        """A process this cluster started: its TMPDIR is the nodes' (warm hosts leave the raylets' tree)."""
        try:
            return p.environ().get("TMPDIR") == str(self.tmpdir)
        except psutil.Error:
            return False

    def stop(self) -> None:
        left = [p for p in psutil.process_iter() if self.ours(p) and p.pid != os.getpid()]
        stop_processes_under(str(self.temp))
        for p in left:  # warm rank hosts outlive the raylets' tree by design: ended here by PID
            try:
                p.kill()
            except psutil.Error:
                pass
        shutil.rmtree(self.temp, ignore_errors=True)


def tree_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def sample(cluster: WarmCluster) -> dict:
    """What the cluster holds now, between jobs."""
    under: dict[int, psutil.Process] = {}
    for raylet in cluster.raylets():
        for c in raylet.children(recursive=True):
            under[c.pid] = c
    hosts, actors, ranks = [], [], []
    for p in psutil.process_iter(["cmdline"]):
        line = " ".join(p.info["cmdline"] or [])
        if "cluster.hosting.hostproc" in line and cluster.ours(p):
            hosts.append(p)
            ranks.extend(p.children(recursive=True))
        elif line.startswith("ray::NodeActor") and p.pid in under:
            actors.append(p)

    def rss(ps):
        return sum(_safe(lambda q: q.memory_info().rss, p) for p in ps) / 2**20

    def fds(ps):
        return sum(_safe(lambda q: q.num_fds(), p) for p in ps)

    ray_logs = sum(tree_bytes(s) for s in cluster.temp.glob("session_2*"))
    return {"raylaunch_tmp_mb": round(tree_bytes(cluster.tmpdir) / 2**20, 3),
            "ray_session_mb": round(ray_logs / 2**20, 2),
            "processes_under_raylets": len(under),
            "raylaunch_processes": len(hosts) + len(actors) + len(ranks),
            "warm_hosts": len(hosts), "warm_host_rss_mb": round(rss(hosts), 1), "warm_host_fds": fds(hosts),
            "raylet_rss_mb": round(rss(cluster.raylets()), 1)}


def driver_figures(job: Job, jobs: list[Job]) -> dict:
    """The job's driver on the head (a process per job: a figure that grows is what a driver meets growing, a run
    directory, Ray's state): its peak resident memory, and that less the first of the same kind's (the kinds differ:
    a driver on an object store holds pyarrow's S3 client, 25 MB more), which is what is judged."""
    first = next((j.driver_rss_mb for j in jobs if j.kind == job.kind and j.driver_rss_mb is not None), None)
    if job.driver_rss_mb is None or first is None:
        return {"driver_peak_rss_mb": job.driver_rss_mb or 0.0, "driver_rss_over_kind_mb": 0.0}
    return {"driver_peak_rss_mb": job.driver_rss_mb, "driver_rss_over_kind_mb": round(job.driver_rss_mb - first, 1)}


def _safe(read, p) -> int:
    try:
        return read(p)
    except psutil.Error:
        return 0


@dataclass
class Job:
    index: int
    kind: str
    name: str
    ok: bool = False
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0
    driver_rss_mb: float | None = None  # its driver's peak resident memory (result.json's driver.peak_rss_mb)


class Soak:
    def __init__(self, work: Path, cluster: WarmCluster, store: ObjectStore | None) -> None:
        self.work, self.cluster, self.store = work, cluster, store
        self.storage = work / "runs"

    def _laptop_env(self) -> dict:
        """A laptop's: the cluster's token, not its nodes' TMPDIR, no RAY_ADDRESS (each command gives --address)."""
        return {k: v for k, v in self.cluster.env.items() if k not in ("TMPDIR", "RAY_ADDRESS")}

    def cli(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "jobs.cli", *args], cwd=ROOT, env=self._laptop_env(),
                              capture_output=True, text=True, timeout=timeout)

    def follow(self, *args: str) -> subprocess.Popen:
        with open(self.work / "follow.log", "w") as log:  # the child holds its own copy of the file
            return subprocess.Popen([sys.executable, "-m", "jobs.cli", *args], cwd=ROOT, env=self._laptop_env(),
                                    stdout=log, stderr=subprocess.STDOUT, text=True)

    def submit(self, spec_or_args: list[str], storage: str | None = None) -> subprocess.CompletedProcess:
        return self.cli("submit", *spec_or_args, "--address", self.cluster.address, "--follow",
                        "--storage", storage or str(self.storage))

    def steady(self, job: Job, steps: int = 60) -> list[str]:
        return [*steady_args(job.name, self.work / "pids" / job.name, steps), "--storage", str(self.storage)]

    def run(self, job: Job) -> None:
        began = time.monotonic()
        try:
            getattr(self, f"_{job.kind}")(job)
        except Exception as exc:  # a check that could not be made is a problem of that job
            job.problems.append(f"{type(exc).__name__}: {exc}")
        job.ok = not job.problems
        job.seconds = time.monotonic() - began

    def _expect(self, job: Job, done: subprocess.CompletedProcess, code: int, status: str,
                storage: str | None = None) -> dict:
        if done.returncode != code:
            job.problems.append(f"exit {done.returncode}, expected {code}: {(done.stdout + done.stderr)[-800:]}")
        store = storage or str(self.storage)
        job.problems.extend(storage_checks(store, job.name))
        from jobs.run.storage import RunDir

        result = RunDir(store, job.name).read_result() or {}
        job.driver_rss_mb = (result.get("driver") or {}).get("peak_rss_mb", job.driver_rss_mb)
        if result.get("status") != status:
            job.problems.append(f"status {result.get('status')!r}, expected {status!r}")
        return result

    def _ok(self, job: Job) -> None:
        self._expect(job, self.submit(["jobs/examples/digits.yaml", "--name", job.name, *SMALL]), 0, "succeeded")

    def _env(self, job: Job) -> None:
        done = self.submit(["jobs/examples/digits.yaml", "--name", job.name, *SMALL,
                            "--set", f"env.vars.SOAK_MARK=job-{job.index}"])
        self._expect(job, done, 0, "succeeded")

    def _pip(self, job: Job) -> None:
        """A package the project lacks (`humanize`, from the package index) in `env.pip`: Ray builds its environment
        once and reuses it; the ranks start from the node actor's own fork server (a warm host holds the cluster's
        Python, not the job's). One node of two ranks: the simulated nodes of this machine share one Ray session
        folder, where two nodes building it at once collide."""
        done = self.submit([EXAMPLE, "--name", job.name, "--set", "train_fn=tests.fns:env_probe",
                            "--set", "config.package=humanize", "--set", "env.pip=[humanize]",
                            "--set", "scaling.num_nodes=1", "--set", "scaling.workers_per_node=2"])
        result = self._expect(job, done, 0, "succeeded")
        files = [seen.get("package_file", "") for seen in (result.get("rank_results") or {}).values()]
        if len(files) != 2 or not all("site-packages/humanize" in f and str(ROOT) not in f for f in files):
            job.problems.append(f"humanize not imported from the job's own environment on both ranks: {files}")

    def _s3(self, job: Job) -> None:
        uri = ObjectStore.uri("soak", self.store.port)
        done = self.submit(["jobs/examples/digits.yaml", "--name", job.name, *SMALL], storage=uri)
        self._expect(job, done, 0, "succeeded", storage=uri)

    def _script(self, job: Job) -> None:
        out = self.work / "out" / job.name
        done = self.cli("submit", "--address", self.cluster.address, "--follow", "--storage", str(self.storage),
                        "--name", job.name, "--num_machines", "2", "--num_processes", "2",
                        "train_fn/digits_script.py", "--epochs", "1", "--train_samples", "128",
                        "--checkpointing_steps", "3", "--output_dir", str(out))
        self._expect(job, done, 0, "succeeded")

    def _fail(self, job: Job) -> None:
        self._expect(job, self.submit([EXAMPLE, "--name", job.name, "--set", "train_fn=tests.fns:fail_on_all_ranks",
                                       "--set", "failure.max_restarts=0", "--set", "scaling.num_nodes=2"]), 1, "failed")

    def _wait_commit(self, job: Job, proc: subprocess.Popen, timeout_s: float = 240) -> None:
        latest = self.storage / job.name / "checkpoints" / "latest.json"
        deadline = time.monotonic() + timeout_s
        while not latest.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"no committed checkpoint (the job ended: {proc.poll()}): "
                                   f"{(self.work / 'follow.log').read_text()[-800:]}")
            time.sleep(0.3)

    def _rank_kill(self, job: Job) -> None:
        proc = self.follow("submit", *self.steady(job), "--address", self.cluster.address, "--follow")
        self._wait_commit(job, proc)
        pid = int((self.work / "pids" / job.name / "rank-1.pid").read_text().split()[1])
        os.kill(pid, signal.SIGKILL)
        code = proc.wait(600)
        result = self._expect(job, subprocess.CompletedProcess([], code, (self.work / "follow.log").read_text(), ""),
                              0, "succeeded")
        if result.get("attempts") != 2:
            job.problems.append(f"attempts {result.get('attempts')}, expected 2 (one restart)")

    def _stop(self, job: Job) -> None:
        proc = self.follow("submit", *self.steady(job, steps=100000), "--address", self.cluster.address, "--follow")
        self._wait_commit(job, proc)
        said = (self.work / "follow.log").read_text()
        job_id = said.split("submitted ", 1)[1].split()[0]
        self.cli("stop", job_id, "--address", self.cluster.address)
        code = proc.wait(300)
        self._expect(job, subprocess.CompletedProcess([], code, said, ""), 3, "stopped")

    def _driver_kill(self, job: Job) -> None:
        proc = self.follow("submit", *self.steady(job), "--address", self.cluster.address, "--follow")
        self._wait_commit(job, proc)
        # the job's driver: the entrypoint `python -m jobs.cli run --event-lines ...` (jobs/submit.py)
        drivers = [p for p in psutil.process_iter(["cmdline"])
                   if "--event-lines" in (p.info["cmdline"] or []) and "jobs.cli" in (p.info["cmdline"] or [])]
        if len(drivers) != 1:
            raise RuntimeError(f"expected the job's one driver process, found {len(drivers)}")
        drivers[0].kill()
        proc.wait(300)
        again = self.submit(self.steady(job)[:-2])  # the same name: resumes from its last commit
        result = self._expect(job, again, 0, "succeeded")
        if (result.get("attempts") or 0) < 2:
            job.problems.append(f"attempts {result.get('attempts')}: the rerun did not resume")


def slope(values: list[float]) -> float:
    n = len(values)
    if n < 2:
        return 0.0
    mx, my = (n - 1) / 2, sum(values) / n
    den = sum((i - mx) ** 2 for i in range(n))
    return sum((i - mx) * (v - my) for i, v in enumerate(values)) / den


# figure -> (judged, the growth over the window that fails it: absolute, or relative to the window's first value)
LIMITS = {"raylaunch_tmp_mb": (True, 1.0, None), "raylaunch_processes": (True, 1.0, None),
          "warm_host_fds": (True, 8.0, None), "warm_host_rss_mb": (True, None, 0.05),
          "ray_session_mb": (False, None, None), "processes_under_raylets": (False, None, None),
          "warm_hosts": (True, 1.0, None), "raylet_rss_mb": (False, None, None),
          "driver_peak_rss_mb": (False, None, None), "driver_rss_over_kind_mb": (True, 5.0, None)}
# why a figure that is not judged is there (Ray's own, unless said here)
REPORTED = {"driver_peak_rss_mb": "reported: the kinds differ, judged on the next line"}


def judge(samples: list[dict]) -> tuple[list[str], list[str]]:
    """Lines of the slope table, and the figures that grew."""
    window = samples[len(samples) // 3:]
    lines, grew = [], []
    for key, (judged, absolute, relative) in LIMITS.items():
        values = [s[key] for s in window]
        rise = slope(values) * max(1, len(values) - 1)
        limit = absolute if absolute is not None else (relative * values[0] if relative is not None and values else None)
        bad = judged and limit is not None and rise > limit
        if bad:
            grew.append(f"{key} grew {rise:+.2f} over the last {len(values)} jobs (limit {limit:.2f})")
        verdict = "GROWS" if bad else ("ok" if judged else REPORTED.get(key, "Ray's own, reported"))
        lines.append(f"| {key} | {values[0] if values else '-'} | {values[-1] if values else '-'} | {rise:+.3f} | "
                     f"{f'{limit:.2f}' if limit is not None else '-'} | {verdict} |")
    return lines, grew


def report(jobs: list[Job], samples: list[dict], took_s: float, out: Path) -> int:
    keys = list(LIMITS)
    every = 1 if len(jobs) <= 30 else 10
    rows = [f"| {j.index} | {j.kind} | {'ok' if j.ok else 'WRONG'} | {j.seconds:.0f} | "
            + " | ".join(str(s[k]) for k in keys) + " |"
            for j, s in zip(jobs, samples) if j.index % every == 0 or j.index == len(jobs)]
    slope_lines, grew = judge(samples)
    wrong = [f"job {j.index} ({j.kind}, {j.name}): {'; '.join(j.problems)}" for j in jobs if not j.ok]
    text = "\n".join([
        "# Soak: jobs back to back on one warm cluster (`make soak`)", "",
        f"{len(jobs)} jobs in {took_s / 60:.1f} min on two `ray start` nodes of this machine; kinds in turn: "
        f"{', '.join(KINDS)}. Figures after each job (bench/soak.py says what each is).", "",
        "| job | kind | outcome | s | " + " | ".join(keys) + " |", "|" + "---|" * (4 + len(keys)),
        *rows, "",
        "Over the jobs after the first third: the figure's value at the window's start and end, its rise by the "
        "least-squares slope, and the rise that fails it.", "",
        "| figure | first | last | rise | limit | verdict |", "|---|---|---|---|---|---|", *slope_lines, "",
        "Verdict: " + ("every job's outcome right, nothing of raylaunch's grows" if not grew and not wrong
                       else "; ".join(wrong + grew)), ""])
    out.write_text(text)
    print(text)
    return 0 if not grew and not wrong else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=int(os.environ.get("SOAK_JOBS", "45")))
    parser.add_argument("--out", default=str(ROOT / "bench" / "results-soak.md"))
    args = parser.parse_args()
    dummy_aws_credentials()
    work = Path(tempfile.mkdtemp(prefix="raylaunch-soak-"))
    store = cluster = None
    began = time.monotonic()
    jobs: list[Job] = []
    samples: list[dict] = []
    try:
        store = ObjectStore(work / "moto.log")
        cluster = WarmCluster()
        soak = Soak(work, cluster, store)
        for i in range(1, args.jobs + 1):
            kind = KINDS[(i - 1) % len(KINDS)]
            job = Job(i, kind, f"soak-{i:03d}-{kind.replace('_', '-')}")
            soak.run(job)
            time.sleep(2)  # what a job leaves is gone within moments of its end, or stays: sampled after
            jobs.append(job)
            samples.append({**sample(cluster), **driver_figures(job, jobs)})
            print(f"soak: job {i}/{args.jobs} {kind}: {'ok' if job.ok else 'WRONG: ' + '; '.join(job.problems)} "
                  f"({job.seconds:.0f} s) {json.dumps(samples[-1])}", flush=True)
    finally:
        if cluster is not None:
            cluster.stop()
        if store is not None:
            store.stop()
        shutil.rmtree(work, ignore_errors=True)
    return report(jobs, samples, time.monotonic() - began, Path(args.out))


if __name__ == "__main__":
    sys.exit(main())
