"""A job's environment where it is launched: secret values, masking them, checking packages.

A spec names secrets (``env.secrets: [HF_TOKEN]``); their values come from the environment of
the process that launches the job (``raylaunch run``, or the laptop for ``raylaunch submit``),
reach every rank's environment, and are never written or printed by the runner: any text the
runner shows or stores that contains a value has it replaced by ``***``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata
from typing import Mapping

from jobs.spec import EnvSpec, SpecError

__all__ = ["MASK", "RUNNER_PACKAGES", "Secrets", "check_requirements", "runner_versions", "with_runner_pins"]

MASK = "***"


class Secrets:
    """The values of a spec's ``env.secrets``; ``mask`` hides them in any text."""

    def __init__(self, values: Mapping[str, str] | None = None) -> None:
        self.values = dict(values or {})
        # Longest first, so a value that contains another is masked whole.
        self._needles = sorted({v for v in self.values.values() if v}, key=len, reverse=True)

    def __repr__(self) -> str:  # never the values
        return f"Secrets({sorted(self.values)})"

    @classmethod
    def read(cls, env: EnvSpec, environ: Mapping[str, str] | None = None) -> "Secrets":
        """Each named secret from ``environ`` (this process's environment by default).

        Raises ``SpecError`` naming every secret that is unset or empty.
        """
        environ = os.environ if environ is None else environ
        missing = [n for n in env.secrets if not environ.get(n)]
        if missing:
            raise SpecError([f"env.secrets: {n} is not set (or empty) where the job is launched; export it "
                             "in this shell, or remove it from env.secrets" for n in missing])
        return cls({n: environ[n] for n in env.secrets})

    def mask(self, text: str) -> str:
        for needle in self._needles:
            if needle in text:
                text = text.replace(needle, MASK)
        return text


# What every rank imports for the runner: a job's packages must not replace them (a package that
# pins another torch would make pip install a second, several-GB torch over the nodes' own, CUDA
# build included, and the ranks would train on it).
RUNNER_PACKAGES = ("torch", "accelerate")


def runner_versions() -> dict[str, str]:
    """The versions of ``RUNNER_PACKAGES`` installed where this runs, without a local label
    (``2.13.0``, not ``2.13.0+cu121``: a pin must match a node's CUDA build and its CPU one alike)."""
    from packaging.version import Version

    out = {}
    for name in RUNNER_PACKAGES:
        try:
            out[name] = Version(metadata.version(name)).public
        except metadata.PackageNotFoundError:
            pass
    return out


def _named(requirements: list[str]) -> set[str]:
    """The runner packages that ``requirements`` choose a version of themselves."""
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name

    named: set[str] = set()
    for line in requirements:
        text = line.split(" #", 1)[0].strip()
        if not text or text.startswith("#"):
            continue
        if text.startswith(("-r", "--requirement", "-c", "--constraint")):
            return set(RUNNER_PACKAGES)  # another file decides: pin nothing rather than contradict it
        try:
            req = Requirement(text)
        except InvalidRequirement:
            # a URL, a path or an editable (git+https://.../accelerate, ./wheels/torch-2.4.0-....whl,
            # -e ./vendor/accelerate), or an index option: named when the name is in it
            if not text.startswith(("--index-url", "-i", "--extra-index-url", "--find-links", "-f",
                                    "--trusted-host", "--pre", "--no-binary", "--only-binary", "--prefer-binary")):
                lowered = text.lower()
                named |= {n for n in RUNNER_PACKAGES if n in lowered}
            continue
        if req.marker is None or req.marker.evaluate():
            named.add(canonicalize_name(req.name))
    return named


def with_runner_pins(requirements: list[str], versions: Mapping[str, str]) -> list[str]:
    """``requirements`` and ``name==version`` for each of ``versions`` (the runner packages a node
    has, see ``runner_versions``) that the requirements do not choose themselves. Nothing is
    added to an empty list."""
    if not requirements:
        return []
    named = _named(requirements)
    return [*requirements, *(f"{name}=={v}" for name, v in versions.items() if name not in named)]


def check_requirements(requirements: list[str], timeout_s: float = 120.0) -> str | None:
    """Resolve ``env.pip``'s requirements here with pip (nothing is installed), with the runner's
    packages held at the versions installed here (``with_runner_pins``), as the nodes install them.

    Raises ``SpecError`` quoting pip when one cannot be found or would need another torch or
    Accelerate: Ray would otherwise try to build the environment three times on every node
    (minutes) before it gives up. Returns a warning when pip could not finish within
    ``timeout_s`` (the nodes will try anyway), else None.
    """
    if not requirements:
        return None
    pinned = with_runner_pins(requirements, runner_versions())
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--no-input",
           "--disable-pip-version-check", *pinned]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"raylaunch: env.pip: pip could not check {requirements} within {timeout_s:.0f} s; the nodes will try"
    if done.returncode != 0:
        errors = [ln.strip() for ln in done.stderr.splitlines() if ln.startswith("ERROR")] or \
            done.stderr.strip().splitlines()[-2:]
        held = [pin for pin in pinned[len(requirements):] if pin in done.stderr]  # pip quotes what it was asked
        raise SpecError([f"env.pip: {requirements} cannot be installed (pip, checked where the job is launched "
                         f"before any node starts): {' | '.join(errors)[:800]}"
                         + (f". The job's packages are installed with {', '.join(held)} kept (the versions the "
                            "runner uses here); name one in env.pip to choose its version yourself" if held else "")])
    return None
