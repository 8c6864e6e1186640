"""The spec's type checker: a raw mapping checked against the dataclass tree of ``jobs.spec.schema``.

It notes every problem at once (``path: what was expected, what was given``) instead of stopping
at the first, names the nearest valid key for a misspelt one, and builds the frozen dataclasses
from what passes. Why not pydantic v2: its errors need a translation as long as this checker to
read as these do (one error per union member instead of one per key, errors in the schema's
order instead of the file's, YAML's unquoted ``no`` read as false, its own wording of bounds).
"""

from __future__ import annotations

import dataclasses
import difflib
import reprlib
import types
import typing
from typing import Any, Literal, Mapping, Union

from jobs.spec.schema import field_key

__all__ = ["build", "clip", "kind", "short"]

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 80
_REPR.maxlist = _REPR.maxdict = 6
_REPR.maxlevel = 3


def clip(text: str, limit: int = 120) -> str:
    """Text for an error message, never longer than ``limit``."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def short(value: Any) -> str:
    """A repr for an error message, never longer than 120 characters."""
    return clip(_REPR.repr(value))


def kind(value: Any) -> str:
    """What a YAML value is, in words: ``a mapping``, ``an integer``, ..."""
    if value is None:
        return "nothing (null)"
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean",
            int: "an integer", float: "a number"}.get(type(value), type(value).__name__)


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " or ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_describe(typing.get_args(tp)[0]).replace('an ', '').replace('a ', '')}s"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false",
            dict: "a mapping", type(None): "null (unset)"}.get(tp, getattr(tp, "__name__", str(tp)))


_MISSING = object()

# The plain types a field can have: whether a YAML value is one (a bool is no number here).
_SCALARS = {
    type(None): lambda v: v is None,
    bool: lambda v: isinstance(v, bool),
    int: lambda v: isinstance(v, int) and not isinstance(v, bool),
    float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    str: lambda v: isinstance(v, str),
    dict: lambda v: isinstance(v, dict),
}


def _check(tp: Any, value: Any, path: str, problems: list[str]) -> Any:
    """Return ``value`` converted to ``tp``, or ``_MISSING`` after noting a problem."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            problems.append(f"{path}: expected a mapping, got {kind(value)}")
            return _MISSING
        return _build(tp, value, path + ".", problems)
    if origin in (Union, types.UnionType):
        nested = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        if nested and isinstance(value, dict):  # its own keys' problems, with their paths
            return _check(nested[0], value, path, problems)
        for arg in typing.get_args(tp):
            scratch: list[str] = []
            out = _check(arg, value, path, scratch)
            if not scratch:
                return out
    elif origin is Literal:
        options = typing.get_args(tp)
        if value is False and "no" in options:  # YAML reads an unquoted `no` as false
            return "no"
        if any(value == a and type(value) is type(a) for a in options):
            return value
    elif origin is list:
        if isinstance(value, list):
            (item,) = typing.get_args(tp)
            scratch = []
            out = [_check(item, v, f"{path}[{i}]", scratch) for i, v in enumerate(value)]
            problems.extend(scratch)
            return _MISSING if scratch else out
    elif tp in _SCALARS:
        if _SCALARS[tp](value):
            return float(value) if tp is float else value
    else:  # pragma: no cover - a type this checker does not know is a bug here
        raise TypeError(f"spec field {path} has unsupported type {tp!r}")
    problems.append(f"{path}: expected {_describe(tp)}, got {kind(value)} {short(value)}")
    return _MISSING


def build(cls: type, raw: Mapping[str, Any], problems: list[str]) -> Any:
    """``cls`` (a dataclass of the schema) built from ``raw``; every problem is added to ``problems``."""
    return _build(cls, raw, "", problems)


def _build(cls: type, raw: Mapping[str, Any], prefix: str, problems: list[str]) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {field_key(f): f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        path = f"{prefix}{key}"
        if key not in fields:
            near = difflib.get_close_matches(str(key)[:100], fields, n=1, cutoff=0.6)
            hint = f"; did you mean {near[0]!r}?" if near else f"; valid keys: {', '.join(fields)}"
            problems.append(f"{clip(path)}: unknown key{hint}")
            continue
        out = _check(hints[fields[key].name], value, path, problems)
        if out is not _MISSING:
            check = fields[key].metadata.get("check")
            wrong = check(out) if check else None
            if wrong:
                problems.append(f"{path}: {wrong}, got {short(value)}")
                continue
            kwargs[fields[key].name] = out
    for name, f in fields.items():
        if name not in raw and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            problems.append(f"{prefix}{name}: required, but missing")
    try:
        return cls(**kwargs)
    except TypeError:  # a required key is missing (noted above): the siblings are still checked
        return _MISSING
