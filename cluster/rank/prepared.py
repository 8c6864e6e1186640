"""Around and after every ``Accelerator.prepare`` in a rank: what raylaunch does with the models it prepares.

The one wrapper of ``prepare`` (``cluster.patches``): ``cluster.rank.sharding`` says how much of each new model a rank
holds, ``cluster.rank.pace`` hooks its gradients for ``sync_wait`` (after it); ``cluster.rank.restart_sync`` wraps a
restart's DDP models without DDP's first broadcast (around it). Each registers by name (a second registration under
one name replaces the first).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

from cluster import patches

__all__ = ["after_prepare", "around_prepare"]

_AFTER: dict[str, Callable[[Any, list[Any]], None]] = {}
_AROUND: dict[str, Callable[[Any], contextlib.AbstractContextManager[list[Any]]]] = {}


def after_prepare(name: str, call: Callable[[Any, list[Any]], None]) -> None:
    """Run ``call(accelerator, new_models)`` after every ``prepare`` of this process, in the order registered."""
    from accelerate import Accelerator

    _AFTER[name] = call
    patches.replace(Accelerator, "prepare", _prepare, "accelerate.Accelerator.prepare")


def around_prepare(name: str, context: Callable[[Any], contextlib.AbstractContextManager[list[Any]]]) -> None:
    """Run every ``prepare`` of this process inside ``context(accelerator)``, in the order registered; the list the
    context gives gets what ``prepare`` returned (the objects as prepared: a DDP model, not the model in it) before the
    context ends."""
    from accelerate import Accelerator

    _AROUND[name] = context
    patches.replace(Accelerator, "prepare", _prepare, "accelerate.Accelerator.prepare")


def _prepare(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def prepare(self: Any, *args: Any, **kwargs: Any) -> Any:
        seen = {id(m) for m in self._models}
        with contextlib.ExitStack() as around:
            results = [around.enter_context(context(self)) for context in list(_AROUND.values())]
            out = original(self, *args, **kwargs)
            for made in results:  # what prepare returned, in each context's list, before the context ends
                made.extend(out if isinstance(out, tuple) else (out,))
        new = [m for m in self._models if id(m) not in seen]
        for call in list(_AFTER.values()):
            call(self, new)
        return out

    return prepare
