"""Warm rank hosts (`env.warm_host`, `cluster.hosting.rankhost`) on a real two-node Ray cluster: the ranks of every job
fork from a host that imported torch, Accelerate and transformers once, and each job still sees only its own
environment, secrets and modules; a host is not reused after the packages change, and ends when idle."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import ROOT, TESTS, cli_env, wait_for
from jobs.driver.driver import Driver
from jobs.spec import load_spec_text

SECRET = "RAYLAUNCH_TEST_HOST_SECRET"
PROBE = """
import os, sys
import mymod

def probe(config):
    return {"version": mymod.VERSION, "mark": os.environ.get("MARK"), "secret": os.environ.get("%s") == "the-secret-of-a",
            "host": os.getppid(), "warm": "transformers" in sys.modules, "ray": "ray" in sys.modules}
""" % SECRET


def _project(root: Path, version: str, secret: bool) -> Path:
    root.mkdir(parents=True)
    (root / "mymod.py").write_text(f"VERSION = {version!r}\n")
    (root / "hostprobe.py").write_text(PROBE)
    (root / "job.yaml").write_text(textwrap.dedent(f"""\
        name: job-{version}
        train_fn: hostprobe:probe
        scaling: {{num_nodes: 2, workers_per_node: 1}}
        env: {{vars: {{MARK: mark-{version}}}, secrets: {[SECRET] if secret else []}}}
        """))
    return root


def _launch(root: Path, address: str, storage: Path) -> subprocess.Popen:
    env = {**cli_env(), SECRET: "the-secret-of-a"}
    return subprocess.Popen([sys.executable, "-m", "jobs.cli", "run", "job.yaml", "--address", address,
                             "--storage", str(storage)], cwd=root, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, storage: Path, name: str) -> tuple[dict, dict, str]:
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-3000:]
    result = json.loads((storage / name / "result.json").read_text())
    hosts = {n["node_id"]: n["rank_host_pid"] for n in result["nodes"]}
    return result["rank_results"], hosts, out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"


def test_jobs_one_after_another_and_at_once_share_the_warm_hosts_and_see_only_their_own_environment(
        ray_cluster, tmp_path):
    a = _project(tmp_path / "a", "a", secret=True)
    # run from a copy of raylaunch's checkout: its working directory holds the very `cluster` package the host imported
    shutil.copytree(ROOT / "cluster", a / "cluster", ignore=shutil.ignore_patterns("__pycache__"))
    b = _project(tmp_path / "b", "b", secret=False)
    storage = tmp_path / "runs"
    first, hosts_a, _ = _finish(_launch(a, ray_cluster.address, storage), storage, "job-a")
    second, hosts_b, out_b = _finish(_launch(b, ray_cluster.address, storage), storage, "job-b")
    for seen, version in ((first, "a"), (second, "b")):
        assert sorted(seen) == ["0", "1"]
        for rank in seen.values():
            assert rank["version"] == version and rank["mark"] == f"mark-{version}", rank
            assert rank["secret"] == (version == "a"), rank  # its value is masked in results: compared in the rank
            assert rank["warm"], "a rank forked from a warm host has transformers imported before it imports it"
            assert not rank["ray"], "a rank does not run its actor's main module (Ray's worker) again"
    assert set(hosts_a.values()) == {r["host"] for r in first.values()}  # result.json names the host it forked from
    assert hosts_b == hosts_a, "the second job's ranks fork from the hosts the first one started"
    assert out_b.count("warm rank host") == 2 and "reused" in out_b and "MB resident" in out_b
    # at once: both jobs' ranks fork from the same hosts, each with its own module, variables and secrets
    procs = [_launch(root, ray_cluster.address, tmp_path / "at-once") for root in (a, b)]
    together = {name: _finish(p, tmp_path / "at-once", name) for p, name in zip(procs, ("job-a", "job-b"))}
    for name, (seen, hosts, _) in together.items():
        version = name[-1]
        assert hosts == hosts_a
        assert {(r["version"], r["mark"], r["secret"]) for r in seen.values()} == {
            (version, f"mark-{version}", version == "a")}


SPEC = """
name: {name}
train_fn: tests.fns:probe
scaling: {{num_nodes: 2, workers_per_node: 1}}
storage: {storage}
env: {{vars: {{PYTHONPATH: "{path}"}}, warm_host: {warm}, warm_host_idle_s: {idle}}}
"""


def _run(tmp_path: Path, name: str, site: Path, warm: bool = True, idle: float = 600) -> set[int]:
    """The processes the job's ranks forked from."""
    path = os.pathsep.join([str(ROOT), str(TESTS), str(site)])
    text = SPEC.format(name=name, storage=tmp_path / "runs", path=path, warm=str(warm).lower(), idle=idle)
    out = io.StringIO()
    result = Driver(load_spec_text(text), can_grow=False, out=out).run()
    assert result.status == "succeeded", result.error + out.getvalue()[-3000:]
    nodes = json.loads((tmp_path / "runs" / name / "result.json").read_text())["nodes"]
    parents = {r["ppid"] for r in result.rank_results.values()}
    # what the rank server imported (torch, Accelerate, raylaunch; a warm host transformers too) frozen before the
    # ranks forked: a rank's full collections scan only what it made itself (#58)
    assert all(r["gc_frozen"] > 2 * r["gc_tracked"] for r in result.rank_results.values()), result.rank_results
    assert {n["rank_host_pid"] for n in nodes} == (parents if warm else {None}), out.getvalue()[-4000:]
    return parents


def _host_folders(pids: set[int]) -> set[Path]:
    """The folders of the warm hosts with these pids (``cluster.hosting.rankhost``'s, in this temporary folder)."""
    from cluster.hosting.rankhost import _base

    return {f for f in _base().iterdir() if (f / "pid").is_file() and int((f / "pid").read_text() or 0) in pids}


def test_a_host_is_not_reused_once_its_packages_changed_ends_when_idle_and_can_be_turned_off(ray_cluster, tmp_path):
    site = tmp_path / "site"
    (site / "fakepkg-1.0.dist-info").mkdir(parents=True)  # a package installed where the ranks import from
    first = _run(tmp_path, "before", site)
    folders = _host_folders(first)  # each host's socket, pid, locks and claims
    assert len(folders) == len(first), folders
    (site / "fakepkg-1.0.dist-info").rename(site / "fakepkg-2.0.dist-info")  # pip upgraded it
    second = _run(tmp_path, "after", site, idle=2)
    assert not first & second, "a job after a package changed does not run on the host that imported the old one"
    folders |= _host_folders(second)  # those still there: they end 2 s after the job
    wait_for(lambda: not any(_alive(p) for p in first), 30, "the stale hosts to end")
    wait_for(lambda: not any(_alive(p) for p in second), 30, "the hosts idle for 2 s to end")
    assert [str(f) for f in folders if f.exists()] == []  # a retired host leaves nothing behind (#47)
    own = _run(tmp_path, "own-server", site, warm=False)  # result.json names no host (checked in _run)
    assert not own & (first | second)


def test_a_host_that_never_answers_a_start_fails_that_attempt_only_and_is_replaced(ray_cluster, tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    stopped = min(_run(tmp_path, "warm-up", site))  # a host this spec's ranks fork from
    os.kill(stopped, signal.SIGSTOP)  # hung: its socket still takes the connection, nothing answers
    try:
        path = os.pathsep.join([str(ROOT), str(TESTS), str(site)])
        text = SPEC.format(name="hung", storage=tmp_path / "runs", path=path, warm="true", idle=600) + \
            "timeouts: {rendezvous_s: 15}\nfailure: {max_restarts: 1}\n"
        out = io.StringIO()
        result = Driver(load_spec_text(text), can_grow=False, out=out).run()
    finally:
        try:
            os.kill(stopped, signal.SIGCONT)
        except ProcessLookupError:
            pass
    said = out.getvalue()
    assert result.status == "succeeded", result.error + said[-3000:]
    assert result.attempts == 2, said[-3000:]
    assert f"did not start within timeouts.rendezvous_s (15 s): the warm rank host {stopped} they fork from " \
           "did not answer" in said, said[-3000:]
    assert f"in place of host {stopped}, which left the start" in said, said[-3000:]
    assert not _alive(stopped), "the host that hung was ended"
    nodes = json.loads((tmp_path / "runs" / "hung" / "result.json").read_text())["nodes"]
    assert stopped not in {n["rank_host_pid"] for n in nodes}


def test_hosts_in_another_pid_namespace_are_never_seen(tmp_path):
    """A host's folder names its pid, which means another process in another PID namespace: a process there
    (a node in a namespace of its own, sharing the temporary folder) looks for hosts in a folder of its own."""
    import pytest

    from cluster.hosting.rankhost import _base

    if shutil.which("unshare") is None or os.getuid() != 0:
        pytest.skip("needs root and unshare(1) to make a PID namespace")
    here = str(_base())
    there = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c",
                            "from cluster.hosting.rankhost import _base; print(_base())"], capture_output=True, text=True,
                           timeout=60, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert there.returncode == 0, there.stderr
    theirs = Path(there.stdout.strip())
    theirs.rmdir()  # made by _base, empty
    assert str(theirs) != here and theirs.parent == Path(here).parent


def test_a_job_whose_folder_holds_a_module_the_host_imported_uses_the_host_only_if_its_source_is_the_same(
        tmp_path, monkeypatch):
    """A job's own module of a name the warm host has imported would be shadowed by the host's in a forked rank:
    such a job forks from its actor's own server, unless its module is the host's to the byte (raylaunch's own
    `cluster` package in a job run from raylaunch's checkout)."""
    from cluster.hosting.rankhost import PROJECT_VAR, Claim, ready

    host = tmp_path / "host"
    host.mkdir()
    (host / "ready").write_text(json.dumps({"cluster": str(ROOT / "cluster" / "__init__.py"), "torch": ""}))
    job = tmp_path / "job"
    shutil.copytree(ROOT / "cluster", job / "cluster", ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setenv(PROJECT_VAR, str(job))
    monkeypatch.setattr(sys, "path", [str(job), *sys.path])
    claim = Claim(address=str(host / "sock"), pid=os.getpid(), folder=str(host), note="")
    assert ready(claim) is None
    with open(job / "cluster" / "rank" / "worker.py", "a") as f:
        f.write("# the job's own change\n")
    assert ready(claim) == ("the job's own folders hold modules the warm rank host imported (cluster): "
                            "its ranks import their own instead")
    (job / "cluster" / "rank" / "worker.py").unlink()  # a file fewer is another source too
    shutil.copy(ROOT / "cluster" / "rank" / "worker.py", job / "cluster" / "rank" / "extra.py")
    assert ready(claim) is not None


def test_a_host_started_from_another_layout_of_raylaunch_is_not_reused(tmp_path, monkeypatch):
    """The host key holds raylaunch's code by place as well as bytes: a host started before a module moved folder
    (the #45 move, a release's) is never claimed by the code after it; it is retired as any unclaimed host is."""
    from cluster.hosting import hostproc

    code = tmp_path / "cluster"
    shutil.copytree(ROOT / "cluster", code, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(hostproc, "_RAYLAUNCH", code)
    before = hostproc._code_digest()
    assert hostproc._code_digest() == before
    (code / "rank" / "worker.py").rename(code / "worker.py")  # the same bytes, one folder up
    assert hostproc._code_digest() != before
