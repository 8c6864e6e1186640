"""Connecting to Ray: an existing cluster, or an embedded one of N real nodes on this machine."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import ray

__all__ = ["EMBEDDED_NODE", "UPLOAD_EXCLUDES", "connect", "stop_processes_under"]

# What a job's code upload never needs, besides what .gitignore and .rayignore name
# (used here for `run --address` and by `raylaunch submit`).
UPLOAD_EXCLUDES = [".git", ".venv", "venv", "**/__pycache__", "*.pyc", ".pytest_cache",
                   ".mypy_cache", ".ruff_cache", "raylaunch-local", "runs", "*.egg-info",
                   # secrets: environment files, private keys, cloud and registry credentials, Ray's token
                   ".env", ".env.*", "id_rsa", "id_dsa", "id_ecdsa", "id_ed25519", "*.pem", "*.key", "*.p12",
                   ".aws", ".ssh", ".gnupg", ".netrc", ".pypirc", ".git-credentials", ".docker", ".kube",
                   "gcloud", "application_default_credentials.json", "credentials.json", "auth_token"]

# What an embedded cluster leaves out: nobody can reach its dashboard; no autoscaler
# watches it; and the ranks' output reaches the run through the node actors, not Ray's
# log monitor. Each is a Python process that would compete with the ranks for the cores
# (the log monitor alone used about 1% of a core beside training, in the bench).
EMBEDDED_NODE = {"include_dashboard": False, "no_monitor": True, "include_log_monitor": False}


@contextlib.contextmanager
def connect(address: str | None, local_nodes: int = 1, cpus_per_node: float = 1.0) -> Iterator[bool]:
    """Connect for the length of the block; yields whether the cluster may grow.

    ``address=None`` starts an embedded cluster of ``local_nodes`` real Ray
    nodes (``ray.cluster_utils.Cluster``: one raylet each) and tears it down
    afterwards; it cannot grow, so placement that does not fit fails at once.
    """
    cwd = os.getcwd()
    if address is None:
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": cpus_per_node, **EMBEDDED_NODE})
        try:
            for _ in range(local_nodes - 1):
                cluster.add_node(num_cpus=cpus_per_node, **EMBEDDED_NODE)
            pythonpath = os.pathsep.join(p for p in (cwd, os.environ.get("PYTHONPATH")) if p)
            ray.init(
                address=cluster.address,
                runtime_env={"env_vars": {"PYTHONPATH": pythonpath}},
                log_to_driver=False,
                configure_logging=False,
            )
            yield False
        finally:
            ray.shutdown()
            cluster.shutdown()
        return
    if "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ:
        # Inside a Ray job: the job's runtime environment (its working_dir) is inherited.
        ray.init(address=address, log_to_driver=False, configure_logging=False)
    else:
        ray.init(
            address=address,
            runtime_env={"working_dir": cwd, "excludes": UPLOAD_EXCLUDES},
            log_to_driver=False,
            configure_logging=False,
        )
    try:
        yield True
    finally:
        ray.shutdown()


def stop_processes_under(temp_dir: str, timeout_s: float = 15.0) -> int:
    """End a `ray start --temp-dir=<temp_dir>` cluster by PID; returns how many processes.

    Its daemons name the temp dir on their command line; the workers they
    started are their children. SIGTERM first, SIGKILL for what is left.
    """
    import psutil

    me = psutil.Process()
    spare = {me.pid, *(p.pid for p in me.parents())}  # a caller whose own command line names the dir
    ours = [p for p in psutil.process_iter(["cmdline"])
            if p.pid not in spare and str(temp_dir) in " ".join(p.info["cmdline"] or [])]
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
