"""Around every ``Accelerator.prepare`` in a rank: what raylaunch does before it, and with the models and optimizers
it has just prepared.

The one wrapper of ``prepare`` (``cluster.patches``): before it, a script's accumulation is set
(``cluster.rank.script``, through Accelerate's public setter); after it, ``cluster.rank.sharding`` says how much of
each new model a rank holds, ``cluster.rank.pace`` hooks its gradients for ``sync_wait``, a script's optimizer steps
are counted (torch's ``register_step_post_hook``). Each registers a callback by name (a second registration under one
name replaces the first).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from cluster import patches

__all__ = ["after_prepare", "before_prepare"]

_BEFORE: dict[str, Callable[[Any], None]] = {}
_AFTER: dict[str, Callable[[Any, list[Any], list[Any]], None]] = {}


def before_prepare(name: str, call: Callable[[Any], None]) -> None:
    """Run ``call(accelerator)`` before every ``prepare`` of this process, in the order registered."""
    _BEFORE[name] = call
    _install()


def after_prepare(name: str, call: Callable[[Any, list[Any], list[Any]], None]) -> None:
    """Run ``call(accelerator, new_models, new_optimizers)`` after every ``prepare`` of this process, in the order
    registered."""
    _AFTER[name] = call
    _install()


def _install() -> None:
    from accelerate import Accelerator

    patches.replace(Accelerator, "prepare", _prepare, "accelerate.Accelerator.prepare")


def _prepare(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def prepare(self: Any, *args: Any, **kwargs: Any) -> Any:
        for before in list(_BEFORE.values()):
            before(self)
        models, optimizers = {id(m) for m in self._models}, {id(o) for o in self._optimizers}
        out = original(self, *args, **kwargs)
        new_models = [m for m in self._models if id(m) not in models]
        new_optimizers = [o for o in self._optimizers if id(o) not in optimizers]
        for call in list(_AFTER.values()):
            call(self, new_models, new_optimizers)
        return out

    return prepare
