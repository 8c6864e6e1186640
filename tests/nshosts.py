"""Hosts with their own addresses on one machine: network namespaces on a bridge (root only).

Shared by the namespace tiers (tests/test_netns.py, tests/test_rayup.py). Everything is made
and removed by name, with names unique to the test session.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

__all__ = ["add_host", "clear_abandoned", "ip", "left_behind", "make_bridge", "remove_host"]


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def make_bridge(bridge: str, address: str | None = None) -> None:
    """The shared segment; with ``address`` (CIDR) the root namespace is on it too."""
    ip("link", "add", bridge, "type", "bridge")
    if address:
        ip("addr", "add", address, "dev", bridge)
    ip("link", "set", bridge, "up")


def add_host(ns: str, address: str, inside: str, outside: str, bridge: str) -> None:
    """Namespace ``ns`` with ``address``/24 on interface ``inside``, its veth peer ``outside`` on the bridge."""
    ip("netns", "add", ns)
    ip("link", "add", outside, "type", "veth", "peer", "name", inside)
    ip("link", "set", inside, "netns", ns)
    ip("link", "set", outside, "master", bridge)
    ip("link", "set", outside, "up")
    ip("-n", ns, "addr", "add", f"{address}/24", "dev", inside)
    ip("-n", ns, "link", "set", inside, "up")
    ip("-n", ns, "link", "set", "lo", "up")


def remove_host(ns: str, outside: str) -> None:
    ip("netns", "del", ns, check=False)  # takes the veth end inside it, and so the pair
    ip("link", "del", outside, check=False)


def left_behind(namespaces: list[str], links: list[str]) -> list[str]:
    """Which of these namespaces and links still exist."""
    names = ip("netns", "list").stdout
    shown = ip("-o", "link", "show").stdout
    return [ns for ns in namespaces if ns in names] + [n for n in links if f" {n}:" in shown or f" {n}@" in shown]


def clear_abandoned(prefix: str) -> list[str]:
    """Remove the namespaces and links an earlier test session of this tier left behind.

    Names are ``<prefix><pid>...`` (the pid of the pytest that made them, modulo 100000). A session
    killed before its teardown (a CI job stopped at its time limit) leaves its bridge routing the
    tier's subnet, and every later run would fail on it. What belongs to a pytest that no longer
    runs is removed, with the processes still inside its namespaces; what a running session owns
    is left alone, and so are names of any other form (a pytest is told by its command line, the
    Makefile's plain ``python -m pytest``, or by its parent's: a pytest-xdist worker, whose own command
    line is execnet's ``python -c``, makes the names of its session). Returns what was removed."""
    own = re.compile(rf"^{re.escape(prefix)}(\d+)(?:-h\d+|br|v\d+|e\d+)$")

    def abandoned(name: str) -> bool:
        match = own.match(name)
        if not match:
            return False
        return not _runs(int(match.group(1)))

    removed: list[str] = []
    for ns in [line.split()[0] for line in ip("netns", "list").stdout.splitlines() if line.strip()]:
        if abandoned(ns):
            for pid in ip("netns", "pids", ns, check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            ip("netns", "del", ns, check=False)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
            removed.append(ns)
    for line in ip("-o", "link", "show").stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if abandoned(name):
            ip("link", "del", name, check=False)
            removed.append(name)
    for pid in {own.match(name).group(1) for name in removed}:
        for folder in Path("/tmp").glob(f"{prefix}{pid}-*"):  # the session's keys, logs and hosts' files
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(str(folder))
    return removed


def _runs(pid: int) -> bool:
    """Whether a pytest, or a pytest-xdist worker (a child of one), with this pid (modulo 100000) still runs."""
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) % 100000 == pid:
            try:
                if b"pytest" in (proc / "cmdline").read_bytes():
                    return True
                status = (proc / "status").read_text()
                parent = next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:"))
                if b"pytest" in (Path("/proc") / parent / "cmdline").read_bytes():
                    return True
            except (OSError, StopIteration):
                pass
    return False
