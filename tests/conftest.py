"""Shared fixtures: one real multi-node Ray cluster per test session."""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))


def dummy_aws_credentials() -> None:
    """Credentials for the S3 server the object-storage tests start (moto), in this process's
    environment: the raylets, and through them the node actors and ranks, inherit it. Real
    nodes use their own credential chain (instance profile, environment)."""
    for key, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                       ("AWS_DEFAULT_REGION", "us-east-1"), ("AWS_EC2_METADATA_DISABLED", "true")):
        os.environ.setdefault(key, value)


@pytest.fixture(scope="session")
def ray_cluster():
    """A head and one more node, each a real raylet with 2 logical CPUs."""
    import ray
    from ray.cluster_utils import Cluster

    from cluster.nodes.connect import embedded_node

    dummy_aws_credentials()  # before the raylets start: they pass their environment on
    # Snapshots in memory (#59) in a folder of the session's own, removed at its end with what lost nodes left there
    snapshots = tempfile.mkdtemp(prefix="raylaunch-test-snapshots-", dir="/dev/shm" if os.path.isdir("/dev/shm")
                                 else None)
    os.environ["RAYLAUNCH_SNAPSHOT_DIR"] = snapshots
    # A runtime environment that cannot be built (env.pip's failing-node test) is tried once, not three times.
    os.environ.setdefault("RUNTIME_ENV_RETRY_TIMES", "1")
    cluster = Cluster(initialize_head=True, head_node_args=embedded_node(num_cpus=2))
    cluster.add_node(**embedded_node(num_cpus=2))
    pythonpath = os.pathsep.join([str(ROOT), str(TESTS)])
    ray.init(address=cluster.address, runtime_env={"env_vars": {"PYTHONPATH": pythonpath}},
             log_to_driver=False, configure_logging=False)
    session_dir = cluster.head_node.get_session_dir_path()
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        # Its logs and what its jobs installed (env.pip's test builds a 2 GB virtualenv there)
        shutil.rmtree(session_dir, ignore_errors=True)
        shutil.rmtree(snapshots, ignore_errors=True)


def free_ports(n: int, consecutive: bool = False) -> list[int]:
    """``n`` ports that bind now, from 20000-31999: below the kernel's ephemeral range
    (32768-60999), where the system would hand them to outgoing connections, and above
    Ray's worker ports (10002-19999)."""
    def free(port: int) -> bool:
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
                return True
            except OSError:
                return False

    for _ in range(500):
        if consecutive:
            first = random.randrange(20000, 32000 - n)
            ports = list(range(first, first + n))
        else:
            ports = random.sample(range(20000, 32000), n)
        if all(free(p) for p in ports):
            return ports
    raise RuntimeError(f"no {n} free ports in 20000-31999")


def our_processes() -> list:
    """This test process's descendants (the shared cluster's raylets, their workers and actors), and the warm rank
    hosts of those raylets with the ranks they forked: a host leaves the actor that started it (its parent is
    init), so it is found by the raylet it is tied to (``cluster.hosting.rankhost``)."""
    import psutil

    mine = psutil.Process().children(recursive=True)
    pids = {str(p.pid) for p in mine}
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        try:
            if "cluster.hosting.hostproc" in cmd and json.loads(cmd[-1])["anchor"].split(".")[0] in pids:
                mine += [p, *p.children(recursive=True)]
        except (ValueError, KeyError, psutil.Error):
            continue
    return mine


def our_stacks() -> str:
    """Every Python stack of ``our_processes`` (the actors, the warm hosts, the ranks), read from outside by
    py-spy: what a test that timed out waiting on the cluster prints, so a hang in CI says where it hung."""
    import psutil

    py_spy = Path(sys.executable).with_name("py-spy")
    out = []
    for p in our_processes():
        try:
            name = " ".join(p.cmdline())[:160]
        except psutil.Error:
            continue
        if "python" not in name and "ray::" not in name:
            continue
        try:
            dump = subprocess.run([str(py_spy), "dump", "--pid", str(p.pid)], capture_output=True, text=True,
                                  timeout=20).stdout
        except (OSError, subprocess.TimeoutExpired) as exc:
            dump = f"(py-spy: {exc})"
        out.append(f"=== {p.pid} {name}\n{dump}")
    return "\n".join(out)


def wait_for(condition, timeout: float, what: str):
    """``condition()``'s first truthy value, checked every 0.1 s; fails after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def committed_step(run_dir: Path) -> int | None:
    """The step ``latest.json`` of a run on a local path names; None before the first commit (or while it is
    replaced)."""
    try:
        return json.loads((run_dir / "checkpoints" / "latest.json").read_text())["step"]
    except (OSError, ValueError, KeyError):
        return None


def interruptible() -> None:
    """For a CLI subprocess a test interrupts: SIGINT as a terminal gives it (Python raises KeyboardInterrupt).
    A shell that starts its jobs in the background hands them SIGINT ignored, and the CLI would inherit that."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def cli_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS), env.get("PYTHONPATH", "")])
    return env


class LoadsRecorded:
    """Stands in for an Accelerator in a rank's ``session.restore``: records the folder it was
    asked to load and the bytes of every file in it at that moment."""

    def __init__(self) -> None:
        self.loaded: list[tuple[str, dict[str, bytes]]] = []

    def load_state(self, path: str) -> None:
        self.loaded.append((path, {p.name: p.read_bytes() for p in Path(path).iterdir() if p.is_file()}))


def rank_session(tmp_path: Path, run, restore_uri: str):
    """A rank's session of attempt 2 of ``run`` (a ``RunDir``), in this process, as the worker
    entry point would make it."""
    from cluster.context import assign_ranks
    from cluster.protocol import WorkerPayload
    from cluster.runtime import Session

    payload = WorkerPayload(context=assign_ranks([1])[0], attempt=2, train_fn="fns:steady", config={},
                            events_path=str(tmp_path / "events" / "rank-0.jsonl"),
                            staging_uri=run.staging_uri(2), restore_uri=restore_uri, backend="gloo")
    return Session(payload)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items) -> None:
    """The chaos tests go last. They SIGKILL drivers that uploaded this folder as their working directory and then
    run the same command again; on one machine every node of the shared cluster keeps its runtime-environment files
    in one session folder, and the killed job's clean-up there can remove the package that the next upload of the
    same folder (the same content, so the same package) is told is already there: a later `raylaunch run
    --address` then failed to start ("Local directory ... does not exist"). Found when test_history's runs
    followed them.

    First of this hook's implementations (tryfirst): xdist's own, on each worker, reads the xdist_group marks to
    name each test's group, and ran before this one, so the marks ``group_module_fixtures`` adds were never seen."""
    items.sort(key=lambda item: item.path.name == "test_chaos.py")
    if config.pluginmanager.hasplugin("xdist"):
        group_module_fixtures(items)


def pytest_configure(config) -> None:
    """`--dist loadgroup` needs pytest below 9.2 with pytest-xdist 3.8: pytest 9.2's structured node ids drop the
    ``@group`` suffix xdist adds for the scheduler (pytest-dev/pytest-xdist#1386), so every xdist_group would be
    ignored without a word and a module-scoped fixture made on both workers, at once."""
    if os.environ.get("PYTEST_XDIST_WORKER") or getattr(config.option, "dist", "no") != "loadgroup":
        return
    import xdist

    if pytest.version_tuple[:2] >= (9, 2) and tuple(int(p) for p in xdist.__version__.split(".")[:2]) <= (3, 8):
        raise pytest.UsageError(f"pytest {pytest.__version__} with pytest-xdist {xdist.__version__} ignores the "
                                "xdist groups (--dist loadgroup): install the test extra, which keeps pytest below 9.2")


def _hosts_folders() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob(f"raylaunch-hosts-{os.getuid()}-*"))


def pytest_sessionstart(session) -> None:
    session.config._hosts_folders_before = _hosts_folders()


def pytest_sessionfinish(session) -> None:
    """The warm hosts' folder of each PID namespace the tests made (``cluster.hosting.rankhost``) goes once empty: the
    namespace is gone, so nothing will use it again. Only on the controller (xdist's workers finish one by one, and
    a folder left empty by one may be about to get a host of the other's)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    for folder in _hosts_folders() - getattr(session.config, "_hosts_folders_before", set()):
        try:
            folder.rmdir()
        except OSError:  # not empty: a host still runs there
            pass


def group_module_fixtures(items) -> None:
    """Under pytest-xdist (`-n 2 --dist loadgroup`, pyproject's addopts) each worker is its own session with its own
    ``ray_cluster``, and the tests are handed out one by one. A test that uses a module-scoped fixture (a module's
    shared runs, its own Ray head, the namespace hosts on their fixed addresses) joins its module's xdist group, so
    that fixture is made once, by one worker, and never twice at once. With ``--dist loadgroup`` the groups start
    first (largest first) and the ungrouped tests follow in collection order, so the chaos tests stay last on each
    worker, that is, last on each cluster."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        defs = info.name2fixturedefs.values() if info is not None else ()
        if any(d and d[-1].scope == "module" for d in defs):
            item.add_marker(pytest.mark.xdist_group(item.path.stem))


@pytest.fixture(autouse=True)
def stacks_before_timeout(request):
    """A test about to reach its timeout prints every stack of ``our_processes`` first (pytest-timeout's own dump
    shows only the test process, which waits on an actor): a hang in CI then says where the cluster hung."""
    import threading

    marker = request.node.get_closest_marker("timeout")
    timeout = float(marker.args[0]) if marker and marker.args else float(request.config.getini("timeout") or 0)
    if timeout <= 0:
        yield
        return

    def dump() -> None:
        sys.stderr.write(f"\n--- {request.node.nodeid}: {timeout * 0.9:.0f} s of {timeout:.0f} s gone; stacks "
                         f"of the cluster's processes ---\n{our_stacks()}\n")
        sys.stderr.flush()

    timer = threading.Timer(timeout * 0.9, dump)
    timer.daemon = True
    timer.start()
    yield
    timer.cancel()


def held_placement_groups() -> dict[str, str]:
    """The shared cluster's placement groups not removed (id -> a line: its name, state and bundles)."""
    import ray

    if not ray.is_initialized():
        return {}
    return {pg_id: f"{info.get('name') or '(no name)'} {info.get('state')} {info.get('bundles')}"
            for pg_id, info in ray.util.placement_group_table().items() if info.get("state") != "REMOVED"}


@pytest.fixture(autouse=True)
def shared_cluster_given_back(request):
    """A test on the shared cluster gives its CPUs back: its jobs' placement groups are gone within 60 s of its end,
    else a warning names the test and what it left (the warnings summary shows it). Both chaos tests of a CI run
    (1c691e0) found their jobs ending before a first step, the last tests on their cluster: what held it was not
    said."""
    yield
    if "ray_cluster" not in request.fixturenames:
        return
    deadline = time.monotonic() + 60
    while (held := held_placement_groups()) and time.monotonic() < deadline:
        time.sleep(0.5)
    if held:
        import warnings

        warnings.warn(f"{request.node.nodeid} left the shared cluster's placement groups held 60 s after its end: "
                      + "; ".join(held.values()), stacklevel=1)
