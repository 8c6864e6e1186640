"""The training strategy in a rank: FSDP or DeepSpeed chosen by configuration, never in the code.

``accelerate launch`` tells its processes the strategy through environment variables
(``ACCELERATE_USE_FSDP``, ``FSDP_*``, ``ACCELERATE_USE_DEEPSPEED``, ``ACCELERATE_DEEPSPEED_*``),
which an unchanged ``Accelerator()`` reads. :func:`strategy_env` makes the same variables with
Accelerate's own machinery: its launch parser gives every setting its default, an ``accelerate
config`` file is read with its config classes, and ``prepare_multi_gpu_env`` /
``prepare_deepspeed_cmd_env`` turn the result into variables, as ``accelerate launch`` does.

On CPU nodes Accelerate takes its FSDP path only for GPU-like devices and silently trains
plain DDP instead; torch's ``fully_shard`` works on CPU with gloo. :func:`install` therefore
completes, on CPU nodes only, the step Accelerate's state skips for CPUs (the distributed type
becomes FSDP and the plugin is kept), exactly as it does on GPUs, and checks after ``prepare``
that the model really is sharded: a run that asked for FSDP never trains DDP without saying so.
Each rank says how much of the model it holds.

Runs in the rank (torch and Accelerate are already imported there), never in the driver.
"""

from __future__ import annotations

import functools
import os
import sys
import tempfile
import warnings
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import yaml

from cluster.layout import rank_part_file

__all__ = ["FSDP_DEFAULTS", "STRATEGY_PREFIXES", "Resolved", "deepspeed_on_cpu_message", "init_optimizers_for_load", "missing_shards", "seed_missing_rng", "ShardInfo", "install", "resolve", "shard_info", "strategy_env"]

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


def seed_missing_rng(files: Iterable[str], rank: int, step: int) -> int | None:
    """A defined RNG state for a rank that the checkpoint has none for (it was saved by fewer ranks).

    Accelerate's ``load_state`` then leaves the rank's RNGs as they were; this seeds Python's,
    NumPy's and torch's with ``step * 1000 + rank`` (``accelerate.utils.set_seed``) and says so.
    Returns the seed, or None when the checkpoint holds the rank's own state.
    """
    if rank_part_file(rank) in set(files):
        return None
    from accelerate.utils import set_seed

    seed = step * 1000 + rank
    set_seed(seed)
    print(f"raylaunch: rank {rank}: the checkpoint of step {step} has no RNG state for this rank (it was saved by "
          f"fewer ranks); its RNGs are seeded with {seed} (step * 1000 + rank)", file=sys.stderr, flush=True)
    return seed


@dataclass(frozen=True)
class ShardInfo:
    """How much of a prepared model one rank holds."""

    local_params: int
    total_params: int
    local_bytes: int
    sharded: bool

    def describe(self, rank: int, world: int) -> str:
        share = self.local_params / self.total_params if self.total_params else 0.0
        size = f"{self.local_bytes / 1e6:.1f} MB" if self.local_bytes >= 1e5 else f"{self.local_bytes / 1e3:.1f} kB"
        return (f"raylaunch: rank {rank}: model sharded with FSDP over {world} ranks: this rank holds "
                f"{self.local_params:,} of {self.total_params:,} parameters ({share:.1%}, {size})")


def shard_info(model: Any) -> ShardInfo:
    """Parameters (and bytes) this rank holds of ``model``: FSDP2's ``DTensor`` shards or FSDP1's flat ones."""
    from torch.distributed.tensor import DTensor

    local = total = nbytes = 0
    sharded = False
    for p in model.parameters():
        if isinstance(p, DTensor):
            sharded = True
            mine = p.to_local()
            local += mine.numel()
            nbytes += mine.numel() * mine.element_size()
            total += p.numel()
        else:
            local += p.numel()
            nbytes += p.numel() * p.element_size()
            total += p.numel()
    if not sharded:  # FSDP1 flattens the parameters; its module knows the unsharded count
        try:
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

            handles = [m for m in model.modules() if isinstance(m, FSDP1)]
        except ImportError:
            handles = []
        if handles:
            sharded = True
            total = sum(int(h._flat_param._unpadded_unsharded_size.numel()) for h in handles
                        if getattr(h, "_flat_param", None) is not None) or total
    return ShardInfo(local, total, nbytes, sharded)


def install(accelerate: Mapping[str, Any], *, use_gpu: bool, rank: int = 0, world: int = 1) -> Resolved:
    """Set this rank's precision, accumulation and strategy variables; on CPU nodes make
    Accelerate's FSDP path reachable. Returns the resolved strategy."""
    r = resolve(accelerate)
    env = _env_for(r, use_gpu)
    os.environ.update(env)
    if env.get("ACCELERATE_USE_FSDP") == "true":
        if not use_gpu:
            if str(r.fsdp_config.get("fsdp_cpu_ram_efficient_loading")).lower() == "true" and rank == 0:
                print("raylaunch: fsdp_cpu_ram_efficient_loading is off on CPU nodes (Accelerate broadcasts rank 0's "
                      "weights from its GPU): every rank loads the weights itself", file=sys.stderr, flush=True)
            if str(r.fsdp_config.get("fsdp_offload_params")).lower() == "true" and rank == 0:
                print("raylaunch: fsdp_offload_params is off on CPU nodes: the parameters are in CPU memory already "
                      "(FSDP would look for a GPU to compute on); it takes effect on GPU nodes", file=sys.stderr,
                      flush=True)
            _fsdp_on_cpu()
        _report_shards(rank, world)
    return r


def _fsdp_on_cpu() -> None:
    """After ``AcceleratorState`` is built with an FSDP plugin on a CPU node, take its FSDP path.

    Accelerate (1.x) sets ``distributed_type = FSDP`` and keeps the plugin only for GPU-like
    devices; this does the same two assignments for ``MULTI_CPU``, in both shared states (an
    ``Accelerator`` reads ``AcceleratorState``; ``PartialState()`` reads its own). Idempotent.
    """
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    if getattr(AcceleratorState.__init__, "_raylaunch_fsdp", False):
        return
    original = AcceleratorState.__init__

    @functools.wraps(original)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        plugin = kwargs.get("fsdp_plugin")
        if plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            if self.mixed_precision != "no":
                plugin.set_mixed_precision(self.mixed_precision)
            self.fsdp_plugin = plugin
            self.distributed_type = DistributedType.FSDP
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            if getattr(plugin, "fsdp_version", 1) == 1:
                # Accelerate's multi-CPU device is "cpu:0", which FSDP1 passes on as device_id;
                # FSDP1 computes on "cpu" and refuses the pair ("Inconsistent compute device").
                import torch

                self.device = PartialState._shared_state["device"] = torch.device("cpu")
                _fsdp1_full_state_on_cpu()

    __init__._raylaunch_fsdp = True  # type: ignore[attr-defined]
    AcceleratorState.__init__ = __init__


def _fsdp1_full_state_on_cpu() -> None:
    """FSDP1's full state dict with ``offload_to_cpu`` crashes the process when the parameters are on
    the CPU already (torch 2.13: SIGSEGV in its post-state-dict hook, or "setStorage ... out of bounds"
    with ``use_orig_params=False``); Accelerate asks for it in ``get_state_dict`` and for
    ``state_dict_type: full`` saves. On a CPU node the offload is a copy onto the same device, so
    the configs are passed on without it. Idempotent."""
    import dataclasses

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if getattr(FSDP.set_state_dict_type, "_raylaunch_cpu", False):
        return
    original = FSDP.set_state_dict_type

    def set_state_dict_type(module: Any, state_dict_type: Any, state_dict_config: Any = None,
                            optim_state_dict_config: Any = None) -> Any:
        configs = [c if not getattr(c, "offload_to_cpu", False) else dataclasses.replace(c, offload_to_cpu=False)
                   for c in (state_dict_config, optim_state_dict_config)]
        return original(module, state_dict_type, *configs)

    set_state_dict_type._raylaunch_cpu = True  # type: ignore[attr-defined]
    FSDP.set_state_dict_type = staticmethod(set_state_dict_type)


def init_optimizers_for_load(accelerator: Any) -> None:
    """Before ``load_state`` under FSDP1 with sharded checkpoints: give every optimizer its state.

    Accelerate reads an FSDP1 sharded optimizer checkpoint into ``FSDP.optim_state_dict(model,
    optimizer)`` of the optimizer as it is; one that never stepped (every resume) has no state
    there, so nothing of it was loaded and training went on with fresh Adam moments, without a word
    (a resumed run diverged from an uninterrupted one). torch's own initialisation for its
    state-dict API (a step with zero gradients and learning rate 0) makes the state to load into.
    FSDP2 and full checkpoints load without it."""
    from accelerate.utils import DistributedType

    plugin = getattr(getattr(accelerator, "state", None), "fsdp_plugin", None)
    if (getattr(accelerator, "distributed_type", None) != DistributedType.FSDP or plugin is None
            or getattr(plugin, "fsdp_version", 1) != 1 or "FULL" in str(plugin.state_dict_type)):
        return
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    for optimizer in accelerator._optimizers:
        _init_optim_state(getattr(optimizer, "optimizer", optimizer))


def _report_shards(rank: int, world: int) -> None:
    """After ``Accelerator.prepare``: say how much of each new model this rank holds; fail if nothing is sharded.

    ``prepare`` is wrapped (not ``prepare_model``, which Accelerate's FSDP2 path bypasses).
    """
    from accelerate import Accelerator

    if getattr(Accelerator.prepare, "_raylaunch_report", False):
        return
    original = Accelerator.prepare

    @functools.wraps(original)
    def prepare(self: Any, *args: Any, **kwargs: Any) -> Any:
        seen = {id(m) for m in self._models}
        out = original(self, *args, **kwargs)
        for model in [m for m in self._models if id(m) not in seen]:
            info = shard_info(model)
            if world > 1 and not info.sharded:
                raise RuntimeError(
                    f"FSDP was asked for, but Accelerate prepared the model as {type(model).__name__} "
                    f"({self.distributed_type}) on rank {rank}: nothing is sharded. This Accelerate version may "
                    "not take its FSDP path here; please report it with the output of `pip show accelerate torch`")
            print(info.describe(rank, world), file=sys.stderr, flush=True)
        return out

    prepare._raylaunch_report = True  # type: ignore[attr-defined]
    Accelerator.prepare = prepare
