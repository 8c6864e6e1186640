"""The job spec: what the user asked for, as a frozen, typed tree.

A spec is YAML read with ``yaml.safe_load`` (through a loader that also reads
``3e-4`` as a float, which plain YAML 1.1 leaves as a string) and checked
against the dataclasses below before anything starts. Every problem is
reported at once, each with the path of the field and, for a misspelt key,
the nearest valid one::

    >>> load_spec_text("name: x\\ntrain_fn: m:f\\nscalng: {}")
    Traceback (most recent call last):
    ...
    jobs.spec.SpecError: the job spec has 1 problem:
      - scalng: unknown key; did you mean 'scaling'?
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import re
import reprlib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Union

import yaml

from cluster.errors import RaylaunchError
from cluster.sharding import FSDP_DEFAULTS
from cluster.storage_io import storage_credentials

__all__ = [
    "AccelerateSpec",
    "CheckpointSpec",
    "DataLoaderSpec",
    "EnvSpec",
    "FailureSpec",
    "FsdpSpec",
    "JobSpec",
    "RendezvousSpec",
    "ScalingSpec",
    "SpecError",
    "TimeoutSpec",
    "apply_overrides",
    "load_spec",
    "load_spec_text",
    "parse_port_range",
    "read_spec_dict",
    "run_name_problem",
    "spec_from_dict",
    "spec_to_dict",
]


class SpecError(RaylaunchError, ValueError):
    """A spec that cannot run; ``problems`` lists each one as ``path: what to fix``."""

    exit_code = 2

    def __init__(self, problems: list[str], source: str = "the job spec") -> None:
        self.problems = list(problems)
        self.source = source
        noun = "problem" if len(problems) == 1 else "problems"
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{source} has {len(problems)} {noun}:\n{lines}")

    def __reduce__(self):  # survive pickling across process boundaries
        return (SpecError, (self.problems, self.source))


# Upper bounds: far beyond any real cluster, but finite, so `.inf` or `1e300` is refused
# here rather than overflowing inside a node actor or every rank.
_MANY = 10_000
_MONTH_S = 30 * 24 * 3600.0


def _within(low: float, high: float, default: Any, extra: str = "", *, strict: bool = False) -> Any:
    """A field whose numeric value must be finite, >= low (> low when strict) and <= high."""
    def problem(v: Any) -> str | None:
        if not isinstance(v, (int, float)):
            return None
        if not math.isfinite(v):
            return f"must be a finite number, at most {high:g}{extra}"
        if v < low or (strict and v == low):
            return f"must be {'more than' if strict else 'at least'} {low:g}{extra}"
        if v > high:
            return f"must be at most {high:g}{extra}"
        return None

    return field(default=default, metadata={"check": problem})


@dataclass(frozen=True)
class ScalingSpec:
    """How many nodes, and how many worker processes on each."""

    num_nodes: int = _within(1, _MANY, 1)
    # A number, or "auto": every GPU of a node (every CPU slot on CPU nodes).
    workers_per_node: Union[int, Literal["auto"]] = _within(1, 1024, 1, " or 'auto'")
    use_gpu: Union[bool, Literal["auto"]] = "auto"
    cpus_per_worker: float = _within(0, 1024, 1.0, strict=True)
    # Elastic: the fewest nodes the run goes on with after nodes are lost (and starts with);
    # unset (None) means num_nodes, a run that is not elastic.
    min_nodes: Union[int, None] = _within(1, _MANY, None)
    # At every world size the optimizer step sees the same global batch: the runner raises
    # gradient accumulation as the world shrinks, and runs only at sizes where that is exact.
    keep_global_batch: bool = True

    @property
    def elastic_min(self) -> int:
        """``min_nodes``, or ``num_nodes`` when unset."""
        return self.num_nodes if self.min_nodes is None else self.min_nodes


@dataclass(frozen=True)
class DataLoaderSpec:
    """Applied through ``accelerate.DataLoaderConfiguration``."""

    even_batches: bool = True
    use_seedable_sampler: bool = True
    split_batches: bool = False
    # auto: Accelerate's choice (rank 0 reads an IterableDataset and sends each rank its batch;
    # every rank reads its own shard of a map-style one).
    dispatch_batches: Union[bool, Literal["auto"]] = "auto"
    # torchdata's StatefulDataLoader underneath: its position is saved in every checkpoint.
    use_stateful_dataloader: bool = False


@dataclass(frozen=True)
class FsdpSpec:
    """``accelerate.fsdp``: its presence shards the model (FSDP); passed on as ``accelerate launch`` would."""

    version: Literal[1, 2] = FSDP_DEFAULTS["version"]  # 2: torch's fully_shard
    reshard_after_forward: bool = FSDP_DEFAULTS["reshard_after_forward"]
    state_dict_type: Literal["sharded", "full"] = FSDP_DEFAULTS["state_dict_type"]  # of checkpoints
    # What to wrap: transformer layer classes by name, or modules over a size; neither: the model as one.
    transformer_layer_cls_to_wrap: Union[list[str], None] = FSDP_DEFAULTS["transformer_layer_cls_to_wrap"]
    min_num_params: Union[int, None] = _within(1, 1e15, FSDP_DEFAULTS["min_num_params"])
    activation_checkpointing: bool = FSDP_DEFAULTS["activation_checkpointing"]
    cpu_ram_efficient_loading: bool = FSDP_DEFAULTS["cpu_ram_efficient_loading"]
    offload_params: bool = FSDP_DEFAULTS["offload_params"]


@dataclass(frozen=True)
class AccelerateSpec:
    """Accelerator options the runner applies to every rank."""

    mixed_precision: Literal["no", "fp16", "bf16"] = "no"
    gradient_accumulation_steps: int = _within(1, 1_000_000, 1)
    dataloader: DataLoaderSpec = field(default_factory=DataLoaderSpec)
    fsdp: Union[FsdpSpec, None] = None  # present (even {}): FSDP
    config_file: Union[str, None] = None  # an `accelerate config` YAML; the spec's own keys win


@dataclass(frozen=True)
class CheckpointSpec:
    """How many committed checkpoints to keep (the newest ``keep``), and whether a save holds training only
    while the state is copied into memory (``async``, the spec's key; ``async_`` here, a Python keyword)."""

    keep: int = _within(1, _MANY, 2, " (the latest committed checkpoint is never deleted)")
    async_: bool = field(default=True, metadata={"key": "async"})


@dataclass(frozen=True)
class FailureSpec:
    """Restarts from the last committed checkpoint after a failed attempt."""

    max_restarts: int = _within(0, _MANY, 0)
    # Ranks ended by SIGTERM (a spot node's preemption notice) restart without using
    # max_restarts, up to this many times.
    max_preemptions: int = _within(0, _MANY, 10)


@dataclass(frozen=True)
class TimeoutSpec:
    """Bounds, in seconds, on the waits that peers leave unbounded."""

    # Waiting for the cluster to grant one bundle per node. A cluster that
    # can never grant them (too few nodes and no autoscaler) fails at once.
    placement_s: float = _within(0, _MONTH_S, 120.0, " seconds", strict=True)
    # Every rank must join the process group within this time.
    rendezvous_s: float = _within(0, _MONTH_S, 300.0, " seconds", strict=True)
    # A rank process that has not run for this long (stopped, frozen), or a
    # node that has not answered for this long (its host or link is down), is
    # treated as dead: every rank is stopped and the attempt restarts.
    heartbeat_s: float = _within(0, _MONTH_S, 60.0, " seconds", strict=True)
    # A collective that waits this long fails its rank (the process group's
    # timeout; NCCL's own default is 10 minutes).
    collective_s: float = _within(0, _MONTH_S, 600.0, " seconds", strict=True)
    # Elastic runs (scaling.min_nodes): after a node is lost, how long to wait for the run's
    # full num_nodes before going on with the nodes there are.
    resize_s: float = _within(0, _MONTH_S, 30.0, " seconds", strict=True)


@dataclass(frozen=True)
class RendezvousSpec:
    """Where the ranks meet: node 0's store port, and the interface the collectives use."""

    # "any" (a port the system picks), one port, or "LOW-HIGH" for a firewall that allows
    # only those: node 0 binds its store on the first free one.
    ports: Union[int, str] = "any"
    # "auto": the node's GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME if its environment sets
    # one, else the interface that carries the node's Ray address. Or a name, e.g. eth1.
    socket_ifname: str = "auto"

    @property
    def port_range(self) -> tuple[int, int] | None:
        """``(low, high)``, inclusive, or None for any port."""
        return parse_port_range(self.ports)


def parse_port_range(value: int | str) -> tuple[int, int] | None:
    """``"29400-29499"`` -> ``(29400, 29499)``; ``29400`` -> ``(29400, 29400)``; ``"any"`` -> None.

    Raises ``ValueError`` saying what is wrong.
    """
    if isinstance(value, str) and value.strip().lower() == "any":
        return None
    text = str(value).strip()
    m = re.fullmatch(r"(\d+)(?:\s*-\s*(\d+))?", text)
    if not m:
        raise ValueError(f"{value!r} is not a port range; write LOW-HIGH, e.g. 29400-29499, one port, or 'any'")
    low, high = int(m.group(1)), int(m.group(2) or m.group(1))
    if not 1 <= low <= high <= 65535:
        raise ValueError(f"{value!r} must have 1 <= LOW <= HIGH <= 65535, e.g. 29400-29499")
    return low, high


# Set by the runner for every rank: a spec cannot override them (the rendezvous, the world, the
# thread count from scaling.cpus_per_worker, Accelerate's CPU switch, Ray's device assignment).
RUNNER_VARS = frozenset({
    "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK",
    "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT", "OMP_NUM_THREADS", "ACCELERATE_USE_CPU", "CUDA_VISIBLE_DEVICES",
})
_VAR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class EnvSpec:
    """The job's environment on every node: plain variables, secrets by name, extra packages.

    ``vars`` are written with the spec (``spec.yaml``, the job's entrypoint); ``secrets`` are
    names whose values are read where the job is launched and are never written or printed;
    ``pip`` lists requirements (or names a requirements file in the working directory) that
    Ray installs for the job on every node.
    """

    vars: dict = field(default_factory=dict)
    secrets: list[str] = field(default_factory=list)
    pip: Union[list[str], str] = field(default_factory=list)

    @property
    def requirements(self) -> list[str]:
        """``pip`` as a list (a requirements file is read from the current directory)."""
        if isinstance(self.pip, list):
            return list(self.pip)
        lines = Path(self.pip).read_text().splitlines()
        return [ln.split("#", 1)[0].strip() for ln in lines if ln.split("#", 1)[0].strip()]


@dataclass(frozen=True)
class JobSpec:
    """A whole job: a training function (``train_fn``, called with ``config``) or a script.

    ``script`` is a ``.py`` file of the working directory that each rank runs as
    ``python SCRIPT *args`` would (``accelerate launch``'s way); exactly one of the two.
    """

    name: str
    train_fn: Union[str, None] = None
    config: dict = field(default_factory=dict)
    script: Union[str, None] = None
    # The script's own arguments, passed on untouched.
    args: list[str] = field(default_factory=list)
    # After a restart the script gets ``<resume_arg> <folder of the latest committed checkpoint>``
    # (the flag Accelerate's and transformers' examples read); null: it starts from the beginning.
    resume_arg: Union[str, None] = "--resume_from_checkpoint"
    scaling: ScalingSpec = field(default_factory=ScalingSpec)
    accelerate: AccelerateSpec = field(default_factory=AccelerateSpec)
    storage: str = "~/raylaunch-runs"
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    failure: FailureSpec = field(default_factory=FailureSpec)
    timeouts: TimeoutSpec = field(default_factory=TimeoutSpec)
    rendezvous: RendezvousSpec = field(default_factory=RendezvousSpec)
    env: EnvSpec = field(default_factory=EnvSpec)

    def with_overrides(self, overrides: list[str]) -> "JobSpec":
        """A new spec with ``path=value`` overrides applied and checked again."""
        return spec_from_dict(apply_overrides(spec_to_dict(self), overrides))


# --- YAML ------------------------------------------------------------------


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
        raise SpecError([f"not valid YAML: {_clip(str(exc), 600)}"], source) from None
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


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 80
_REPR.maxlist = _REPR.maxdict = 6
_REPR.maxlevel = 3


def _clip(text: str, limit: int = 120) -> str:
    """Text for an error message, never longer than ``limit``."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _short(value: Any) -> str:
    """A repr for an error message, never longer than 120 characters."""
    return _clip(_REPR.repr(value))


# --- loading ---------------------------------------------------------------


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
        raise SpecError([f"the top level must be a mapping of keys, not {_kind(raw)}"], source)
    return raw


def load_spec_text(
    text: str, overrides: list[str] | None = None, source: str = "the job spec",
    literals: Mapping[str, str] | None = None,
) -> JobSpec:
    raw = _spec_mapping(text, source)
    return spec_from_dict(apply_overrides(raw, overrides or [], source, literals), source)


def apply_overrides(raw: dict, overrides: list[str], source: str = "--set",
                    literals: Mapping[str, str] | None = None) -> dict:
    """Apply ``a.b.c=value`` strings, then ``{a.b.c: value}`` literals, to a plain dict (a copy).

    ``--set`` values are read as YAML, so ``4``, ``3e-4``, ``true`` and ``[1, 2]`` keep
    their types; anything else stays a string. Literals stay the strings they are.
    """
    import copy

    out = copy.deepcopy(raw)
    problems = []
    items = [(item, False) for item in overrides] + [(f"{k}={v}", True) for k, v in (literals or {}).items()]
    for item, literal in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            problems.append(f"--set {_short(item)}: expected KEY=VALUE, e.g. scaling.num_nodes=4")
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
    problems: list[str] = []
    value = _build(JobSpec, raw, "", problems)
    if not problems:
        problems.extend(_cross_checks(value))
    if problems:
        raise SpecError(problems, source)
    return value


def spec_to_dict(spec: JobSpec) -> dict:
    """The plain-dict form, as written to ``spec.yaml`` in the run directory (keys as the spec spells them)."""
    return _spelled(spec)


def _key(f: dataclasses.Field) -> str:
    """A field's key in the spec: its name, or the key it spells (``async``, a Python keyword)."""
    return f.metadata.get("key", f.name)


def _spelled(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {_key(f): _spelled(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, list):
        return [_spelled(v) for v in value]
    if isinstance(value, dict):
        return {k: _spelled(v) for k, v in value.items()}
    return copy.deepcopy(value)


def run_name_problem(name: str) -> str | None:
    """What is wrong with a run name (it names a folder under the storage), or None.

    >>> run_name_problem("../etc")
    "'../etc' must start with a letter or digit, then letters, digits, '.', '_' or '-', at most 200 (it names the run directory)"
    """
    if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}", name):
        return None
    return (f"{_short(name)} must start with a letter or digit, then letters, digits, '.', '_' or '-', "
            "at most 200 (it names the run directory)")


def _entry_checks(spec: JobSpec) -> list[str]:
    """Exactly one of ``train_fn`` and ``script``, each well formed."""
    if (spec.train_fn is None) == (spec.script is None):
        return ["train_fn, script: give exactly one: train_fn: module:function (a function called with config), or "
                "script: train.py (a script run as `python train.py *args`, as accelerate launch runs it)"]
    if spec.script is not None:
        return _script_checks(spec)
    out = []
    if spec.args:
        out.append("args: are a script's arguments; a train_fn gets config instead (or name a script:)")
    module, sep, fn = spec.train_fn.partition(":")
    if not sep or not module or not fn:
        out.append(
            f"train_fn: {_short(spec.train_fn)} must be 'module:function', "
            "e.g. train_fn.digits:train"
        )
    elif not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", module) \
            or not fn.isidentifier():
        out.append(
            f"train_fn: {_short(spec.train_fn)} must be an absolute module path and a function name, "
            "e.g. mypkg.train:main (no leading '.', no file path)"
        )
    return out


def _script_checks(spec: JobSpec) -> list[str]:
    out = []
    script = spec.script
    if not script.endswith(".py"):
        out.append(f"script: {_short(script)} must be a Python file ending in .py, e.g. train.py")
    elif Path(script).is_absolute() or ".." in Path(script).parts:
        out.append(f"script: {_short(script)} must be a path inside the working directory (relative, no '..'): "
                   "it travels to every node with that folder")
    if spec.config:
        out.append("config: is handed to a train_fn; a script reads its own arguments (args:)")
    if spec.resume_arg is not None and not re.fullmatch(r"--?[A-Za-z0-9][A-Za-z0-9_-]*", spec.resume_arg):
        out.append(f"resume_arg: {_short(spec.resume_arg)} must be an option such as --resume_from_checkpoint, "
                   "or null (a restart then runs the script from the beginning)")
    return out


def _cross_checks(spec: JobSpec) -> list[str]:
    out = _entry_checks(spec)
    wrong = run_name_problem(spec.name)
    if wrong:
        out.append(f"name: {wrong}")
    s = spec.scaling
    if s.min_nodes is not None and isinstance(s.num_nodes, int) and s.min_nodes > s.num_nodes:
        out.append(f"scaling.min_nodes: {s.min_nodes} is more than scaling.num_nodes ({s.num_nodes}); "
                   f"set it to at most {s.num_nodes} (--set scaling.min_nodes={s.num_nodes})")
    if s.use_gpu is False and spec.accelerate.mixed_precision == "fp16":
        out.append("accelerate.mixed_precision: fp16 needs GPUs; use bf16 or 'no' with scaling.use_gpu: false")
    fsdp = spec.accelerate.fsdp
    if fsdp is not None and fsdp.transformer_layer_cls_to_wrap and fsdp.min_num_params:
        out.append("accelerate.fsdp: transformer_layer_cls_to_wrap and min_num_params are two ways to wrap; "
                   "keep one of them")
    if fsdp is not None and fsdp.cpu_ram_efficient_loading and s.use_gpu is False:
        out.append("accelerate.fsdp.cpu_ram_efficient_loading: needs GPUs (rank 0's weights are broadcast from "
                   "its device); leave it false with scaling.use_gpu: false")
    if not spec.storage.strip():
        out.append("storage: must be a path or a URI such as s3://bucket/runs")
    secret = storage_credentials(spec.storage)
    if secret:  # never echo the value: it holds the secret
        out.append(f"storage: the URI holds credentials ({secret}); remove them. Each node uses its own "
                   "credential chain (instance profile, AWS_* or GOOGLE_APPLICATION_CREDENTIALS variables "
                   "in its environment); the URI carries only the bucket, prefix and options")
    try:
        parse_port_range(spec.rendezvous.ports)
    except ValueError as exc:
        out.append(f"rendezvous.ports: {exc}")
    if not spec.rendezvous.socket_ifname.strip():
        out.append("rendezvous.socket_ifname: must be 'auto' or an interface name such as eth1")
    out.extend(_env_checks(spec.env))
    return out


def _env_checks(env: EnvSpec) -> list[str]:
    out = []
    for where, names in (("env.vars", list(env.vars)), ("env.secrets", env.secrets)):
        for name in names:
            if not isinstance(name, str) or not _VAR_NAME.fullmatch(name):
                out.append(f"{where}: {str(name)[:60]!r} is not a variable name (letters, digits, '_')")
            elif name in RUNNER_VARS:
                why = ("set it with scaling.cpus_per_worker" if name == "OMP_NUM_THREADS" else
                       "Ray assigns each rank its devices" if name == "CUDA_VISIBLE_DEVICES" else
                       "it makes the ranks meet and know their place in the world")
                out.append(f"{where}: {name} is set by raylaunch for every rank and cannot be overridden ({why})")
    for name, value in env.vars.items():
        if not isinstance(value, (str, int, float, bool)):
            out.append(f"env.vars.{str(name)[:60]}: expected a string or a number, got {_kind(value)}")
    both = sorted(set(env.vars) & set(env.secrets))
    if both:
        out.append(f"env: {', '.join(map(str, both))} named in both env.vars and env.secrets; a secret's value "
                   "comes only from where the job is launched")
    if isinstance(env.pip, str):
        if not Path(env.pip).is_file():
            out.append(f"env.pip: {env.pip!r} is not a requirements file in the working directory; "
                       "give a list of requirements or the file's path relative to the project folder")
    elif any(not r.strip() for r in env.pip):
        out.append("env.pip: empty requirement; write each as it goes to pip, e.g. 'humanize==4.9.0'")
    return out


# --- the generic checker ---------------------------------------------------


def _kind(value: Any) -> str:
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


def _check(tp: Any, value: Any, path: str, problems: list[str]) -> Any:
    """Return ``value`` converted to ``tp``, or ``_MISSING`` after noting a problem."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            problems.append(f"{path}: expected a mapping, got {_kind(value)}")
            return _MISSING
        return _build(tp, value, path + ".", problems)
    if tp is type(None):
        if value is None:
            return None
    elif origin in (Union, types.UnionType):
        nested = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        if nested and isinstance(value, dict):  # its own keys' problems, with their paths
            return _check(nested[0], value, path, problems)
        for arg in typing.get_args(tp):
            scratch: list[str] = []
            out = _check(arg, value, path, scratch)
            if not scratch:
                return out
    elif origin is Literal:
        if value is False and "no" in typing.get_args(tp):  # YAML reads an unquoted `no` as false
            return "no"
        if value in typing.get_args(tp) and type(value) is type(
            next(a for a in typing.get_args(tp) if a == value)
        ):
            return value
    elif tp is type(None):
        if value is None:
            return None
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is dict:
        if isinstance(value, dict):
            return value
    elif origin is list:
        if isinstance(value, list):
            (item,) = typing.get_args(tp)
            scratch = []
            out = [_check(item, v, f"{path}[{i}]", scratch) for i, v in enumerate(value)]
            problems.extend(scratch)
            return _MISSING if scratch else out
    else:  # pragma: no cover - a type this checker does not know is a bug here
        raise TypeError(f"spec field {path} has unsupported type {tp!r}")
    problems.append(f"{path}: expected {_describe(tp)}, got {_kind(value)} {_short(value)}")
    return _MISSING


def _build(cls: type, raw: Mapping[str, Any], prefix: str, problems: list[str]) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {_key(f): f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        path = f"{prefix}{key}"
        if key not in fields:
            near = difflib.get_close_matches(str(key)[:100], fields, n=1, cutoff=0.6)
            hint = f"; did you mean {near[0]!r}?" if near else f"; valid keys: {', '.join(fields)}"
            problems.append(f"{_clip(path)}: unknown key{hint}")
            continue
        out = _check(hints[fields[key].name], value, path, problems)
        if out is not _MISSING:
            check = fields[key].metadata.get("check")
            wrong = check(out) if check else None
            if wrong:
                problems.append(f"{path}: {wrong}, got {_short(value)}")
                continue
            kwargs[fields[key].name] = out
    for name, f in fields.items():
        if name not in raw and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            problems.append(f"{prefix}{name}: required, but missing")
    if problems:
        # Keep checking siblings, but do not construct a half-valid object.
        try:
            return cls(**kwargs)
        except TypeError:
            return _MISSING
    return cls(**kwargs)
