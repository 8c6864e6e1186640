"""The base of every error raylaunch raises for a person to act on, with the exit code `raylaunch` ends with.

Each error names what to fix in its message; the CLI prints ``raylaunch: <message><hint>``
and exits with ``exit_code`` (2: the request is wrong, fix it and rerun; 1: it could
not be done). Subclasses keep their standard base too (``ValueError``, ``ImportError``,
...), so callers that catch those still do.
"""

from __future__ import annotations

__all__ = ["RaylaunchError"]


class RaylaunchError(Exception):
    """An error whose message is for the user; ``exit_code`` is what the CLI exits with."""

    exit_code: int = 1
    hint: str = ""  # what the CLI adds after the message
