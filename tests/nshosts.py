"""Hosts with their own addresses on one machine: network namespaces on a bridge (root only).

Shared by the namespace tiers (tests/test_netns.py, tests/test_rayup.py). Everything is made
and removed by name, with names unique to the test session.
"""

from __future__ import annotations

import subprocess

__all__ = ["add_host", "ip", "left_behind", "make_bridge", "remove_host"]


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
