"""The job spec's schema: the frozen dataclass tree a spec becomes, its bounds, and its JSON Schema.

Nothing here reads a file or YAML (``jobs.spec.load`` does) or checks one field against
another (``jobs.spec.rules``); ``jobs.spec`` is the public surface.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

from cluster.errors import RaylaunchError
from cluster.strategy import FSDP_DEFAULTS

__all__ = [
    "AccelerateSpec", "CheckpointSpec", "DataLoaderSpec", "EnvSpec", "FailureSpec", "FsdpSpec", "JobSpec",
    "RUNNER_VARS", "RendezvousSpec", "ScalingSpec", "SnapshotSpec", "SpecError", "TimeoutSpec", "field_key", "json_schema",
    "parse_port_range", "spec_to_dict",
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

    return field(default=default, metadata={"check": problem, "bounds": (low, high, strict)})


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
class SnapshotSpec:
    """Snapshots in memory between commits (docs/faults.md): every ``every`` optimizer steps each rank's whole state
    in its node's memory and a copy on one other node, which a restart resumes from when it is newer than the last
    committed checkpoint."""

    # Optimizer steps between snapshots; "auto": as often as keeps them at most 2% of the step time; 0: none.
    every: Union[int, Literal["auto"]] = _within(0, 1_000_000_000, "auto", " optimizer steps or 'auto'")
    # The host memory a node's snapshots (its ranks' and the copies it keeps for its peer) may hold, in MiB; "auto":
    # a quarter of the node's memory (and never more than its /dev/shm has free).
    memory_mb: Union[float, Literal["auto"]] = _within(0, 1e9, "auto", " MiB or 'auto'", strict=True)


@dataclass(frozen=True)
class CheckpointSpec:
    """How many committed checkpoints to keep (the newest ``keep``), and whether a save holds training only
    while the state is copied into memory (``async``, the spec's key; ``async_`` here, a Python keyword)."""

    keep: int = _within(1, _MANY, 2, " (the latest committed checkpoint is never deleted)")
    async_: bool = field(default=True, metadata={"key": "async"})
    # When ``session.checkpoint_due`` says a save is due: seconds of training between saves, or "auto" (Young and
    # Daly's interval from the measured cost of a save and the time between failures); unset, it never says so
    # (the function saves when it chooses).
    every: Union[float, Literal["auto"], None] = _within(0, _MONTH_S, None, " seconds or 'auto'", strict=True)
    # The mean time between failures "auto" assumes until the run's own history has one (a failed attempt).
    mtbf_s: float = _within(0, 365 * 24 * 3600.0, 86400.0, " seconds", strict=True)
    snapshots: SnapshotSpec = field(default_factory=SnapshotSpec)


@dataclass(frozen=True)
class FailureSpec:
    """Restarts from the last committed checkpoint after a failed attempt: a budget for failures of the training
    code, one for failures outside it, one for preemptions (docs/faults.md has the table)."""

    # Failures of the training code (an exception, an exit code it chose, a crash, a collective that timed out),
    # and any failure once the budgets below are spent: not restarted unless asked, so a bug never loops.
    max_restarts: int = _within(0, _MANY, 0)
    # Failures outside the code (a node lost, a rank killed by a signal from outside such as the OOM killer's
    # SIGKILL, a rank stopped or frozen) restart without using max_restarts, up to this many times.
    max_infra_restarts: int = _within(0, _MANY, 3)
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


@dataclass(frozen=True)
class EnvSpec:
    """The job's environment on every node: plain variables, secrets by name, extra packages.

    ``vars`` are written with the spec (``spec.yaml``, the job's entrypoint); ``secrets`` are
    names whose values are read where the job is launched and are never written or printed;
    ``pip`` lists requirements (or names a requirements file in the working directory) that
    Ray installs for the job on every node; ``warm_host`` chooses where ranks start from.
    """

    vars: dict = field(default_factory=dict)
    secrets: list[str] = field(default_factory=list)
    pip: Union[list[str], str] = field(default_factory=list)
    # Ranks fork from a warm rank host on each node (torch, Accelerate, transformers imported once, kept
    # between jobs; ``cluster.hosting.rankhost``); false: from a server each job's node actor starts and preloads.
    warm_host: bool = True
    # How long a warm rank host with no ranks and no job waits for the next before it ends.
    warm_host_idle_s: float = _within(1, _MONTH_S, 600.0)

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


def field_key(f: dataclasses.Field) -> str:
    """A field's key in the spec: its name, or the key it spells (``async``, a Python keyword)."""
    return f.metadata.get("key", f.name)


def spec_to_dict(spec: JobSpec) -> dict:
    """The plain-dict form, as written to ``spec.yaml`` in the run directory (keys as the spec spells them)."""
    return _spelled(spec)


def _spelled(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {field_key(f): _spelled(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, list):
        return [_spelled(v) for v in value]
    if isinstance(value, dict):
        return {k: _spelled(v) for k, v in value.items()}
    return copy.deepcopy(value)


# --- JSON Schema (``raylaunch schema``; editors check a spec against it as it is typed) ----------

_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", dict: "object",
               type(None): "null"}


def json_schema() -> dict:
    """The spec as a JSON Schema (draft 2020-12): types, bounds, defaults, and no unknown keys.

    >>> json_schema()["properties"]["scaling"]["properties"]["num_nodes"]
    {'type': 'integer', 'minimum': 1, 'maximum': 10000, 'default': 1}
    """
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "raylaunch job spec",
            **_type_schema(JobSpec)}


def _type_schema(tp: Any) -> dict:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        fields = dataclasses.fields(tp)
        out: dict[str, Any] = {"type": "object", "description": " ".join((tp.__doc__ or "").split()),
                               "properties": {field_key(f): _field_schema(f, hints[f.name]) for f in fields},
                               "additionalProperties": False}
        required = [field_key(f) for f in fields
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        return {**out, "required": required} if required else out
    if origin is Literal:
        return {"enum": list(typing.get_args(tp))}
    if origin in (Union, types.UnionType):
        return {"anyOf": [_type_schema(a) for a in typing.get_args(tp)]}
    if origin is list:
        return {"type": "array", "items": _type_schema(typing.get_args(tp)[0])}
    return {"type": _JSON_TYPES[tp]}


def _field_schema(f: dataclasses.Field, tp: Any) -> dict:
    out = _type_schema(tp)
    if "bounds" in f.metadata:  # JSON Schema applies these to numbers only, so "auto" still passes
        low, high, strict = f.metadata["bounds"]
        out.update({"exclusiveMinimum" if strict else "minimum": low, "maximum": high})
    if f.default is not dataclasses.MISSING:
        out["default"] = _spelled(f.default)
    elif f.default_factory is not dataclasses.MISSING and not dataclasses.is_dataclass(tp):
        out["default"] = _spelled(f.default_factory())
    return out
