"""The spec's training strategy where the job is launched: ``accelerate.config_file`` and ``accelerate.fsdp``.

The driver imports neither torch nor Accelerate, so here the ``accelerate config`` file is only
read (``yaml.safe_load``) and checked for what can be told without Accelerate: it is a mapping,
which of its fields the runner sets itself (the launch topology), and whether it asks for
DeepSpeed on CPU nodes. Its meaning is given by Accelerate's own config classes in each rank
(``cluster.strategy``, installed by ``cluster.rank.sharding``); ``validate`` shows the resolved configuration with
the same code.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from cluster.strategy import deepspeed_on_cpu_message
from jobs.spec import JobSpec, SpecError

__all__ = ["TOPOLOGY_KEYS", "AccelerateConfig", "read_accelerate_config"]

# Fields of an ``accelerate config`` file that say how ``accelerate launch`` starts processes:
# the runner sets all of this from ``scaling`` and its own rendezvous.
TOPOLOGY_KEYS = (
    "num_machines", "num_processes", "machine_rank", "main_process_ip", "main_process_port", "rdzv_backend",
    "same_network", "gpu_ids", "use_cpu", "main_training_function", "enable_cpu_affinity", "mpirun_config",
    "tpu_name", "tpu_zone", "tpu_use_cluster", "tpu_use_sudo", "tpu_vm", "tpu_env", "command_file", "commands",
)
_MAX_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class AccelerateConfig:
    """The spec's ``accelerate`` section with its config file's content, as every rank gets it."""

    section: dict  # the spec's ``accelerate`` keys, plus ``config``: the file's mapping (or None)
    ignored: tuple[str, ...]  # topology fields of the file that the runner sets instead

    @property
    def distributed_type(self) -> str:
        """``FSDP``, ``DEEPSPEED`` or ``DDP``, as far as it can be told without Accelerate."""
        file_type = str((self.section.get("config") or {}).get("distributed_type", "")).upper()
        if file_type == "DEEPSPEED":
            return file_type
        return "FSDP" if self.section.get("fsdp") is not None or file_type == "FSDP" else "DDP"

    @property
    def gradient_accumulation_steps(self) -> int:
        """The accumulation every rank starts from: the spec's, or where the spec leaves it at 1, a
        DeepSpeed config file's number (as ``cluster.strategy.resolve`` reads it). An elastic run
        multiplies this one."""
        accum = int(self.section.get("gradient_accumulation_steps", 1))
        config = self.section.get("config") or {}
        from_file = (config.get("deepspeed_config") or {}).get("gradient_accumulation_steps")
        if accum == 1 and self.distributed_type == "DEEPSPEED" and from_file not in (None, "auto"):
            return int(from_file)
        return accum

    def at(self, accumulation: int) -> dict:
        """The section as the ranks get it, at this accumulation (an elastic run's, for its world size)."""
        return {**self.section, "gradient_accumulation_steps": accumulation}

    def note(self) -> str | None:
        """The one line that says which fields of the file are not used, or None."""
        if not self.ignored:
            return None
        return (f"raylaunch: accelerate.config_file: {', '.join(self.ignored)} not used from the file here: the "
                "topology is scaling.* (raylaunch launch reads the file's num_machines and num_processes into it) "
                "and the runner sets up the rendezvous itself")

    def device_problem(self, use_gpu: bool) -> str | None:
        """DeepSpeed needs GPUs: on CPU nodes, why the job cannot run (before any rank starts); else None."""
        return deepspeed_on_cpu_message() if self.distributed_type == "DEEPSPEED" and not use_gpu else None

    def check_devices(self, use_gpu: bool) -> None:
        """``device_problem`` as a ``ValueError``."""
        if problem := self.device_problem(use_gpu):
            raise ValueError(problem)

    def describe(self) -> str:
        """The resolved configuration, as each rank will use it (imports Accelerate: for ``validate``)."""
        from cluster.strategy import resolve

        return resolve(self.section).describe()


def read_accelerate_config(spec: JobSpec, base: str | Path = ".") -> AccelerateConfig:
    """The spec's ``accelerate`` section and its ``config_file`` (a path relative to ``base``, the project folder).

    A file that cannot be read or is not an ``accelerate config`` mapping is a ``SpecError``; so is
    DeepSpeed with ``scaling.use_gpu: false`` (with ``auto`` the driver checks once nodes are placed).
    """
    section: dict[str, Any] = dataclasses.asdict(spec.accelerate)
    section["config"] = None
    path = spec.accelerate.config_file
    ignored: tuple[str, ...] = ()
    if path is not None:
        where = Path(base) / Path(path).expanduser()
        try:
            if where.stat().st_size > _MAX_BYTES:
                raise SpecError([f"accelerate.config_file: {path} is over 1 MiB; an accelerate config file is a "
                                 "few lines of YAML"])
            raw = yaml.safe_load(where.read_text())
        except OSError as exc:
            raise SpecError([f"accelerate.config_file: cannot read {path} ({exc.strerror or exc}); give a path "
                             "relative to the project folder, written by `accelerate config`"]) from None
        except yaml.YAMLError as exc:
            raise SpecError([f"accelerate.config_file: {path} is not YAML: {str(exc)[:300]}"]) from None
        if not isinstance(raw, dict) or "distributed_type" not in raw:
            raise SpecError([f"accelerate.config_file: {path} is not an accelerate config file (a mapping with "
                             "distributed_type, as `accelerate config` writes)"])
        section["config"] = raw
        ignored = tuple(k for k in TOPOLOGY_KEYS if k in raw)
    out = AccelerateConfig(section, ignored)
    if spec.scaling.use_gpu is False:
        try:
            out.check_devices(False)
        except ValueError as exc:
            raise SpecError([f"accelerate.config_file: {exc}"]) from None
    if out.distributed_type == "DEEPSPEED" and spec.accelerate.fsdp is not None:
        raise SpecError(["accelerate.fsdp: the config file asks for DeepSpeed; keep one of the two strategies"])
    if out.distributed_type == "DEEPSPEED" and spec.scaling.elastic_min < spec.scaling.num_nodes:
        raise SpecError([
            f"scaling.min_nodes: {spec.scaling.min_nodes} makes the run elastic, but accelerate.config_file asks for "
            "DeepSpeed, whose ZeRO checkpoints load only at the world size that saved them (another size needs "
            "DeepSpeed's offline ds_to_universal conversion), so the run could not resume after a resize. Replace "
            "the DeepSpeed config file with accelerate.fsdp (its checkpoints load at any world size), or leave "
            "scaling.min_nodes out"])
    return out
