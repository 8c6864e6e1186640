"""Sharded training chosen by configuration: accelerate.fsdp, accelerate.config_file, DeepSpeed.

Pure tests first (the spec, the variables Accelerate reads, the commit rule for shards), then
real FSDP runs on the shared two-node Ray cluster (gloo, CPU): sharded, committed with every
rank's shards, resumed exactly (from local disk and from an S3 bucket), and resumed at another world size.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from cluster.strategy import missing_shards, resolve, strategy_env
from conftest import ROOT, cli_env, committed_step, wait_for
from jobs.driver.driver import Driver
from jobs.driver.policy import world_sizes
from jobs.run.storage import CheckpointError, RunDir
from jobs.spec import SpecError, load_spec, load_spec_text
from jobs.spec.strategy import read_accelerate_config

MINIMAL = "name: t\ntrain_fn: fns:sharded\n"

# What `accelerate config` writes for FSDP on one machine (Accelerate 1.x), topology included.
FSDP_CONFIG = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
fsdp_config:
  fsdp_activation_checkpointing: false
  fsdp_auto_wrap_policy: SIZE_BASED_WRAP
  fsdp_min_num_params: 100
  fsdp_cpu_ram_efficient_loading: true
  fsdp_sync_module_states: true
  fsdp_offload_params: false
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_version: 2
machine_rank: 0
main_training_function: main
mixed_precision: {precision}
num_machines: 1
num_processes: 8
rdzv_backend: static
same_network: true
use_cpu: false
"""

DEEPSPEED_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  gradient_accumulation_steps: 4
  offload_optimizer_device: none
  zero_stage: 2
mixed_precision: bf16
num_machines: 1
num_processes: 2
"""


def section(spec_text: str, tmp_path: Path):
    return read_accelerate_config(load_spec_text(spec_text), base=tmp_path)


# --- the spec and the variables -------------------------------------------------------------


def test_fsdp_in_the_spec_is_checked_like_every_key():
    spec = load_spec_text(MINIMAL + "accelerate: {fsdp: {}}\n")
    assert spec.accelerate.fsdp.version == 2 and spec.accelerate.fsdp.state_dict_type == "sharded"
    assert load_spec_text(MINIMAL).accelerate.fsdp is None  # absent: plain data parallel
    with pytest.raises(SpecError) as info:
        load_spec_text(MINIMAL + "accelerate:\n  fsdp: {reshard_after_foward: false, version: 3}\n")
    assert info.value.problems == [
        "accelerate.fsdp.reshard_after_foward: unknown key; did you mean 'reshard_after_forward'?",
        "accelerate.fsdp.version: expected 1 or 2, got an integer 3",
    ]
    with pytest.raises(SpecError) as info:
        load_spec_text(MINIMAL + "accelerate: {fsdp: {transformer_layer_cls_to_wrap: [BertLayer], min_num_params: 9}}\n")
    assert "keep one of them" in info.value.problems[0]


def test_spec_fsdp_becomes_the_variables_accelerate_launch_exports(monkeypatch):
    spec = load_spec_text(MINIMAL + "accelerate:\n  fsdp: {transformer_layer_cls_to_wrap: [BertLayer],"
                          " state_dict_type: full, activation_checkpointing: true}\n")
    import dataclasses

    env = strategy_env(dataclasses.asdict(spec.accelerate), use_gpu=False)
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_VERSION"] == "2"
    assert env["FSDP_AUTO_WRAP_POLICY"] == "TRANSFORMER_BASED_WRAP"
    assert env["FSDP_TRANSFORMER_CLS_TO_WRAP"] == "BertLayer"
    assert env["FSDP_STATE_DICT_TYPE"] == "FULL_STATE_DICT"
    assert env["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "false"
    offload = dataclasses.replace(spec.accelerate, fsdp=dataclasses.replace(spec.accelerate.fsdp, offload_params=True))
    assert strategy_env(dataclasses.asdict(offload), use_gpu=True)["FSDP_OFFLOAD_PARAMS"] == "true"
    assert strategy_env(dataclasses.asdict(offload), use_gpu=False)["FSDP_OFFLOAD_PARAMS"] == "false"
    # Accelerate's own plugin, built from the environment as an unchanged Accelerator() builds it
    from accelerate.utils import FullyShardedDataParallelPlugin

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and plugin.activation_checkpointing is True
    assert plugin.transformer_cls_names_to_wrap == ["BertLayer"]
    assert "FULL_STATE_DICT" in str(plugin.state_dict_type)
    # without fsdp: only precision and accumulation, nothing of a strategy
    plain = strategy_env(dataclasses.asdict(load_spec_text(MINIMAL).accelerate), use_gpu=False)
    assert plain == {"ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "1"}


def test_a_config_file_is_honoured_and_the_spec_wins_where_both_set(tmp_path):
    (tmp_path / "fsdp.yaml").write_text(FSDP_CONFIG.format(precision="bf16"))
    cfg = section(MINIMAL + "accelerate: {config_file: fsdp.yaml}\n", tmp_path)
    assert cfg.ignored == ("num_machines", "num_processes", "machine_rank", "rdzv_backend", "same_network",
                           "use_cpu", "main_training_function")
    assert cfg.note().startswith("raylaunch: accelerate.config_file: num_machines, num_processes,")
    r = resolve(cfg.section)
    assert (r.distributed_type, r.mixed_precision) == ("FSDP", "bf16")
    assert r.fsdp_config["fsdp_auto_wrap_policy"] == "SIZE_BASED_WRAP" and r.fsdp_config["fsdp_min_num_params"] == 100
    # the spec's own keys win: precision, and an fsdp key set away from its default
    cfg = section(MINIMAL + "accelerate: {config_file: fsdp.yaml, mixed_precision: fp16,"
                  " fsdp: {state_dict_type: full}}\n", tmp_path)
    r = resolve(cfg.section)
    assert r.mixed_precision == "fp16"
    assert r.fsdp_config["fsdp_state_dict_type"] == "FULL_STATE_DICT"
    assert r.fsdp_config["fsdp_auto_wrap_policy"] == "SIZE_BASED_WRAP"  # left at its default in the spec
    env = strategy_env(cfg.section, use_gpu=True)
    assert env["FSDP_MIN_NUM_PARAMS"] == "100" and env["ACCELERATE_MIXED_PRECISION"] == "fp16"
    assert env["FSDP_CPU_RAM_EFFICIENT_LOADING"] == env["FSDP_SYNC_MODULE_STATES"] == "true"
    # on CPU nodes every rank loads the weights itself (Accelerate would broadcast from rank 0's GPU)
    cpu = strategy_env(cfg.section, use_gpu=False)
    assert cpu["FSDP_CPU_RAM_EFFICIENT_LOADING"] == cpu["FSDP_SYNC_MODULE_STATES"] == "false"
    # a file that is not there, or not an accelerate config, is a spec error naming the key
    with pytest.raises(SpecError, match=r"accelerate.config_file: cannot read nope.yaml"):
        section(MINIMAL + "accelerate: {config_file: nope.yaml}\n", tmp_path)
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(SpecError, match="is not an accelerate config file"):
        section(MINIMAL + "accelerate: {config_file: list.yaml}\n", tmp_path)


def test_deepspeed_passes_through_on_gpu_nodes_and_is_refused_on_cpu_nodes(tmp_path):
    (tmp_path / "ds.yaml").write_text(DEEPSPEED_CONFIG)
    with pytest.raises(SpecError, match="asks for DeepSpeed, which needs GPUs"):
        section(MINIMAL + "accelerate: {config_file: ds.yaml}\nscaling: {use_gpu: false}\n", tmp_path)
    cfg = section(MINIMAL + "accelerate: {config_file: ds.yaml}\n", tmp_path)  # use_gpu: auto
    with pytest.raises(ValueError, match="Run it on a cluster with GPUs"):
        cfg.check_devices(use_gpu=False)
    cfg.check_devices(use_gpu=True)
    env = strategy_env(cfg.section, use_gpu=True)
    assert env["ACCELERATE_USE_DEEPSPEED"] == "true"
    assert env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "2"
    assert env["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] == "4" and env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    with pytest.raises(SpecError, match="keep one of the two strategies"):
        section(MINIMAL + "accelerate: {config_file: ds.yaml, fsdp: {}}\n", tmp_path)


def test_an_elastic_deepspeed_run_is_refused_where_it_is_launched_and_a_fixed_size_keeps_the_files_accumulation(tmp_path):
    """DeepSpeed's ZeRO checkpoints load only at the world size that saved them: an elastic spec with
    DeepSpeed is refused by validate and by submit (before anything is sent), naming what to change.
    At a fixed size the file's accumulation is the one every rank gets."""
    (tmp_path / "ds.yaml").write_text(DEEPSPEED_CONFIG.replace("gradient_accumulation_steps: 4",
                                                               "gradient_accumulation_steps: 3"))
    text = MINIMAL + "accelerate: {config_file: ds.yaml}\nscaling: {num_nodes: 4, min_nodes: 1}\n"
    with pytest.raises(SpecError, match=r"ZeRO checkpoints load only at the world size that saved them.*"
                                        r"Replace the DeepSpeed config file with accelerate\.fsdp.*or leave scaling\.min_nodes out"):
        section(text, tmp_path)
    (tmp_path / "job.yaml").write_text(text.replace("fns:sharded", "train_fn.digits:train"))
    for verb in (["validate", "job.yaml"], ["submit", "job.yaml", "--address", "http://127.0.0.1:1"]):
        done = subprocess.run([sys.executable, "-m", "jobs.cli", *verb], cwd=tmp_path, env=cli_env(),
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 2 and "scaling.min_nodes: 1 makes the run elastic" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr and "submitted" not in done.stdout
    fixed = section(text.replace(", min_nodes: 1", ""), tmp_path)
    assert fixed.gradient_accumulation_steps == 3
    sizes = world_sizes(load_spec_text(text.replace(", min_nodes: 1", "")).scaling, 1, fixed.gradient_accumulation_steps)
    assert [(w.nodes, w.accumulation) for w in sizes] == [(4, 3)]
    assert strategy_env(fixed.at(sizes[0].accumulation), use_gpu=True)["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] == "3"
    # the spec's own accumulation wins over the file's, as everywhere
    assert section(text.replace(", min_nodes: 1", "").replace("config_file: ds.yaml", "config_file: ds.yaml, "
                   "gradient_accumulation_steps: 2"), tmp_path).gradient_accumulation_steps == 2


def test_validate_prints_the_resolved_configuration(tmp_path):
    (tmp_path / "fsdp.yaml").write_text(FSDP_CONFIG.format(precision="'no'"))
    (tmp_path / "job.yaml").write_text("name: t\ntrain_fn: train_fn.digits:train\n"
                                       "accelerate: {config_file: fsdp.yaml, fsdp: {version: 1}}\n")
    done = subprocess.run([sys.executable, "-m", "jobs.cli", "validate", "job.yaml"], cwd=tmp_path, env=cli_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "accelerate.config_file: num_machines, num_processes" in done.stdout
    assert "distributed_type: FSDP" in done.stdout
    assert "fsdp_version=1" in done.stdout and "fsdp_min_num_params=100" in done.stdout


# --- the commit rule for shards ------------------------------------------------------------------


def test_a_sharded_checkpoint_commits_only_with_every_ranks_shards_and_its_metadata(tmp_path):
    assert missing_shards(["model.safetensors", "random_states_0.pkl"], 2) == []  # not sharded
    assert missing_shards(["m/__0_0.distcp", "m/__1_0.distcp"], 2) == ["m/.metadata"]
    run = RunDir(str(tmp_path), "r")
    run.prepare({"name": "r"})
    staging = Path(run.files.path(run.staging_uri(1))) / "checkpoint-00000004"
    for rel in ["random_states_0.pkl", "random_states_1.pkl", "pytorch_model_fsdp_0/__0_0.distcp",
                "pytorch_model_fsdp_0/.metadata"]:
        (staging / rel).parent.mkdir(parents=True, exist_ok=True)
        (staging / rel).write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"lacks pytorch_model_fsdp_0/__1_\*.distcp; it was not committed"):
        run.checkpoints.commit(run.staging_uri(1) + "/checkpoint-00000004", 4, 1, 2, keep=2)
    assert run.checkpoints.committed() == []


# --- real FSDP on two Ray nodes ------------------------------------------------------------------

SHARDED = """
name: {name}
train_fn: fns:sharded
config: {{steps: {steps}, every: 4{extra}}}
scaling: {{num_nodes: {nodes}, workers_per_node: {workers}, cpus_per_worker: {cpus}}}
failure: {{max_restarts: 1}}
storage: {storage}
accelerate: {accelerate}
"""


def run(name, storage, *, steps, nodes=2, workers=1, cpus=1, extra="", accelerate="{fsdp: {}}", cwd=None):
    out = io.StringIO()
    text = SHARDED.format(name=name, steps=steps, nodes=nodes, workers=workers, cpus=cpus, extra=extra,
                          storage=storage, accelerate=accelerate)
    old = os.getcwd()
    os.chdir(cwd or old)  # the config file is read relative to where the job is launched
    try:
        result = Driver(load_spec_text(text), can_grow=False, out=out).run()
    finally:
        os.chdir(old)
    assert result.status == "succeeded", result.error + out.getvalue()[-3000:]
    return result, out.getvalue()


def manifest(storage, name, step) -> dict:
    return json.loads((Path(storage) / name / "checkpoints" / f"checkpoint-{step:08d}" / "manifest.json").read_text())


@pytest.fixture(scope="module")
def whole(ray_cluster, tmp_path_factory):
    """An uninterrupted FSDP run of 12 steps on local disk: the subject of the first test below and the reference
    that the killed runs below (after step 4's commit, on local disk and on the bucket; during step 8's background
    write) must end bitwise equal to."""
    storage = tmp_path_factory.mktemp("whole")
    result, log = run("whole", storage, steps=12)
    return result, log, storage


def test_fsdp_from_the_spec_shards_commits_every_shard_and_resumes_exactly(whole, tmp_path):
    whole, log, storage = whole
    ranks = whole.rank_results
    assert len(ranks) == 2  # every rank's result, before the checks over them
    assert {r["distributed_type"] for r in ranks.values()} == {"DistributedType.FSDP"}
    assert {r["model_class"] for r in ranks.values()} == {"FSDPSequential"}
    total = ranks["0"]["total_params"]
    assert sum(r["local_params"] for r in ranks.values()) == total  # each holds its half, nothing twice
    assert all(abs(r["local_params"] - total / 2) <= total * 0.05 for r in ranks.values())
    assert f"rank 1: model sharded with FSDP over 2 ranks: this rank holds {ranks['1']['local_params']:,} " \
           f"of {total:,} parameters" in log
    files = manifest(storage, "whole", 12)["files"]
    for folder in ("pytorch_model_fsdp_0", "optimizer_0"):
        assert {f"{folder}/__0_0.distcp", f"{folder}/__1_0.distcp", f"{folder}/.metadata"} <= set(files)
    assert RunDir(str(storage), "whole").checkpoints.loadable().step == 12  # every byte matches its manifest

    # killed after the commit of step 4, resumed there: the same weights and optimizer state, bit for bit
    cut, _ = run("cut", tmp_path, steps=12, extra=", fail_at: 4")
    assert cut.restarts == 1
    assert cut.rank_results["0"]["restored_step"] == 4
    assert cut.rank_results["0"]["final"] == ranks["0"]["final"]


def test_fsdp_sharded_checkpoints_on_the_bucket_commit_every_shard_and_a_killed_rank_resumes_exactly(whole):
    """FSDP's sharded state (DCP files, written in the background) on an object store (tests/test_object_storage.py's
    S3 server): every rank's shards are committed under one manifest, a rank killed after step 4's commit resumes
    from it on the bucket, and the run ends bitwise equal to an uninterrupted one on local disk (``whole``)."""
    from test_object_storage import s3_server

    whole, _, _ = whole
    with s3_server() as s3:
        result, out = run("s3fsdp", s3.uri("runs"), steps=12, extra=", fail_at: 4")
        assert result.restarts == 1 and result.rank_results["0"]["restored_step"] == 4, out[-3000:]
        for rank in "01":
            assert result.rank_results[rank]["final"] == whole.rank_results[rank]["final"]  # model and optimizer
        files = json.loads(s3.read("runs/s3fsdp/checkpoints/checkpoint-00000012/manifest.json"))["files"]
        for folder in ("pytorch_model_fsdp_0", "optimizer_0"):
            assert {f"{folder}/__0_0.distcp", f"{folder}/__1_0.distcp", f"{folder}/.metadata"} <= set(files)
        assert not [k for k in s3.keys("runs/s3fsdp") if "/.staging/" in k]


def test_fsdp_shards_are_written_in_the_background_and_a_rank_killed_meanwhile_resumes_exactly(whole, tmp_path):
    """checkpoint.async (the default) with FSDP's sharded state: DCP's collectives run in the save, its files are
    held in memory and written beside training (slow storage: every file the background thread writes with
    torch.save waits 2 s). Rank 0 killed while its shards of step 8 are being written: step 8 is never committed,
    the run resumes from step 4 and ends bitwise equal to an uninterrupted run (``whole``)."""
    whole, _, _ = whole
    marks = tmp_path / "marks"
    spec = load_spec_text(SHARDED.format(name="held", storage=tmp_path, steps=12, nodes=2, workers=1, cpus=1,
                                         extra=f", write_delay_s: 2.0, marks: {marks}", accelerate="{fsdp: {}}"),
                          ["train_fn=fns:sharded_slow_writes"])
    out = io.StringIO()
    driver = Driver(spec, can_grow=False, out=out)
    box: dict = {}
    thread = threading.Thread(target=lambda: box.setdefault("result", driver.run()))
    thread.start()
    try:
        mark = wait_for(lambda: (marks / "returned-a1-r0-s8").exists() and marks / "returned-a1-r0-s8", 240,
                        "rank 0's save of step 8 to return")
        said = json.loads(mark.read_text())
        assert said["written"] is False  # the save returned before this rank's files were on storage
        wait_for(lambda: committed_step(tmp_path / "held") is not None, 30, "the commit of step 4")
        assert committed_step(tmp_path / "held") == 4  # step 8's write still runs
        os.kill(said["pid"], signal.SIGKILL)
    finally:
        thread.join(300)
    result = box["result"]
    assert result.status == "succeeded", result.error + out.getvalue()[-3000:]
    assert result.restarts == 1 and result.rank_results["0"]["restored_step"] == 4
    assert "checkpoint-00000004 (step 4)" in out.getvalue()
    for rank in "01":
        assert result.rank_results[rank]["final"] == whole.rank_results[rank]["final"]  # bitwise, model and optimizer
    files = manifest(tmp_path, "held", 12)["files"]
    for folder in ("pytorch_model_fsdp_0", "optimizer_0"):
        assert {f"{folder}/__0_0.distcp", f"{folder}/__1_0.distcp", f"{folder}/.metadata"} <= set(files)
    assert RunDir(str(tmp_path), "held").checkpoints.loadable().step == 12
    rows = [json.loads(l) for l in (tmp_path / "held" / "metrics.jsonl").read_text().splitlines()]
    held = {(r["rank"], r["step"]): r for r in rows if "checkpoint_blocked_s" in r and r["attempt"] == 2}
    assert sorted(held) == [(0, 8), (0, 12), (1, 8), (1, 12)]
    assert all(r["checkpoint_host_mb"] > 0 for r in held.values()), held  # the shards were held in memory


def test_a_run_that_asked_for_fsdp_and_would_train_ddp_fails_saying_so(ray_cluster, tmp_path):
    """Accelerate prepared the model for DDP although the spec asked for FSDP: every rank fails at
    ``prepare``, naming what it got, before a step is trained."""
    spec = load_spec_text(SHARDED.format(name="undone", storage=tmp_path, steps=1, nodes=2, workers=1, cpus=1,
                                         extra="", accelerate="{fsdp: {}}"),
                          ["train_fn=fns:fsdp_undone", "failure.max_restarts=0"])
    result = Driver(spec, can_grow=False, out=io.StringIO()).run()
    assert result.status == "failed" and result.rank_results == {}, result.rank_results
    for rank in (0, 1):  # (the class named is the user's module: Accelerate keeps it unwrapped for DDP)
        assert re.search(rf"RuntimeError: FSDP was asked for, but Accelerate prepared the model as \w+ "
                         rf"\(DistributedType.MULTI_CPU\) on rank {rank}: nothing is sharded", result.error), result.error
    assert json.loads((tmp_path / "undone" / "result.json").read_text())["status"] == "failed"


def test_fsdp1_shards_saves_its_full_state_and_resumes_exactly_on_cpu_nodes(ray_cluster, tmp_path):
    """FSDP1 (`version: 1`) on CPU nodes: Accelerate's device "cpu:0" was refused by FSDP1 ("Inconsistent
    compute device"), and its full state dict crashed the rank (SIGSEGV) when offloading to the CPU
    it was on. Trains sharded, saves full checkpoints, resumes bit for bit, gathers the model; and
    from sharded checkpoints (the default) resumes bit for bit too: Accelerate loaded an FSDP1 sharded
    optimizer into the state of an optimizer that never stepped, so Adam's moments were lost."""
    acc = "{fsdp: {version: 1, state_dict_type: full}}"
    whole, log = run("v1", tmp_path, steps=8, accelerate=acc, extra=", gather: true")
    ranks = whole.rank_results
    assert len(ranks) == 2
    assert {r["model_class"] for r in ranks.values()} == {"FullyShardedDataParallel"}
    total = ranks["0"]["total_params"]
    assert sum(r["local_params"] for r in ranks.values()) == total
    assert "rank 1: model sharded with FSDP over 2 ranks" in log
    assert ranks["0"]["gathered"] is not None and ranks["1"]["gathered"] is None  # rank 0 gets the whole model
    assert RunDir(str(tmp_path), "v1").checkpoints.loadable().step == 8
    for state in ("full", "sharded"):
        cut, _ = run(f"v1-cut-{state}", tmp_path, steps=8, accelerate=acc.replace("full", state),
                     extra=", gather: true, fail_at: 4")
        assert cut.restarts == 1 and cut.rank_results["0"]["restored_step"] == 4
        assert cut.rank_results["0"]["final"] == ranks["0"]["final"], state
        assert cut.rank_results["0"]["gathered"] == ranks["0"]["gathered"], state


def test_a_sharded_checkpoint_from_a_config_file_resumes_at_another_world_size(ray_cluster, tmp_path):
    (tmp_path / "fsdp.yaml").write_text(FSDP_CONFIG.format(precision="'no'"))
    acc = "{config_file: fsdp.yaml}"
    two, log = run("grow", tmp_path, steps=4, accelerate=acc, cwd=tmp_path)
    assert "accelerate.config_file: num_machines, num_processes" in log
    assert "fsdp_cpu_ram_efficient_loading is off on CPU nodes" in log
    assert two.rank_results["0"]["distributed_type"] == "DistributedType.FSDP"
    # 2 -> 3 ranks: the model and optimizer are resharded; rank 2 had no RNG state and gets a defined one
    three, log = run("grow", tmp_path, steps=8, nodes=1, workers=3, cpus=0.5, accelerate=acc, cwd=tmp_path)
    r = three.rank_results
    assert [r[k]["restored_step"] for k in "012"] == [4, 4, 4]
    assert r["0"]["loaded"] == two.rank_results["0"]["final"]
    assert r["2"]["rng_seed"] == 4 * 1000 + 2 and "rank 2: the checkpoint of step 4 has no RNG state" in log
    assert "over 3 ranks" in log
    assert manifest(tmp_path, "grow", 8)["world_size"] == 3
    # 3 -> 2 ranks
    back, _ = run("grow", tmp_path, steps=12, accelerate=acc, cwd=tmp_path)
    assert back.rank_results["0"]["restored_step"] == 8
    assert back.rank_results["0"]["loaded"] == r["0"]["final"]


def test_the_transformers_example_trains_with_fsdp_by_changing_only_the_spec(ray_cluster, tmp_path):
    spec = load_spec(ROOT / "jobs/examples/digits.yaml", [
        "accelerate.fsdp={transformer_layer_cls_to_wrap: [BertLayer], offload_params: true}", f"storage={tmp_path}",
        "config.epochs=1", "config.train_samples=128", "config.batch_size=16"])
    out = io.StringIO()
    result = Driver(spec, can_grow=False, out=out).run()
    assert result.status == "succeeded", result.error
    assert result.world_size == 2 and result.rank_results["0"]["steps"] == 4
    assert "model sharded with FSDP over 2 ranks" in out.getvalue()
    # a spec written for GPUs runs on CPU nodes: offloading to the CPU is left out there, and said
    # (FSDP asked to offload failed every rank: "Cannot access accelerator device")
    assert "fsdp_offload_params is off on CPU nodes" in out.getvalue()
    files = manifest(tmp_path, spec.name, 4)["files"]
    assert {"pytorch_model_fsdp_0/__0_0.distcp", "pytorch_model_fsdp_0/__1_0.distcp"} <= set(files)
