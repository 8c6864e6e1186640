"""Which training strategy a job asked for, as ``accelerate launch`` would tell its processes: FSDP or DeepSpeed
chosen by configuration, never in the code. Pure (no torch import): the driver's ``validate`` and the commit of a
sharded checkpoint use it, and each rank's ``cluster.rank.sharding`` installs what it resolves.

``accelerate launch`` tells its processes the strategy through environment variables
(``ACCELERATE_USE_FSDP``, ``FSDP_*``, ``ACCELERATE_USE_DEEPSPEED``, ``ACCELERATE_DEEPSPEED_*``),
which an unchanged ``Accelerator()`` reads. :func:`strategy_env` makes the same variables with
Accelerate's own machinery: its launch parser gives every setting its default, an ``accelerate
config`` file is read with its config classes, and ``prepare_multi_gpu_env`` /
``prepare_deepspeed_cmd_env`` turn the result into variables, as ``accelerate launch`` does.
:func:`missing_shards` is the commit rule for sharded checkpoints.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import yaml

__all__ = ["FSDP_DEFAULTS", "STRATEGY_PREFIXES", "Resolved", "deepspeed_on_cpu_message", "missing_shards", "resolve",
           "strategy_env"]

# The variables of the strategy that ``accelerate launch`` exports, by prefix.
STRATEGY_PREFIXES = ("ACCELERATE_USE_FSDP", "FSDP_", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_")

# The spec's ``accelerate.fsdp`` keys as the keys of an ``accelerate config`` file's fsdp_config
# (which are ``accelerate launch``'s flags); wrapping and state-dict type are translated below.
_FSDP_KEYS = {
    "version": "fsdp_version",
    "reshard_after_forward": "fsdp_reshard_after_forward",
    "activation_checkpointing": "fsdp_activation_checkpointing",
    "cpu_ram_efficient_loading": "fsdp_cpu_ram_efficient_loading",
    "offload_params": "fsdp_offload_params",
}
_STATE_DICT = {"sharded": "SHARDED_STATE_DICT", "full": "FULL_STATE_DICT"}

# The spec's ``accelerate.fsdp`` defaults (jobs.spec.FsdpSpec takes them from here): FSDP2
# (``fully_shard``), sharded checkpoints, no wrapping beyond the root.
FSDP_DEFAULTS: dict[str, Any] = {
    "version": 2, "reshard_after_forward": True, "state_dict_type": "sharded",
    "transformer_layer_cls_to_wrap": None, "min_num_params": None, "activation_checkpointing": False,
    "cpu_ram_efficient_loading": False, "offload_params": False,
}


def _spec_fsdp_config(fsdp: Mapping[str, Any]) -> dict[str, Any]:
    """The spec's ``accelerate.fsdp`` as an ``accelerate config`` file's ``fsdp_config``."""
    out: dict[str, Any] = {_FSDP_KEYS[k]: v for k, v in fsdp.items() if k in _FSDP_KEYS}
    # Accelerate requires sync_module_states with CPU-RAM-efficient loading (rank 0 loads, others receive).
    out["fsdp_sync_module_states"] = bool(fsdp.get("cpu_ram_efficient_loading"))
    out["fsdp_state_dict_type"] = _STATE_DICT[fsdp.get("state_dict_type", "sharded")]
    if fsdp.get("transformer_layer_cls_to_wrap"):
        out["fsdp_auto_wrap_policy"] = "TRANSFORMER_BASED_WRAP"
        out["fsdp_transformer_layer_cls_to_wrap"] = ",".join(fsdp["transformer_layer_cls_to_wrap"])
    elif fsdp.get("min_num_params"):
        out["fsdp_auto_wrap_policy"] = "SIZE_BASED_WRAP"
        out["fsdp_min_num_params"] = int(fsdp["min_num_params"])
    else:
        out["fsdp_auto_wrap_policy"] = "NO_WRAP"
    return out


@dataclass(frozen=True)
class Resolved:
    """The strategy after the config file and the spec are merged (the spec wins)."""

    distributed_type: str  # "DDP", "FSDP" or "DEEPSPEED"
    mixed_precision: str
    gradient_accumulation_steps: int
    fsdp_config: dict
    deepspeed_config: dict

    def describe(self) -> str:
        """One block for ``validate`` and the driver's log."""
        lines = [f"distributed_type: {self.distributed_type}", f"mixed_precision: {self.mixed_precision}",
                 f"gradient_accumulation_steps: {self.gradient_accumulation_steps}"]
        if self.fsdp_config:
            lines.append("fsdp_config: " + ", ".join(f"{k}={v}" for k, v in sorted(self.fsdp_config.items())))
        if self.deepspeed_config:
            lines.append("deepspeed_config: " + ", ".join(f"{k}={v}" for k, v in sorted(self.deepspeed_config.items())))
        return "\n".join(lines)


def resolve(accelerate: Mapping[str, Any]) -> Resolved:
    """The spec's ``accelerate`` section (as the payload carries it) merged over its config file.

    ``accelerate["config"]`` is the parsed ``accelerate config`` YAML (read where the job was
    launched); it is read here with Accelerate's ``load_config_from_file``, so old files are
    upgraded as ``accelerate launch`` would. A spec key at its default leaves the file's value.
    """
    from accelerate.utils import DistributedType

    file_cfg = None
    if accelerate.get("config"):
        from accelerate.commands.config.config_args import load_config_from_file

        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
            yaml.safe_dump(dict(accelerate["config"]), f)
        try:
            file_cfg = load_config_from_file(f.name)
        finally:
            os.unlink(f.name)
    dtype = "DDP"
    mixed = accelerate.get("mixed_precision", "no")
    accum = int(accelerate.get("gradient_accumulation_steps", 1))
    fsdp: dict[str, Any] = {}
    deepspeed: dict[str, Any] = {}
    if file_cfg is not None:
        if file_cfg.distributed_type == DistributedType.FSDP:
            dtype = "FSDP"
            # A file's keys may leave out the fsdp_ prefix (accelerate launch adds it).
            fsdp = {(k if k.startswith("fsdp_") else f"fsdp_{k}"): v for k, v in (file_cfg.fsdp_config or {}).items()}
        elif file_cfg.distributed_type == DistributedType.DEEPSPEED:
            dtype = "DEEPSPEED"
            deepspeed = dict(file_cfg.deepspeed_config or {})
        if mixed == "no" and file_cfg.mixed_precision not in (None, "no"):
            mixed = str(file_cfg.mixed_precision)
        if accum == 1 and deepspeed.get("gradient_accumulation_steps") not in (None, "auto"):
            accum = int(deepspeed["gradient_accumulation_steps"])
    spec_fsdp = accelerate.get("fsdp")
    if spec_fsdp is not None:
        if dtype == "DEEPSPEED":
            raise ValueError("accelerate.fsdp and a DeepSpeed accelerate.config_file ask for two strategies; "
                             "keep one of them")
        from_spec = _spec_fsdp_config(spec_fsdp)
        defaults = _spec_fsdp_config(FSDP_DEFAULTS)
        for key, value in from_spec.items():
            if key not in fsdp or value != defaults.get(key):
                fsdp[key] = value
        dtype = "FSDP"
    return Resolved(dtype, mixed, accum, fsdp, deepspeed)


def strategy_env(accelerate: Mapping[str, Any], *, use_gpu: bool) -> dict[str, str]:
    """The variables ``accelerate launch`` would give each process for this ``accelerate`` section.

    Precision and accumulation always; the strategy's own variables for FSDP and DeepSpeed.
    DeepSpeed on CPU nodes raises ``ValueError``.
    """
    return _env_for(resolve(accelerate), use_gpu)


def _env_for(r: Resolved, use_gpu: bool) -> dict[str, str]:
    env = {"ACCELERATE_MIXED_PRECISION": r.mixed_precision,
           "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": str(r.gradient_accumulation_steps)}
    if r.distributed_type == "DDP":
        return env
    if r.distributed_type == "DEEPSPEED" and not use_gpu:
        raise ValueError(deepspeed_on_cpu_message())
    from accelerate.commands.launch import launch_command_parser

    flag = "--use_fsdp" if r.distributed_type == "FSDP" else "--use_deepspeed"
    args = launch_command_parser().parse_args(
        [flag, "--mixed_precision", r.mixed_precision, "--num_processes", "1", "--num_machines", "1",
         "--main_process_port", "1", "--dynamo_backend", "no", "x.py"])
    for key, value in (r.fsdp_config if r.distributed_type == "FSDP" else r.deepspeed_config).items():
        setattr(args, key, value)  # as accelerate launch copies a config file's section onto its flags
    if not use_gpu:  # Accelerate loads on rank 0 and broadcasts from its GPU: every rank loads itself on CPU
        args.fsdp_cpu_ram_efficient_loading = args.fsdp_sync_module_states = "false"
        # The parameters are in CPU memory already; asked to offload them, FSDP looks for an accelerator
        args.fsdp_offload_params = "false"
    before = dict(os.environ)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its port check is about its own launcher, not ours
        if r.distributed_type == "FSDP":
            from accelerate.utils.launch import prepare_multi_gpu_env

            made = prepare_multi_gpu_env(args)
        else:
            from accelerate.utils.launch import prepare_deepspeed_cmd_env

            args.gradient_accumulation_steps = r.gradient_accumulation_steps
            # as launch_command does: the fields the config file set (the plugin checks them against its JSON)
            args.deepspeed_fields_from_accelerate_config = ",".join(
                [*r.deepspeed_config, *(["mixed_precision"] if r.mixed_precision != "no" else [])])
            _, made = prepare_deepspeed_cmd_env(args)
    env.update({k: str(v) for k, v in made.items() if k.startswith(STRATEGY_PREFIXES) and before.get(k) != v})
    return env


def deepspeed_on_cpu_message() -> str:
    return ("accelerate.config_file asks for DeepSpeed, which needs GPUs, but this job runs on CPU nodes. "
            "Run it on a cluster with GPUs (scaling.use_gpu: auto or true), or use an FSDP or plain "
            "config file (accelerate.fsdp shards the model on CPU nodes too)")


def missing_shards(files: Iterable[str], world_size: int) -> list[str]:
    """What a sharded checkpoint (PyTorch distributed checkpoint folders) lacks, as ``folder/file``.

    Every folder holding ``.distcp`` files needs its ``.metadata`` (DCP's own commit, written by
    rank 0 once every rank wrote) and a ``__<rank>_*.distcp`` from each of ``world_size`` ranks.

    >>> missing_shards(["m/__0_0.distcp", "m/.metadata"], 2)
    ['m/__1_*.distcp']
    """
    folders: dict[str, set[str]] = {}
    for rel in files:
        folder, _, name = str(rel).rpartition("/")
        folders.setdefault(folder, set()).add(name)
    out = []
    for folder, names in sorted(folders.items()):
        shards = {n for n in names if n.endswith(".distcp")}
        if not shards:
            continue
        prefix = f"{folder}/" if folder else ""
        if ".metadata" not in names:
            out.append(f"{prefix}.metadata")
        out += [f"{prefix}__{r}_*.distcp" for r in range(world_size) if not any(n.startswith(f"__{r}_") for n in shards)]
    return out
