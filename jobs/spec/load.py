"""Loading a spec: YAML read safely, ``--set`` overrides and literals applied, then checked and built.

The one part of the spec that reads files: the spec file itself, and whether ``env.pip``
names a requirements file that exists (the type checker is ``jobs.spec.check``, the
cross-field rules ``jobs.spec.rules``).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any, Mapping

import yaml

from jobs.spec.check import build, clip, kind, short
from jobs.spec.rules import cross_checks
from jobs.spec.schema import JobSpec, SpecError, spec_to_dict

__all__ = ["MAX_VALUES", "apply_overrides", "load_spec", "load_spec_text", "read_spec_dict", "spec_from_dict",
           "with_overrides"]


class _Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that reads ``3e-4`` and ``1e5`` as floats."""


_FLOAT = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)
_Loader.yaml_implicit_resolvers = {
    k: [r for r in v if r[0] != "tag:yaml.org,2002:float"]
    for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))


# A spec holds a few hundred values; aliases (`&a`, `*a`) can make a small file stand for
# billions of them, which any walk (the checks, spec.yaml, json) would expand.
MAX_VALUES = 100_000


def _parse_yaml(text: str, source: str) -> Any:
    try:
        data = yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise SpecError([f"not valid YAML: {clip(str(exc), 600)}"], source) from None
    _count_values(data, source)
    return data


def _count_values(data: Any, source: str) -> None:
    """Refuse data that expands to more than MAX_VALUES values (shared aliases counted each time)."""
    count, stack = 0, [data]
    while stack:
        value = stack.pop()
        count += 1
        if count > MAX_VALUES:
            raise SpecError([f"expands to more than {MAX_VALUES:,} values (YAML aliases repeated, or a "
                             "recursive alias); write the values out, or keep large data out of the spec"], source)
        if isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)


def load_spec(path: str | Path, overrides: list[str] | None = None,
              literals: Mapping[str, str] | None = None) -> JobSpec:
    """Read a spec file, apply ``--set`` style overrides, then ``literals``, and check it.

    ``literals`` (``{"name": ..., "storage": ...}`` from ``--name``/``--storage``) are
    strings as given, never read as YAML: ``--name "exp #3"`` is ``exp #3``.
    """
    return spec_from_dict(apply_overrides(read_spec_dict(path), overrides or [], str(path), literals), str(path))


def read_spec_dict(path: str | Path) -> dict:
    """A spec file's mapping as written, not yet checked (``raylaunch launch --spec`` adds to it)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise SpecError([f"cannot read the spec file: {exc.strerror}"], str(path)) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError([f"not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); "
                         "save the spec as UTF-8"], str(path)) from None
    return _spec_mapping(text, str(path))


def _spec_mapping(text: str, source: str) -> dict:
    raw = _parse_yaml(text, source)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise SpecError([f"the top level must be a mapping of keys, not {kind(raw)}"], source)
    return raw


def load_spec_text(
    text: str, overrides: list[str] | None = None, source: str = "the job spec",
    literals: Mapping[str, str] | None = None,
) -> JobSpec:
    """``load_spec`` of a spec's text (``source`` names it in messages)."""
    raw = _spec_mapping(text, source)
    return spec_from_dict(apply_overrides(raw, overrides or [], source, literals), source)


def apply_overrides(raw: dict, overrides: list[str], source: str = "--set",
                    literals: Mapping[str, str] | None = None) -> dict:
    """Apply ``a.b.c=value`` strings, then ``{a.b.c: value}`` literals, to a plain dict (a copy).

    ``--set`` values are read as YAML, so ``4``, ``3e-4``, ``true`` and ``[1, 2]`` keep
    their types; anything else stays a string. Literals stay the strings they are.
    """
    out = copy.deepcopy(raw)
    problems = []
    items = [(item, False) for item in overrides] + [(f"{k}={v}", True) for k, v in (literals or {}).items()]
    for item, literal in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            problems.append(f"--set {short(item)}: expected KEY=VALUE, e.g. scaling.num_nodes=4")
            continue
        parts = key.strip().split(".")
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                problems.append(f"--set {key}: {'.'.join(parts[: i + 1])} is not a mapping")
                break
            node = child
        else:
            if literal:
                node[parts[-1]] = value
            else:
                node[parts[-1]] = _parse_yaml(value, f"--set {key}") if value.strip() else ""
    if problems:
        raise SpecError(problems, source)
    return out


def spec_from_dict(raw: Mapping[str, Any], source: str = "the job spec") -> JobSpec:
    """Check a spec's mapping (overrides applied) and build it; ``SpecError`` lists every problem."""
    problems: list[str] = []
    value = build(JobSpec, raw, problems)
    if not problems:
        problems.extend(cross_checks(value) + _file_checks(value))
    if problems:
        raise SpecError(problems, source)
    return value


def _file_checks(spec: JobSpec) -> list[str]:
    """What the spec names on this machine that is not there: ``env.pip``'s requirements file."""
    pip = spec.env.pip
    if isinstance(pip, str) and not Path(pip).is_file():
        return [f"env.pip: {pip!r} is not a requirements file in the working directory; "
                "give a list of requirements or the file's path relative to the project folder"]
    return []


def with_overrides(spec: JobSpec, overrides: list[str]) -> JobSpec:
    """A new spec: ``spec`` with ``path=value`` overrides applied and checked again (here, not a method of
    ``JobSpec``: the schema module imports nothing of loading, so the spec modules have no import circle)."""
    return spec_from_dict(apply_overrides(spec_to_dict(spec), overrides))
