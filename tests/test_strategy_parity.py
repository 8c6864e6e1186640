"""A spec and an `accelerate launch` command with the same options give every rank the same Accelerator.

For FSDP versions 1 and 2 in `no`, `bf16` and `fp16`: the variables raylaunch gives a rank (``cluster.strategy``, the
one path for functions and scripts) against those Accelerate's own launcher computes for the typed command
(``launch_command_parser`` + ``prepare_multi_gpu_env``), for GPU nodes and CPU nodes; and, on CPU, the Accelerator each
builds: distributed type, the FSDP plugin's fields, autocast and the fp16 grad scaler, and the dtype the model's
outputs come back in (FSDP2 in low precision returns low-precision outputs under both launchers: the line
``fsdp2_precision_note`` says, and the reason the first GPU run's MSE model failed, see docs/launch.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import ROOT, cli_env, free_ports

from cluster.strategy import STRATEGY_PREFIXES, resolve, strategy_env

VERSIONS = (1, 2)
PRECISIONS = ("no", "bf16", "fp16")


def section(version: int, precision: str) -> dict:
    """The spec's ``accelerate`` section for ``accelerate: {mixed_precision: P, fsdp: {version: V}}``, as ranks get it."""
    from jobs.spec.load import load_spec_text

    spec = load_spec_text(f"name: p\ntrain_fn: fns:probe\naccelerate: {{mixed_precision: '{precision}', "
                          f"fsdp: {{version: {version}}}}}\n")
    import dataclasses

    return {**dataclasses.asdict(spec.accelerate), "config": None}


def typed(version: int, precision: str) -> list[str]:
    """The same options as a person types them for `accelerate launch` (every FSDP flag spelled out: the spec's
    defaults are sharded state dicts and no CPU-RAM-efficient loading, `accelerate launch`'s full and on)."""
    return ["--use_fsdp", "--fsdp_version", str(version), "--mixed_precision", precision,
            "--fsdp_state_dict_type", "SHARDED_STATE_DICT", "--fsdp_reshard_after_forward", "true",
            "--fsdp_auto_wrap_policy", "NO_WRAP", "--fsdp_cpu_ram_efficient_loading", "false",
            "--fsdp_sync_module_states", "false", "--fsdp_offload_params", "false",
            "--fsdp_activation_checkpointing", "false", "--num_processes", "1", "--num_machines", "1",
            "--main_process_port", "1", "--dynamo_backend", "no", "x.py"]


def launcher_env(version: int, precision: str) -> dict[str, str]:
    """What `accelerate launch` exports to its processes for ``typed(...)``: its own parser and environment builder."""
    from accelerate.commands.launch import launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(typed(version, precision))
    before = dict(os.environ)
    made = prepare_multi_gpu_env(args)
    return {k: str(v) for k, v in made.items()
            if (k.startswith(STRATEGY_PREFIXES) or k == "ACCELERATE_MIXED_PRECISION") and before.get(k) != v}


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_on_gpu_nodes_a_rank_gets_exactly_the_variables_accelerate_launch_exports(version, precision):
    ours = strategy_env(section(version, precision), use_gpu=True)
    ours.pop("ACCELERATE_GRADIENT_ACCUMULATION_STEPS")  # accelerate launch leaves it out at its default, 1
    assert ours == launcher_env(version, precision)


PROBE = r"""
import json, os, sys
mode, version, precision, port = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                  LOCAL_WORLD_SIZE="1", ACCELERATE_USE_CPU="true")
sys.path[:0] = [os.environ["RL_ROOT"], os.environ["RL_TESTS"]]
from test_strategy_parity import launcher_env, section
if mode == "ours":  # what a rank of a spec's job does before the function's Accelerator()
    from cluster.rank import sharding
    sharding.install(section(version, precision), use_gpu=False)
else:  # accelerate launch's variables; on a GPU-like device its state keeps the plugin and sets its precision
    os.environ.update(launcher_env(version, precision))
import torch
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin
accelerator = Accelerator()
plugin = getattr(accelerator.state, "fsdp_plugin", None)
if plugin is None:
    plugin = FullyShardedDataParallelPlugin()
    if precision != "no":
        plugin.set_mixed_precision(precision)
out = {"native_amp": accelerator.native_amp, "scaler": type(accelerator.scaler).__name__,
       "mixed_precision": accelerator.mixed_precision, "distributed_type": str(accelerator.distributed_type),
       "fsdp": {"version": plugin.fsdp_version, "sharding_strategy": str(plugin.sharding_strategy),
                "reshard_after_forward": str(plugin.reshard_after_forward),
                "mixed_precision_policy": repr(plugin.mixed_precision_policy),
                "auto_wrap_policy": getattr(plugin.auto_wrap_policy, "__name__", str(plugin.auto_wrap_policy)),
                "state_dict_type": str(plugin.state_dict_type), "sync_module_states": plugin.sync_module_states,
                "cpu_ram_efficient_loading": plugin.cpu_ram_efficient_loading,
                "activation_checkpointing": plugin.activation_checkpointing, "cpu_offload": repr(plugin.cpu_offload)}}
if mode == "ours":
    model = accelerator.prepare(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)))
    out["output_dtype"] = str(model(torch.randn(3, 4)).dtype)
print(json.dumps(out))
"""


def test_on_cpu_nodes_the_accelerator_is_the_one_accelerate_launch_builds(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    env = {**cli_env(), "RL_ROOT": str(ROOT), "RL_TESTS": str(ROOT / "tests"), "HF_HOME": str(tmp_path / "hf")}
    # bf16 and fp16 (every plugin field of "no" is in theirs too; each case costs a process importing torch)
    precisions = [p for p in PRECISIONS if p != "no"]
    cases = [(mode, v, p) for v in VERSIONS for p in precisions for mode in ("ours", "theirs")]
    ports = free_ports(len(cases))

    def probe(case_port):
        (mode, v, p), port = case_port
        done = subprocess.run([sys.executable, str(script), mode, str(v), p, str(port)], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stderr[-3000:]
        return (mode, v, p), json.loads(done.stdout.strip().splitlines()[-1]), done.stderr

    with ThreadPoolExecutor(2) as pool:
        got = {case: (state, err) for case, state, err in pool.map(probe, zip(cases, ports))}
    for v in VERSIONS:
        for p in precisions:
            (ours, said), (theirs, _) = got[("ours", v, p)], got[("theirs", v, p)]
            # On CPUs Accelerate itself drops the plugin and trains DDP (MULTI_CPU); raylaunch shards
            assert (ours.pop("distributed_type"), theirs.pop("distributed_type")) == (
                "DistributedType.FSDP", "DistributedType.MULTI_CPU"), (v, p)
            dtype = ours.pop("output_dtype")
            assert ours == theirs, (v, p, ours, theirs)
            low = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}.get(p)
            # what a loss computed outside the model meets: FSDP2 gives the low precision back; FSDP1 float32 (its
            # autocast), except fp16 on CPUs, where Accelerate has no fp16 autocast (on GPUs it has: float32)
            assert dtype == (low if low and (v == 2 or p == "fp16") else "torch.float32"), (v, p, dtype)
            assert ("raylaunch: FSDP2 in" in said) == bool(v == 2 and low), (v, p, said)
    assert got[("ours", 2, "bf16")][0]["fsdp"]["mixed_precision_policy"].startswith(
        "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16")
    assert got[("ours", 1, "bf16")][0]["native_amp"] is True  # autocast in bf16 on CPU, as Accelerate does


def test_the_fsdp2_line_states_both_defaults_as_they_are():
    """The line rank 0 says names the spec's default version (2) and accelerate launch's (1): both read from the code."""
    from accelerate.commands.launch import launch_command_parser

    from cluster.rank.sharding import fsdp2_precision_note
    from jobs.spec.load import load_spec_text

    spec_default = load_spec_text("name: p\ntrain_fn: fns:probe\naccelerate: {fsdp: {}}\n").accelerate.fsdp.version
    theirs = launch_command_parser().parse_args(["--use_fsdp", "x.py"]).fsdp_version
    note = fsdp2_precision_note(resolve(section(2, "bf16")))
    assert f"accelerate.fsdp.version {spec_default}, the spec's default" in note
    assert f"`accelerate launch --use_fsdp` defaults to {theirs})" in note
    assert fsdp2_precision_note(resolve(section(1, "bf16"))) is None
    assert fsdp2_precision_note(resolve(section(2, "no"))) is None
