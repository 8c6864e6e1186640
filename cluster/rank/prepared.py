"""After every ``Accelerator.prepare`` in a rank: what raylaunch does with the models it has just prepared.

The one wrapper of ``prepare`` (``cluster.patches``): ``cluster.rank.sharding`` says how much of each new model a rank
holds, ``cluster.rank.pace`` hooks its gradients for ``sync_wait``. Each registers a callback by name (a second
registration under one name replaces the first).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from cluster import patches

__all__ = ["after_prepare"]

_AFTER: dict[str, Callable[[Any, list[Any]], None]] = {}


def after_prepare(name: str, call: Callable[[Any, list[Any]], None]) -> None:
    """Run ``call(accelerator, new_models)`` after every ``prepare`` of this process, in the order registered."""
    from accelerate import Accelerator

    _AFTER[name] = call
    patches.replace(Accelerator, "prepare", _prepare, "accelerate.Accelerator.prepare")


def _prepare(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def prepare(self: Any, *args: Any, **kwargs: Any) -> Any:
        seen = {id(m) for m in self._models}
        out = original(self, *args, **kwargs)
        new = [m for m in self._models if id(m) not in seen]
        for call in list(_AFTER.values()):
            call(self, new)
        return out

    return prepare
