"""The training strategy in a rank: the variables ``cluster.strategy`` resolves from the spec and its ``accelerate
config`` file, set before the function's ``Accelerator()`` reads them.

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
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from cluster import patches
from cluster.rank.prepared import after_prepare
from cluster.strategy import Resolved, _env_for, resolve

__all__ = ["ShardInfo", "fsdp2_precision_note", "install", "shard_info"]


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
        if rank == 0 and (note := fsdp2_precision_note(r)):
            print(note, file=sys.stderr, flush=True)
        _report_shards(rank, world)
    return r


def fsdp2_precision_note(r: Resolved) -> str | None:
    """What FSDP2 in bf16 or fp16 changes for a training function, in one line; None otherwise.

    Accelerate's FSDP2 path (``fully_shard`` with a ``MixedPrecisionPolicy``) computes in the low precision and
    returns the model's outputs in it; DDP and FSDP1 wrap the forward in autocast and return float32 outputs. A loss
    against float32 targets computed outside the model (``mse_loss(model(x), y)``) then fails on a GPU in backward
    ("Found dtype Float but expected BFloat16"; CPU kernels let it pass). ``accelerate launch --use_fsdp
    --fsdp_version 2`` gives the same Accelerator (tests/test_strategy_parity.py); its ``--use_fsdp`` alone gives
    version 1, the spec's ``accelerate.fsdp`` version 2."""
    if r.distributed_type != "FSDP" or r.mixed_precision not in ("bf16", "fp16"):
        return None
    if str(r.fsdp_config.get("fsdp_version", 2)) != "2":
        return None
    return (f"raylaunch: FSDP2 in {r.mixed_precision} (accelerate.fsdp.version 2, the spec's default; `accelerate "
            f"launch --use_fsdp` defaults to 1): the model's outputs are {r.mixed_precision}, not float32 as under DDP "
            "or FSDP1, so a loss against float32 targets computed outside the model fails in backward on GPUs; cast "
            "the outputs (`model(x).float()`) or set accelerate.fsdp.version: 1")


def _fsdp_on_cpu() -> None:
    """After ``AcceleratorState`` is built with an FSDP plugin on a CPU node, take its FSDP path.

    Accelerate (1.x) sets ``distributed_type = FSDP`` and keeps the plugin only for GPU-like
    devices; this does the same two assignments for ``MULTI_CPU``, in both shared states (an
    ``Accelerator`` reads ``AcceleratorState``; ``PartialState()`` reads its own). Idempotent.
    """
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    shared = "accelerate.state.PartialState._shared_state"

    def make(original: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(original)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            plugin = kwargs.get("fsdp_plugin")
            if plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
                if self.mixed_precision != "no":
                    plugin.set_mixed_precision(self.mixed_precision)
                self.fsdp_plugin = plugin
                self.distributed_type = DistributedType.FSDP
                patches.write(PartialState._shared_state, "distributed_type", DistributedType.FSDP, shared)
                if getattr(plugin, "fsdp_version", 1) == 1:
                    # Accelerate's multi-CPU device is "cpu:0", which FSDP1 passes on as device_id;
                    # FSDP1 computes on "cpu" and refuses the pair ("Inconsistent compute device").
                    import torch

                    self.device = torch.device("cpu")
                    patches.write(PartialState._shared_state, "device", self.device, shared)
                    _fsdp1_full_state_on_cpu()

        return __init__

    patches.replace(AcceleratorState, "__init__", make, "accelerate.state.AcceleratorState.__init__")


def _fsdp1_full_state_on_cpu() -> None:
    """FSDP1's full state dict with ``offload_to_cpu`` crashes the process when the parameters are on
    the CPU already (torch 2.13: SIGSEGV in its post-state-dict hook, or "setStorage ... out of bounds"
    with ``use_orig_params=False``); Accelerate asks for it in ``get_state_dict`` and for
    ``state_dict_type: full`` saves. On a CPU node the offload is a copy onto the same device, so
    the configs are passed on without it. Idempotent."""
    import dataclasses

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def set_state_dict_type(module: Any, state_dict_type: Any, state_dict_config: Any = None,
                                optim_state_dict_config: Any = None) -> Any:
            configs = [c if not getattr(c, "offload_to_cpu", False) else dataclasses.replace(c, offload_to_cpu=False)
                       for c in (state_dict_config, optim_state_dict_config)]
            return original(module, state_dict_type, *configs)

        return set_state_dict_type

    patches.replace(FSDP, "set_state_dict_type", make,
                    "torch.distributed.fsdp.FullyShardedDataParallel.set_state_dict_type")


def _report_shards(rank: int, world: int) -> None:
    """After ``Accelerator.prepare``: say how much of each new model this rank holds; fail if nothing is sharded.

    After ``prepare`` (``cluster.rank.prepared``), not ``prepare_model``, which Accelerate's FSDP2 path bypasses.
    """

    def report(accelerator: Any, models: list[Any]) -> None:
        for model in models:
            info = shard_info(model)
            if world > 1 and not info.sharded:
                raise RuntimeError(
                    f"FSDP was asked for, but Accelerate prepared the model as {type(model).__name__} "
                    f"({accelerator.distributed_type}) on rank {rank}: nothing is sharded. This Accelerate version "
                    "may not take its FSDP path here; please report it with the output of `pip show accelerate torch`")
            print(info.describe(rank, world), file=sys.stderr, flush=True)

    after_prepare("shards", report)
