"""`ray up cluster.onprem.yaml` for real: hosts reached over SSH, a job submitted through the tunnel.

Each "host" is a network namespace on a bridge (10.78.0.x) with its own PID namespace, its own
``/tmp/ray`` (a private mount) and its own home directory, running its own ``sshd`` bound to its
address: a machine with its own Ray session, as far as Ray can tell. The root namespace plays the
laptop (10.78.0.254): it renders a copy of ``cluster.onprem.yaml`` with the hosts' addresses and a
key made for the test, runs ``ray up``, tunnels the dashboard with ``ray dashboard`` and submits a
job with ``raylaunch submit --follow`` and token authentication. The worker host is not started by
``ray up`` (``min_workers: 0``): Ray's autoscaler on the head starts it over SSH when the job asks
for a second node.

What the rendered copy changes, and why (everything else is the shipped file):
- addresses, SSH user (root, the test's user), key and cluster name: the test's own;
- the first setup command links ``~/raylaunch-venv`` to this checkout's ``.venv`` instead of
  creating it with pip: the hosts have no route to a package index (the second command, which
  puts that environment on every shell's PATH, runs as shipped);
- ``max_workers: 1``: one worker host;
- the worker's ``ray start`` sets ``RAY_gcs_rpc_server_reconnect_timeout_s=10``: ``ray down`` stops the
  head only (the local provider never logs in to a worker), and the worker's raylet ends itself when it
  has not reached the head's GCS for that long (Ray's default, 60 s, was a minute of the suite's time).

The hosts' default route points at their own link, with no gateway: Ray finds its node address by
routing towards a public address (nothing is sent), and nothing can leave the bridge.

Needs root, iproute2, openssh-server, rsync and util-linux's unshare (``.ci/run`` installs them);
skips with the reason otherwise. Everything is removed at the end: ``ray down``, then the hosts'
PID namespaces (killing a namespace's first process ends every process in it), then namespaces,
links and files by name; the fixture checks that nothing is left.
"""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from getpass import getuser
from pathlib import Path

import psutil
import pytest
import yaml

from conftest import ROOT, cli_env, free_ports
from nshosts import add_host, clear_abandoned, ip, left_behind, make_bridge, remove_host

TAG = f"ru{os.getpid() % 100000}"  # interface names <= 15 characters
NET = "10.78.0"
LAPTOP = f"{NET}.254"
HEAD, WORKER = f"{NET}.1", f"{NET}.2"
HOSTS = {HEAD: f"{TAG}-h1", WORKER: f"{TAG}-h2"}  # address -> namespace
BRIDGE = f"{TAG}br"
CLUSTER = f"raylaunch-test-{TAG}"
BIN = Path(sys.executable).parent
WORKER_GCS_TIMEOUT_S = 10  # how long the worker's raylet outlives the head's GCS (see the module doc)


def _why_not() -> str | None:
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "needs root to create network namespaces and run sshd"
    for tool, package in (("ip", "iproute2"), ("sshd", "openssh-server"), ("ssh", "openssh-client"),
                          ("rsync", "rsync"), ("unshare", "util-linux")):
        if shutil.which(tool, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") is None:
            return f"needs {tool} (Debian package {package}; `.ci/run` installs it)"
    return None


# ray up, an autoscaled worker and ray down take a few minutes on 2 busy cores; the fixture counts
# towards the first test's time.
pytestmark = [pytest.mark.skipif(_why_not() is not None, reason=_why_not() or ""), pytest.mark.timeout(900)]


def _veth(addr: str) -> tuple[str, str]:
    """The interface inside a host and its end on the bridge."""
    n = addr.rsplit(".", 1)[1]
    return f"{TAG}e{n}", f"{TAG}v{n}"


def _sshd_config(root: Path, addr: str) -> Path:
    home = root / HOSTS[addr] / "home"
    home.mkdir(parents=True, mode=0o700)
    (root / HOSTS[addr] / "tmp-ray").mkdir()
    config = root / HOSTS[addr] / "sshd_config"
    config.write_text("\n".join([
        f"ListenAddress {addr}:22",
        f"HostKey {root / 'host_key'}",
        f"PidFile {root / HOSTS[addr] / 'sshd.pid'}",
        f"AuthorizedKeysFile {root / 'authorized_keys'}",
        "StrictModes no", "UsePAM no", "PasswordAuthentication no",
        "PermitRootLogin prohibit-password",
        "SetEnv RAY_USAGE_STATS_ENABLED=0",
        "",
    ]))
    return config


def _start_host(root: Path, addr: str) -> subprocess.Popen:
    """sshd in the host's network namespace, as the first process of a PID namespace of its own
    (``--kill-child``: killing unshare kills sshd, and with it every process of that namespace,
    Ray's included), with mounts of its own: /tmp/ray and the user's home are the host's folders.
    The Python this test runs and this checkout stay visible in the home when they lie under it."""
    ns = HOSTS[addr]
    config = _sshd_config(root, addr)
    home, real = root / ns / "home", Path(pwd.getpwuid(os.getuid()).pw_dir)
    mounts = [f"mount --bind {root / ns / 'tmp-ray'} /tmp/ray"]
    for keep in {Path(sys.base_prefix).resolve(), ROOT}:
        if keep.is_relative_to(real):
            (home / keep.relative_to(real)).mkdir(parents=True, exist_ok=True)
            mounts.append(f"mount --bind {keep} {home / keep.relative_to(real)}")
    mounts.append(f"mount --rbind {home} {real}")
    script = " && ".join(mounts) + f" && exec {shutil.which('sshd', path='/usr/sbin:/sbin:' + os.environ['PATH'])} -D -e -f {config}"
    log = open(root / ns / "sshd.log", "w")
    return subprocess.Popen(["ip", "netns", "exec", ns, "unshare", "--pid", "--fork", "--kill-child",
                             "--mount-proc", "sh", "-c", script], stdout=log, stderr=subprocess.STDOUT)


def _make_network() -> None:
    make_bridge(BRIDGE, f"{LAPTOP}/24")
    for addr, ns in HOSTS.items():
        inside, outside = _veth(addr)
        add_host(ns, addr, inside, outside, BRIDGE)
        ip("-n", ns, "route", "add", "default", "dev", inside)  # on-link, no gateway: nothing leaves


def _remove_network() -> list[str]:
    for addr, ns in HOSTS.items():
        remove_host(ns, _veth(addr)[1])
    ip("link", "del", BRIDGE, check=False)
    return left_behind(list(HOSTS.values()), [BRIDGE, *(_veth(a)[1] for a in HOSTS)])


def _ours(root: Path, pid_namespaces: set[str]) -> list[int]:
    """Processes this module started: inside the hosts' PID namespaces, or naming its folder."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        if p.info["status"] == psutil.STATUS_ZOMBIE:  # ended; only its parent's bookkeeping is left
            continue
        try:
            ns = os.readlink(f"/proc/{p.pid}/ns/pid")
        except OSError:
            ns = ""
        if p.pid != os.getpid() and (ns in pid_namespaces or str(root) in " ".join(p.info["cmdline"] or [])):
            found.append(p.pid)
    return found


def _described(pids: list[int]) -> list[str]:
    found = []
    for pid in pids:
        try:
            found.append(f"{pid}: {' '.join(psutil.Process(pid).cmdline())[:150]}")
        except psutil.Error:  # ended meanwhile
            pass
    return found


def _ray_daemons(root: Path, pid_namespaces: set[str]) -> list[str]:
    return [p for p in _described(_ours(root, pid_namespaces)) if "raylet" in p or "gcs_server" in p]


def _wait_for_port(addr: str, port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((addr, port), timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _render(root: Path) -> Path:
    """cluster.onprem.yaml with this test's hosts, user, key and environment (see the module doc)."""
    config = yaml.safe_load((ROOT / "cluster.onprem.yaml").read_text())
    config["cluster_name"] = CLUSTER
    config["provider"].update(head_ip=HEAD, worker_ips=[WORKER])
    config["auth"] = {"ssh_user": getuser(), "ssh_private_key": str(root / "key")}
    config["max_workers"] = 1
    assert config["setup_commands"][0].startswith("python3 -m venv ~/raylaunch-venv")
    config["setup_commands"][0] = f"ln -sfn {ROOT / '.venv'} ~/raylaunch-venv"
    start = config["worker_start_ray_commands"]
    assert start[-1].count(" ray start ") == 1, start
    timeout = f"RAY_gcs_rpc_server_reconnect_timeout_s={WORKER_GCS_TIMEOUT_S}"
    start[-1] = start[-1].replace(" ray start ", f" {timeout} ray start ")
    path = root / "cluster.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def cluster():
    root = Path(tempfile.mkdtemp(prefix=f"{TAG}-", dir="/tmp"))  # short: SSH's control sockets live under it
    laptop = root / "laptop"
    (laptop / "tmp").mkdir(parents=True)
    env = cli_env()
    for key in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE"):
        env.pop(key, None)
    # The laptop: its own home (its ~/.ray/auth_token) and temp folder (ray up's cluster state).
    env.update(HOME=str(laptop), TMPDIR=str(laptop / "tmp"), RAY_USAGE_STATS_ENABLED="0",
               PATH=f"{BIN}{os.pathsep}{env['PATH']}")
    hosts: list[subprocess.Popen] = []
    pid_namespaces: set[str] = set()
    config = None
    log = open(root / "ray-up.log", "w+")
    try:
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / "key")], check=True)
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / "host_key")], check=True)
        shutil.copy(root / "key.pub", root / "authorized_keys")
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation folder
        Path("/tmp/ray").mkdir(exist_ok=True)  # the mount point of each host's own /tmp/ray
        clear_abandoned("ru")  # a killed earlier session's bridge would still route NET
        if f"{NET}.0/24" in ip("route").stdout:
            pytest.fail(f"{NET}.0/24 is already routed on this machine (another test session running?)")
        try:
            _make_network()
        except RuntimeError as exc:
            pytest.skip(f"cannot make network namespaces here: {exc}")
        for addr in HOSTS:
            hosts.append(_start_host(root, addr))
        for addr in HOSTS:
            _wait_for_port(addr, 22, timeout=30)
        for proc in hosts:  # the PID namespace of each host's sshd (the child of unshare)
            child = psutil.Process(proc.pid).children(recursive=True)[-1]
            pid_namespaces.add(os.readlink(f"/proc/{child.pid}/ns/pid"))
        token = subprocess.run([str(BIN / "ray"), "get-auth-token", "--generate"], env=env, capture_output=True,
                               text=True, timeout=60)
        assert token.returncode == 0 and (laptop / ".ray" / "auth_token").exists(), token.stderr
        config = _render(root)
        up = subprocess.run([str(BIN / "ray"), "up", "-y", "--no-config-cache", str(config)], env=env, cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT, text=True, timeout=420)
        log.seek(0)
        assert up.returncode == 0, log.read()[-5000:]
        (port,) = free_ports(1)
        tunnel = subprocess.Popen([str(BIN / "ray"), "dashboard", "-p", str(port), "--no-config-cache", str(config)],
                                  env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            _wait_for_port("127.0.0.1", port, timeout=60)
            yield {"root": root, "env": env, "address": f"http://127.0.0.1:{port}", "config": config,
                   "token": token.stdout.strip().splitlines()[-1]}
        finally:
            os.killpg(tunnel.pid, signal.SIGTERM)
            tunnel.wait(timeout=30)
    finally:
        problems = _tear_down(root, config, env, log, hosts, pid_namespaces)
        assert not problems, "\n".join(problems)


def _tear_down(root: Path, config: Path | None, env: dict, log, hosts: list[subprocess.Popen],
               pid_namespaces: set[str]) -> list[str]:
    """`ray down`, then the hosts, their processes, the network and the files, each step even when
    an earlier one failed; what went wrong, for the fixture to report."""
    problems = []
    try:
        if config is not None:
            down = subprocess.run([str(BIN / "ray"), "down", "-y", str(config)], env=env, cwd=ROOT, stdout=log,
                                  stderr=subprocess.STDOUT, text=True, timeout=180)
            # What `ray down` left running on the hosts, before their namespaces go. It runs `ray stop`
            # on the head only (with the local provider it never logs in to a worker); a worker's raylet
            # gives up on the head's GCS and ends itself WORKER_GCS_TIMEOUT_S later.
            deadline = time.monotonic() + 150
            while (left := _ray_daemons(root, pid_namespaces)) and time.monotonic() < deadline:
                time.sleep(1)
            if down.returncode != 0 or left:
                log.seek(0)
                problems.append(f"ray down exited {down.returncode} and left {left}: {log.read()[-3000:]}")
    finally:
        for proc in hosts:
            proc.kill()
            proc.wait(timeout=30)
        for pid in _ours(root, pid_namespaces):  # SSH control masters the laptop's ray commands left
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.5)
        if alive := _described(_ours(root, pid_namespaces)):
            problems.append(f"processes left behind: {alive}")
        if left_links := _remove_network():
            problems.append(f"namespaces or links left behind: {left_links}")
        control = Path("/tmp") / f"ray_ssh_{hashlib.sha256(getuser().encode()).hexdigest()[:10]}" / \
            hashlib.sha256(CLUSTER.encode()).hexdigest()[:10]
        shutil.rmtree(control, ignore_errors=True)
        log.close()
        shutil.rmtree(root, ignore_errors=True)
    return problems


def raylaunch(cluster, *args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jobs.cli", *args], env=env or cluster["env"], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def in_host(addr: str, *cmd: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", "netns", "exec", HOSTS[addr], *cmd], env=env, capture_output=True, text=True,
                          timeout=60)


def test_a_job_submitted_through_the_tunnel_waits_for_the_autoscaler_then_runs_on_both_hosts(cluster):
    """Only the head is up; the job asks for 2 nodes; Ray's autoscaler starts the worker over SSH."""
    storage = cluster["root"] / "runs"  # one folder both hosts see: the NFS export of a real cluster
    env = {**cluster["env"], "RAY_AUTH_MODE": "token"}
    proc = raylaunch(cluster, "submit", "jobs/examples/digits.yaml", "--address", cluster["address"], "--follow",
                     "--storage", str(storage), "--name", "probe", "--set", "train_fn=tests.fns:probe",
                     "--set", "scaling.num_nodes=2", "--set", "scaling.workers_per_node=1",
                     "--set", "timeouts.placement_s=300", env=env, timeout=480)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    out = proc.stdout + proc.stderr
    # only the head was up when the job asked; visible while the autoscaler started the worker host
    assert "raylaunch: waiting for 2 nodes with {'CPU': 1.0}; 1 can hold one now" in out, out[-3000:]
    result = json.loads((storage / "probe" / "result.json").read_text())
    assert result["status"] == "succeeded"
    nodes = {n["node_rank"]: n["ip"] for n in result["nodes"]}
    assert set(nodes.values()) == {HEAD, WORKER}  # one node on each host, by its own address
    assert len(result["rank_results"]) == 2
    for rank, seen in result["rank_results"].items():
        assert seen["num_processes"] == 2 and seen["sum_of_ranks"] == 1.0  # an all-reduce across the hosts
        assert seen["env"]["MASTER_ADDR"] == nodes[0]  # both met at node 0's address
        assert seen["env"]["GLOO_SOCKET_IFNAME"] == _veth(nodes[int(rank)])[0]  # each its own host's link
        assert seen["env"]["OMP_NUM_THREADS"] == "1"


def test_a_client_without_the_token_is_refused(cluster):
    for env, why in (({**cluster["env"]}, "no RAY_AUTH_MODE"),
                     ({**cluster["env"], "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 32}, "a wrong token")):
        proc = raylaunch(cluster, "list", "--address", cluster["address"], env=env, timeout=120)
        assert proc.returncode != 0, (why, proc.stdout)
        assert "token" in proc.stderr and "Traceback" not in proc.stderr, (why, proc.stderr[-2000:])
    ok = raylaunch(cluster, "list", "--address", cluster["address"],
                   env={**cluster["env"], "RAY_AUTH_MODE": "token"}, timeout=120)
    assert ok.returncode == 0, ok.stderr[-2000:]


def test_the_dashboard_is_reachable_only_on_the_head_itself(cluster):
    probe = ("import socket,sys\n"
             "try:\n socket.create_connection((sys.argv[1], 8265), timeout=5); print('open')\n"
             "except OSError as e: print('closed', e)\n")
    for addr in HOSTS:  # from the other host, and from the head's own network address
        seen = in_host(addr, sys.executable, "-c", probe, HEAD, env=cluster["env"])
        assert seen.stdout.startswith("closed"), (addr, seen.stdout, seen.stderr)
    with pytest.raises(OSError):  # from the laptop, other than through the tunnel
        socket.create_connection((HEAD, 8265), timeout=5).close()
    seen = in_host(HEAD, sys.executable, "-c", probe, "127.0.0.1", env=cluster["env"])
    assert seen.stdout.startswith("open"), seen.stdout  # it runs: on the head's loopback
