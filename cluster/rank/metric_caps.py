"""What one log call may hand the runner: values as JSON data, within caps that are enough for any real metric
and that what passes them cannot swell ``metrics.jsonl``, the driver's memory or TensorBoard."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["MAX_KEYS", "MAX_KEY_CHARS", "MAX_TEXT_CHARS", "capped"]

# Caps on what one log call hands the runner: enough for any real metric, and what passes
# them cannot swell metrics.jsonl, the driver's memory or TensorBoard.
MAX_KEYS = 1000
MAX_KEY_CHARS = 200
MAX_TEXT_CHARS = 1000
_FLOAT_MAX = 1.7976931348623157e308


def _cap(v: Any) -> tuple[Any, str | None]:
    """One value as JSON data within the caps, and what was changed (or None)."""
    if hasattr(v, "item") and callable(v.item):  # tensors and numpy scalars
        try:
            v = v.item()
        except (ValueError, RuntimeError):
            pass
    if isinstance(v, bool) or v is None:
        return v, None
    if isinstance(v, int):
        if abs(v) <= 2**63:
            return v, None
        return (_FLOAT_MAX if v > 0 else -_FLOAT_MAX), "integers beyond 2**63 capped to the largest float"
    if isinstance(v, float):
        return v, None  # NaN and infinity stay what they are: they are never drawn as a point
    if isinstance(v, (list, dict)):
        try:
            text = json.dumps(v)
        except (TypeError, ValueError):  # objects inside, or a cycle
            text = repr(v)
        else:
            if len(text) <= MAX_TEXT_CHARS:
                return v, None
        v = text
    elif not isinstance(v, str):
        v = str(v)
    if len(v) > MAX_TEXT_CHARS:
        return v[:MAX_TEXT_CHARS] + "...", f"text longer than {MAX_TEXT_CHARS} characters cut"
    return v, None


def capped(values: dict, notes: list[str]) -> dict:
    """``values`` as JSON data within the caps; what was changed is added to ``notes``."""
    out: dict[str, Any] = {}
    if len(values) > MAX_KEYS:
        notes.append(f"more than {MAX_KEYS} keys in one call: the rest dropped")
    for k, v in list(values.items())[:MAX_KEYS]:
        key = str(k)
        if len(key) > MAX_KEY_CHARS:
            key = key[:MAX_KEY_CHARS]
            notes.append(f"names longer than {MAX_KEY_CHARS} characters cut")
        out[key], note = _cap(v)
        if note:
            notes.append(note)
    return out
