"""Connecting to Ray: an existing cluster, or an embedded one of N real nodes on this machine."""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import threading
from typing import Any, Callable, Iterator

import ray

from cluster import patches
from cluster.errors import RaylaunchError
from cluster.hosting.rankhost import PROJECT_VAR
from cluster.nodes.upload import RUNNER_ROOT, UPLOAD_EXCLUDES, UploadPlan, plan_upload

# UPLOAD_EXCLUDES is defined in cluster.nodes.upload; it stays importable from here.
__all__ = ["EMBEDDED_NODE", "GPUS_VAR", "UPLOAD_EXCLUDES", "AuthTokenMissing", "check_auth_token", "connect",
           "divide_gpus", "embedded_node", "holds_embedded_cluster", "job_workdir", "machine_gpus", "node_environment", "stop_processes_under"]

# How many of this machine's GPUs an embedded cluster declares, instead of what ``machine_gpus`` finds: 0 keeps a
# `raylaunch run` without --address on the CPUs of a machine with GPUs; tests set it to model a machine with GPUs.
GPUS_VAR = "RAYLAUNCH_LOCAL_GPUS"
# Set (not 0): an embedded cluster's Ray session folder is kept when the command ends (as --keep-temp does).
KEEP_TEMP_VAR = "RAYLAUNCH_KEEP_TEMP"


_node_environment: dict[str, str] = {}  # while ``connect`` holds an embedded cluster: ``node_environment``


def node_environment() -> dict[str, str]:
    """What the node actors of the embedded cluster ``connect`` started set on themselves as they start (the search
    path with the project, the project's folder); empty on any other cluster. An argument
    of the actor rather than Ray's ``env_vars`` runtime environment: with one, an actor cannot use the worker
    processes its node started ahead (a worker of its own starts, 1-2 s of a cold start on 2 cores, while the
    others idle)."""
    return dict(_node_environment)


class AuthTokenMissing(RaylaunchError, RuntimeError):
    """RAY_AUTH_MODE=token is set and no token is where Ray looks for one."""


def check_auth_token() -> None:
    """With ``RAY_AUTH_MODE=token``, a token must be where Ray looks: say so before connecting.

    Ray looks in ``RAY_AUTH_TOKEN``, then the file ``RAY_AUTH_TOKEN_PATH`` names, then
    ``~/.ray/auth_token``; without one, the cluster's refusal reads like a dead address.
    """
    if os.environ.get("RAY_AUTH_MODE", "").strip().lower() != "token":
        return
    if os.environ.get("RAY_AUTH_TOKEN", "").strip():
        return
    named = os.environ.get("RAY_AUTH_TOKEN_PATH")
    path = os.path.expanduser(named) if named else os.path.join(os.path.expanduser("~"), ".ray", "auth_token")
    try:
        with open(path) as f:
            if f.read().strip():
                return
    except OSError:
        pass
    where = f"RAY_AUTH_TOKEN_PATH ({path})" if named else f"{path}"
    raise AuthTokenMissing(
        f"RAY_AUTH_MODE=token is set but no token was found: RAY_AUTH_TOKEN is empty and {where} "
        "does not exist or is empty. Put the cluster's token there (`ray get-auth-token` on the head "
        "prints it) or set RAY_AUTH_TOKEN; unset RAY_AUTH_MODE for a cluster without token authentication."
    )

# What an embedded cluster leaves out: nobody can reach its dashboard; no autoscaler
# watches it; and the ranks' output reaches the run through the node actors, not Ray's
# log monitor. Each is a Python process that would compete with the ranks for the cores
# (the log monitor alone used about 1% of a core beside training, in the bench).
EMBEDDED_NODE = {"include_dashboard": False, "no_monitor": True, "include_log_monitor": False}
_nodes_started = itertools.count()


def embedded_node(**args: object) -> dict[str, object]:
    """``ray.cluster_utils.Cluster`` node arguments: ``EMBEDDED_NODE`` and a runtime-environment folder of the node's
    own. The nodes of one machine share one session folder; with one runtime-environment folder between them, one
    node's agent unpacking a job's package again (Ray unpacks over what is there) or removing it pulled the folder
    from under another node's workers ("Local directory ... does not exist on the cluster"), which a real node,
    with a disk of its own, never meets."""
    name = f"runtime_resources_{os.getpid()}_{next(_nodes_started)}"
    return {**EMBEDDED_NODE, "runtime_env_dir_name": name, **args}


@contextlib.contextmanager
def _head_without_api_server() -> Iterator[None]:
    """An embedded head without Ray's API server (``dashboard.py``): Ray starts it even with the dashboard left out
    (for its usage statistics) and waits until it answers, about 1.5 s of a cold start on this project's 2-core
    machine, and a Python process that then idles beside the ranks. Nothing of an embedded run uses it: no job is
    submitted to it, no dashboard is reachable."""
    import ray._private.node

    with patches.scoped(ray._private.node.Node, "start_api_server", lambda self, **kwargs: None,
                        "ray._private.node.Node.start_api_server"):
        yield


@contextlib.contextmanager
def _minimal_agents() -> Iterator[None]:
    """The embedded nodes' dashboard agents load only their minimal modules, as with Ray installed without its
    dashboard: no metrics export, job or reporter server, which nothing of an embedded run reaches (2.2 s of a
    core at each node's start on this project's 2-core machine, competing with the start itself). Ray decides by
    whether the dashboard's optional packages import, in the process that starts the node."""
    with patches.scoped(ray._private.utils, "get_dashboard_dependency_error",
                        lambda: ImportError("left out: an embedded raylaunch cluster"),
                        "ray._private.utils.get_dashboard_dependency_error"):
        yield


@contextlib.contextmanager
def _sigterm_handlers_from_the_main_thread_only() -> Iterator[None]:
    """A Ray node sets the process's SIGTERM handler as it starts, which only the main thread may do: for the nodes
    ``connect`` adds from a thread, that step is left out. The handler that stays is the head's, set from the main
    thread (a SIGTERM ends the head's processes, then the exit ends every node's); the CLI sets its own after
    connecting anyway."""
    real = ray._private.utils.set_sigterm_handler

    def from_main_thread(sigterm_handler: Callable) -> None:
        if threading.current_thread() is threading.main_thread():
            real(sigterm_handler)

    with patches.scoped(ray._private.utils, "set_sigterm_handler", from_main_thread,
                        "ray._private.utils.set_sigterm_handler"):
        yield


def _add_nodes_beside(cluster: Any, nodes: list[dict[str, object]], release: threading.Event) -> Callable[[], None]:
    """Start adding ``nodes`` (each one's arguments) to ``cluster`` from a thread of their own; the call returned waits until they are
    started (not yet registered) and raises what adding them raised. The thread then lives until ``release``: Ray
    starts a node's processes to die with the thread that started them (``PR_SET_PDEATHSIG``), so a thread that
    ended would take its nodes with it."""
    failed: list[BaseException] = []
    started = threading.Event()

    def add() -> None:
        try:
            for args in nodes:
                cluster.add_node(wait=False, **args)
        except BaseException as exc:  # raised on the connecting thread
            failed.append(exc)
        finally:
            started.set()
        release.wait()

    threading.Thread(target=add, name="raylaunch-nodes", daemon=True).start()

    def wait() -> None:
        started.wait()
        if failed:
            raise failed[0]

    return wait


def machine_gpus(*, override: bool = True) -> list[str]:
    """The GPUs this machine gives a cluster started here, as ``CUDA_VISIBLE_DEVICES`` names them.

    ``CUDA_VISIBLE_DEVICES`` where it is set (as Ray's own ``ray start`` respects it); otherwise every GPU
    ``nvidia-smi -L`` lists (the driver's tool: no torch on this side, and none where no NVIDIA driver is).
    ``RAYLAUNCH_LOCAL_GPUS=<n>`` overrides the count (the first n of those ids, or 0..n-1) unless ``override`` is
    false (what the machine really has).
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        found = [] if visible.strip() in ("", "NoDevFiles") else [v.strip() for v in visible.split(",") if v.strip()]
    else:
        import shutil
        import subprocess

        smi = shutil.which("nvidia-smi")
        found = []
        if smi:
            try:
                out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20).stdout
            except (OSError, subprocess.SubprocessError):
                out = ""
            found = [str(i) for i, line in enumerate(l for l in out.splitlines() if l.startswith("GPU "))]
    given = os.environ.get(GPUS_VAR, "").strip() if override else ""
    if given:
        try:
            n = int(given)
            if n < 0:
                raise ValueError
        except ValueError:
            raise RaylaunchError(f"{GPUS_VAR}={given!r}: give a whole number of GPUs (0 keeps an embedded "
                                 "cluster on the CPUs)") from None
        found = found[:n] if len(found) >= n else [str(i) for i in range(n)]
    return found


def divide_gpus(gpus: list[str], nodes: int) -> list[list[str]]:
    """``gpus`` divided over ``nodes`` local nodes, as evenly as they go, the first nodes taking any remainder; with
    fewer GPUs than nodes, the first nodes get one each and the rest none.

    >>> divide_gpus(["0", "1", "2"], 2), divide_gpus(["0"], 2), divide_gpus([], 2)
    ([['0', '1'], ['2']], [['0'], []], [[], []])
    """
    base, extra = divmod(len(gpus), nodes)
    out, at = [], 0
    for i in range(nodes):
        take = base + (1 if i < extra else 0)
        out.append(gpus[at:at + take])
        at += take
    return out


def describe_division(gpus: list[str], slices: list[list[str]]) -> str:
    """One line: which of this machine's GPUs each local node declares."""
    where = "CUDA_VISIBLE_DEVICES" if "CUDA_VISIBLE_DEVICES" in os.environ else "nvidia-smi"
    if os.environ.get(GPUS_VAR, "").strip():
        where = GPUS_VAR
    nodes = "; ".join(f"node {i}: " + (f"GPU {','.join(s)}" if s else "no GPU") for i, s in enumerate(slices))
    uneven = len({len(s) for s in slices}) > 1
    return (f"raylaunch: this machine's {len(gpus)} GPU(s) ({where}) over {len(slices)} local node(s): {nodes}"
            + (" (uneven: scaling.workers_per_node: auto takes what every node has)" if uneven else ""))


def _node_gpus(gpu_slice: list[str], has_gpus: bool) -> dict[str, object]:
    """A local node's GPU arguments: its share, and the devices its raylet (and so its workers) may see."""
    if not has_gpus:
        return {"num_gpus": 0}
    return {"num_gpus": len(gpu_slice), "env_vars": {"CUDA_VISIBLE_DEVICES": ",".join(gpu_slice)}}


_embedded: list[bool] = []  # while ``connect`` holds an embedded cluster: [True]


def holds_embedded_cluster() -> bool:
    """Whether ``connect`` holds an embedded cluster (started on this machine) now."""
    return bool(_embedded)


@contextlib.contextmanager
def connect(address: str | None, local_nodes: int = 1, cpus_per_node: float = 1.0,
            upload: UploadPlan | None = None, gpus: list[str] | None = None,
            say: Callable[[str], None] = print, keep_temp: bool = False) -> Iterator[bool]:
    """Connect for the length of the block; yields whether the cluster may grow.

    ``address=None`` starts an embedded cluster of ``local_nodes`` real Ray
    nodes (``ray.cluster_utils.Cluster``: one raylet each) and tears it down
    afterwards; it cannot grow, so placement that does not fit fails at once. Its nodes declare this machine's
    GPUs (``gpus``, by default ``machine_gpus()``), divided over them (``divide_gpus``; said through ``say``).
    Its Ray session folder (``/tmp/ray/session_*``: Ray's logs, 0.2-0.3 MB and more with logs, one per command)
    is removed when the block ends, unless ``keep_temp`` or ``RAYLAUNCH_KEEP_TEMP=1`` (said: where it stays).
    With an address, the working directory is uploaded as ``upload`` plans it
    (planned here from the current folder when not given), after its size check.
    """
    cwd = os.getcwd()
    if address is None:
        from ray.cluster_utils import Cluster

        pythonpath = os.pathsep.join(p for p in (str(RUNNER_ROOT), cwd, os.environ.get("PYTHONPATH")) if p)
        node_env = {"PYTHONPATH": pythonpath, PROJECT_VAR: cwd}
        gpus = machine_gpus() if gpus is None else gpus
        slices = divide_gpus(gpus, local_nodes)
        if gpus:
            say(describe_division(gpus, slices))
        with _minimal_agents(), _head_without_api_server():
            cluster = Cluster(initialize_head=True, head_node_args=embedded_node(
                num_cpus=cpus_per_node, **_node_gpus(slices[0], bool(gpus))))
        release = threading.Event()
        try:
            # The other nodes start while this process connects, from a thread, and have all registered before the
            # reservation (``wait_for_nodes`` below). A 2-node cluster on 2 cores, command to a task on each node,
            # alternating, 5 each: 9.3 s (8.6-10.6) adding them first on this thread, 8.1 s (7.9-9.2) from the other.
            with _minimal_agents(), _sigterm_handlers_from_the_main_thread_only():
                added = _add_nodes_beside(cluster, [embedded_node(num_cpus=cpus_per_node, **_node_gpus(s, bool(gpus)))
                                                    for s in slices[1:]], release)
                # ray.init puts the driver's current folder first on every worker's sys.path: connect from the
                # runner's folder, so a worker imports the runner's own packages (a project's own cluster/ or
                # jobs/ folder cannot stand in for them). The node actors then put PYTHONPATH (the runner's
                # folder, the project's, whose modules the ranks import) next, and go to the project's folder,
                # where their ranks start (``node_environment``; a node added meanwhile may have started its
                # processes in the runner's folder).
                os.chdir(RUNNER_ROOT)
                try:
                    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
                finally:
                    os.chdir(cwd)
                    added()
            cluster.wait_for_nodes(timeout=120)
            _node_environment.update(node_env)
            _embedded[:] = [True]
            yield False
        finally:
            _node_environment.clear()
            _embedded.clear()
            session = cluster.head_node.get_session_dir_path()
            ray.shutdown()
            cluster.shutdown()
            release.set()
            _remove_session(session, keep_temp or os.environ.get(KEEP_TEMP_VAR, "") not in ("", "0"), say)
        return
    if "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ:
        # Inside a Ray job: the job's runtime environment (its working_dir) is inherited.
        ray.init(address=address, log_to_driver=False, configure_logging=False)
    else:
        upload = upload or plan_upload(cwd)
        upload.check()  # before Ray packages anything
        check_auth_token()
        ray.init(
            address=address,
            runtime_env=upload.runtime_env(),
            log_to_driver=False,
            configure_logging=False,
        )
    try:
        yield True
    finally:
        ray.shutdown()


def _remove_session(session: str, keep: bool, say: Callable[[str], None]) -> None:
    """The ended embedded cluster's Ray session folder: removed (and ``session_latest`` if it names it), or said
    to be kept. Left alone, a machine that runs a command a minute gathers thousands (#47)."""
    if keep:
        say(f"raylaunch: the embedded cluster's Ray session folder is kept: {session}")
        return
    shutil.rmtree(session, ignore_errors=True)
    latest = os.path.join(os.path.dirname(session), "session_latest")
    try:
        if os.path.realpath(latest) == os.path.realpath(session) or not os.path.exists(latest):
            os.unlink(latest)
    except OSError:  # gone already, or another command's
        pass


def stop_processes_under(temp_dir: str, timeout_s: float = 15.0) -> int:
    """End a `ray start --temp-dir=<temp_dir>` cluster by PID; returns how many processes.

    Its daemons name the temp dir on their command line; the workers they
    started are their children; the head's Ray Client server (``ray start``
    starts one, which outlives the command as a child of init) names neither,
    only the cluster's GCS address, which the daemons name. SIGTERM first,
    SIGKILL for what is left.
    """
    import psutil

    me = psutil.Process()
    spare = {me.pid, *(p.pid for p in me.parents())}  # a caller whose own command line names the dir
    lines = {p.pid: (p, " ".join(p.info["cmdline"] or [])) for p in psutil.process_iter(["cmdline"])
             if p.pid not in spare}
    ours = [p for p, line in lines.values() if str(temp_dir) in line]
    gcs = {arg.split("=", 1)[1] for _, line in lines.values() if str(temp_dir) in line
           for arg in line.split() if arg.startswith("--gcs-address=")}
    ours += [p for p, line in lines.values() if "ray.util.client.server" in line and str(temp_dir) not in line
             and any(f"--address={address}" in line.split() for address in gcs)]
    procs = {p.pid: p for p in ours}
    for p in ours:
        try:
            procs.update({c.pid: c for c in p.children(recursive=True)})
        except psutil.Error:
            pass
    for p in procs.values():
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(list(procs.values()), timeout=timeout_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    return len(procs)


def job_workdir() -> str | None:
    """Where a script's ranks run: the job's uploaded working directory (their own current folder, as Ray sets
    it: None), or on an embedded cluster, which shares this machine, the folder raylaunch was started from."""
    if (ray.get_runtime_context().runtime_env or {}).get("working_dir"):
        return None
    return os.getcwd()
