"""`raylaunch launch`: an `accelerate launch` script, unchanged, on the shared two-node Ray cluster (gloo on CPU).

The digits example as a script (train_fn/digits_script.py: argparse, main(), save_state every N steps,
--resume_from_checkpoint) trains on 2 nodes x 1 and 1 node x 2; a rank killed after a commit restarts the
script with the resume flag and ends bitwise equal to an uninterrupted run. A top-level script's exit codes,
the options Accelerate's parser reads, and what a rank's Accelerator sees against `accelerate launch` itself.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import psutil
import pytest

from conftest import ROOT, cli_env, free_ports, our_processes, our_stacks, wait_for
from cluster.layout import checkpoint_name
from jobs.driver.driver import Driver
from jobs.spec.launch import parse

SCRIPT = "train_fn/digits_script.py"
# A save_state every 3 steps (3, 6, and 8 at the end). A script of Accelerate's examples' shape resumed in its second
# epoch drew the first epoch's order again (Accelerate keeps no state of a shuffling loader's generator), so its model
# differed from an uninterrupted run's under any launcher; raylaunch keeps where each epoch's order came from
# (cluster.checkpoint.resume.epoch_begins): the snapshot test below resumes in the second epoch or at its end. Dropout
# 0.3: the resumed steps draw the same masks as the uninterrupted run's (#48: they did not, under raylaunch as under
# accelerate launch).
TRAIN = ["--epochs", "2", "--train_samples", "128", "--checkpointing_steps", "3", "--dropout", "0.3"]
STEPS = 8  # 128 images / 16 per batch / 2 ranks = 4 steps an epoch


def launch(argv: list[str], storage: Path, name: str, **kw):
    """The spec `raylaunch launch ARGV` builds, run by a driver on the shared cluster."""
    cmd = parse("launch", ["--storage", str(storage), "--name", name, *argv])
    return Driver(cmd.spec(), can_grow=False, **kw)


def digits(storage: Path, name: str, topology: list[str], out: Path, extra: list[str] = (),
           terminal: io.StringIO | None = None):
    return launch([*topology, "--set", "failure.max_restarts=1", SCRIPT, *TRAIN, "--output_dir", str(out), *extra],
                  storage, name, out=terminal)


def rows(run_dir: str) -> list[dict]:
    return [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]


def rank_process(rank: int, attempt: int = 1) -> psutil.Process | None:
    """A running rank process (forked by its node's warm rank host, so found by the events file it holds open).
    Only this test process's own descendants and its raylets' warm hosts are looked at (``our_processes``):
    scanning every process of a busy machine took seconds, and the run could end meanwhile."""
    mine = f"/attempt-{attempt}/events-rank{rank}.jsonl"
    for p in our_processes():
        try:
            if any(f.path.endswith(mine) for f in p.open_files()):
                return p
        except psutil.Error:
            continue
    return None


def killed_when(driver: Driver, ready, what: str):
    """The run, with rank 1 SIGKILLed once ``ready()``; its result."""
    box: dict = {}
    thread = threading.Thread(target=lambda: box.setdefault("result", driver.run()))
    thread.start()
    try:
        try:
            victim = wait_for(lambda: rank_process(1), 120, "rank 1's process")  # found before: killed at once
            wait_for(ready, 120, what)
        except AssertionError as exc:  # where it hung, for a failure seen once in CI (the driver waiting on a start)
            raise AssertionError(f"{exc}\n{our_stacks()}") from None
        victim.kill()
    finally:
        thread.join(300)
    return box["result"]


@pytest.fixture(scope="module")
def uninterrupted(ray_cluster, tmp_path_factory):
    """The example on 2 nodes x 1, start to end: the reference the other runs must equal bit for bit."""
    tmp = tmp_path_factory.mktemp("launch")
    said = io.StringIO()
    result = digits(tmp / "runs", "straight", ["--num_machines", "2", "--num_processes", "2"], tmp / "out",
                    terminal=said).run()
    (tmp / "straight.out").write_text(said.getvalue())  # what the terminal showed
    assert result.status == "succeeded", result.error
    return result, tmp


def test_a_script_on_two_nodes_logs_from_every_rank_and_commits_its_save_state(uninterrupted):
    result, tmp = uninterrupted
    assert result.attempts == 1 and result.world_size == 2
    metrics = rows(result.run_dir)
    for rank in (0, 1):  # accelerator.log without log_with, from both ranks
        losses = [r for r in metrics if r["rank"] == rank and "loss" in r]
        assert [r["step"] for r in losses] == list(range(1, STEPS + 1)), rank
    assert [r["eval_accuracy"] for r in metrics if "eval_accuracy" in r and r["rank"] == 0]
    committed = sorted(p.name for p in Path(result.run_dir, "checkpoints").iterdir() if p.is_dir())
    assert committed == ["checkpoint-00000006", "checkpoint-00000008"]  # step_<n>'s n; checkpoint.keep 2
    manifest = json.loads(Path(result.run_dir, "checkpoints", "checkpoint-00000008", "manifest.json").read_text())
    assert manifest["step"] == 8 and "model.safetensors" in manifest["files"]
    # The folders the script asked for hold the same files (the script's result.json beside them).
    mine = tmp / "out" / "step_8"
    assert (mine / "model.safetensors").read_bytes() == \
        Path(result.run_dir, "checkpoints", "checkpoint-00000008", "model.safetensors").read_bytes()
    assert sorted(p.name for p in (tmp / "out").iterdir()) == ["result.json", "step_3", "step_6",
                                                               "step_8"]
    assert json.loads((tmp / "out" / "result.json").read_text())["steps"] == STEPS
    # ... and nothing of raylaunch's own (#48: a raylaunch-script.json was in every step_N)
    assert sorted(p.name for p in mine.iterdir()) == sorted(
        n for n in manifest["files"] if n != "raylaunch-script.json"), sorted(p.name for p in mine.iterdir())
    # Accelerate's own log line names the staging folder it wrote; raylaunch's names the script's folder (#48)
    said = (tmp / "straight.out").read_text()
    assert f"raylaunch: committed checkpoint of step 8: {result.run_dir}/checkpoints/checkpoint-00000008 (the " \
           f"script's save_state('{tmp / 'out' / 'step_8'}'); training held " in said, said[-3000:]


def test_a_rank_killed_after_a_commit_resumes_the_script_with_the_flag_and_ends_bitwise_equal(uninterrupted):
    reference, tmp = uninterrupted
    out = tmp / "out-killed"
    driver = digits(tmp / "runs", "killed", ["--num_machines", "2", "--num_processes", "2"], out,
                    ["--throttle_s", "0.6"])
    result = killed_when(driver, Path(driver.run_dir.uri, "checkpoints", "latest.json").exists,
                         "the first committed checkpoint")
    assert result.status == "succeeded", result.error
    assert result.attempts == 2 and result.restarts == 1
    assert json.loads(Path(result.run_dir, "result.json").read_text())["status"] == "succeeded"
    logs = "\n".join(p.read_text() for p in Path(result.run_dir, "logs").rglob("*") if p.is_file())
    assert "Resumed from checkpoint: " in logs and "/step_" in logs.split("Resumed from checkpoint: ", 1)[1][:300]
    second = sorted({r["step"] for r in rows(result.run_dir) if r["attempt"] == 2 and "loss" in r})
    assert second and second[-1] == STEPS and second[0] > 2  # went on after a committed step, not from 1
    assert json.loads((out / "result.json").read_text())["weights"] == \
        json.loads((tmp / "out" / "result.json").read_text())["weights"]
    final = "checkpoints/checkpoint-00000008/model.safetensors"
    assert Path(result.run_dir, final).read_bytes() == Path(reference.run_dir, final).read_bytes()


def test_a_rank_killed_between_commits_resumes_the_script_from_a_snapshot_in_memory_bitwise_equal(uninterrupted):
    """Three epochs of 4 steps, commits at 6 and 12, snapshots every step: rank 1 is killed once every rank's part of
    step 7 is held. The restart hands the script `--resume_from_checkpoint <node folder>/step_<n>` put together from
    the nodes' memory (its save_state's files, named as it names its folders) at 7 to 11 (inside the second epoch, at
    its end, or inside the third); the script's own resume reads the step from the name, loads it and skips the
    epoch's batches seen, and the weights are the uninterrupted run's. (Commits every 3 steps left the kill 0.5 s
    before the commit of step 9: the driver hears of a snapshot held about 1.5 s after its step on a quiet machine,
    and a CI machine under load heard of it after that commit, so the restart rightly resumed from storage at 9.)"""
    _, tmp = uninterrupted
    three = [*TRAIN, "--epochs", "3", "--checkpointing_steps", "6"]
    topology = ["--num_machines", "2", "--num_processes", "2", "--set", "failure.max_restarts=1"]
    whole = launch([*topology, "--set", "checkpoint.snapshots.every=0", SCRIPT, *three, "--output_dir",
                    str(tmp / "out-three")], tmp / "runs", "three").run()
    assert whole.status == "succeeded", whole.error
    out, said = tmp / "out-snapshot", io.StringIO()
    driver = launch([*topology, "--set", "checkpoint.snapshots.every=1", SCRIPT, *three, "--output_dir", str(out),
                     "--throttle_s", "1"], tmp / "runs", "snapshot", out=said)
    result = killed_when(driver, lambda: driver.snapshots is not None and any(
        s >= 7 and len(r) == 2 for s, r in list(driver.snapshots.held.items())), "the snapshot of step 7")
    assert result.status == "succeeded", result.error
    assert result.attempts == 2 and result.restarts == 1
    events = [json.loads(line) for line in Path(result.run_dir, "events.jsonl").read_text().splitlines()]
    start = [e for e in events if e["kind"] == "attempt"][-1]
    # (what the driver said of the restart first: why it resumed from storage, if it did)
    assert start["resume_from"] == "memory" and 7 <= start["resume_step"] <= 11, (
        [line for line in said.getvalue().splitlines() if "resum" in line], start)
    assert f"/step_{start['resume_step']} (the checkpoint of step {start['resume_step']})" in said.getvalue()
    second = sorted({r["step"] for r in rows(result.run_dir) if r["attempt"] == 2 and "loss" in r})
    assert second == list(range(start["resume_step"] + 1, 13)), second
    assert json.loads((out / "result.json").read_text())["weights"] == \
        json.loads((tmp / "out-three" / "result.json").read_text())["weights"]


def test_one_node_with_two_processes_trains_the_same_weights_as_two_nodes(uninterrupted):
    reference, tmp = uninterrupted
    result = digits(tmp / "runs", "one-node", ["--num_processes", "2"], tmp / "out-1x2").run()
    assert result.status == "succeeded", result.error
    assert len(result.nodes) == 1 and result.world_size == 2
    assert json.loads((tmp / "out-1x2" / "result.json").read_text())["weights"] == \
        json.loads((tmp / "out" / "result.json").read_text())["weights"]


TOP_LEVEL = """
import atexit, json, logging.handlers, os, sys
from accelerate import Accelerator

accelerator = Accelerator()
rank, run = accelerator.process_index, "fails" if "--fail" in sys.argv else "ok"
seen = {"name": __name__, "argv": sys.argv, "file": __file__, "path0": sys.path[0], "cwd": os.getcwd()}
with open(f"seen-rank{rank}.json", "w") as f:
    json.dump(seen, f)
# What python's end does for a script: its atexit handlers run (on sys.exit too), logging is shut down (a memory
# handler writes what it held), and a file left open is written.
atexit.register(lambda: open(f"atexit-{run}-rank{rank}.txt", "w").write("ran"))
held = logging.handlers.MemoryHandler(100, target=logging.FileHandler(f"held-{run}-rank{rank}.log"))
logging.getLogger("top").addHandler(held)
logging.getLogger("top").warning("held until logging shuts down")
left_open = open(f"open-{run}-rank{rank}.txt", "w")
left_open.write("never closed")
accelerator.log({"rank_was": accelerator.process_index}, step=1)
if "--fail" in sys.argv and accelerator.process_index == 1:
    sys.exit(3)
accelerator.end_training()
"""


def test_a_top_level_script_runs_as_python_would_and_its_exit_code_fails_its_rank(ray_cluster, tmp_path, monkeypatch):
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "src" / "top.py").write_text(TOP_LEVEL)
    monkeypatch.chdir(project)  # the job's working directory: the folder raylaunch runs from
    ok = launch(["--num_processes", "2", "src/top.py", "--lr", "3e-4", "--name", "x"], tmp_path / "runs", "top").run()
    assert ok.status == "succeeded", ok.error
    for rank in (0, 1):
        seen = json.loads((project / f"seen-rank{rank}.json").read_text())
        assert seen["name"] == "__main__"
        assert seen["argv"] == [str(project / "src" / "top.py"), "--lr", "3e-4", "--name", "x"]  # untouched
        assert seen["file"] == str(project / "src" / "top.py") and seen["path0"] == str(project / "src")
        assert seen["cwd"] == str(project)
    assert sorted(r["rank_was"] for r in rows(ok.run_dir) if "rank_was" in r) == [0, 1]
    failed = launch(["--num_processes", "2", "src/top.py", "--fail"], tmp_path / "runs", "top-fails").run()
    assert failed.status == "failed"
    assert "[rank 1]" in failed.error and "exited with code 3" in failed.error, failed.error
    # as python ends a script (the rank ends with os._exit, which would skip all three): both runs, every rank
    for run, rank in itertools.product(("ok", "fails"), (0, 1)):
        assert (project / f"atexit-{run}-rank{rank}.txt").read_text() == "ran"
        assert (project / f"held-{run}-rank{rank}.log").read_text() == "held until logging shuts down\n"
        assert (project / f"open-{run}-rank{rank}.txt").read_text() == "never closed"


def test_accelerate_options_become_spec_keys_and_the_others_name_what_to_use(tmp_path):
    spec = parse("launch", ["--num_machines", "2", "--num_processes", "4", "--mixed_precision", "bf16",
                            "--gradient_accumulation_steps", "2", "--cpu", "--main_process_port", "29500",
                            "--use_fsdp", "--fsdp_version", "2", "--fsdp_state_dict_type", "FULL_STATE_DICT",
                            "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP",
                            "--fsdp_transformer_layer_cls_to_wrap", "BertLayer,BertEmbeddings",
                            "--fsdp_reshard_after_forward", "false", "--fsdp_activation_checkpointing", "true",
                            "--max_restarts", "2", "train.py", "--num_processes", "9"])
    s = spec.spec()
    # accelerate launch's restarts after a failure (torchrun's): the restarts a failure of the code may use
    assert (s.failure.max_restarts, s.failure.max_infra_restarts) == (2, 3)
    assert parse("launch", ["t.py"]).spec().failure.max_restarts == 0
    assert (s.scaling.num_nodes, s.scaling.workers_per_node, s.scaling.use_gpu) == (2, 2, False)
    assert (s.accelerate.mixed_precision, s.accelerate.gradient_accumulation_steps) == ("bf16", 2)
    f = s.accelerate.fsdp
    assert (f.version, f.state_dict_type, f.reshard_after_forward, f.activation_checkpointing) == (2, "full", False, True)
    assert f.transformer_layer_cls_to_wrap == ["BertLayer", "BertEmbeddings"]
    assert (s.script, s.args, s.resume_arg) == ("train.py", ["--num_processes", "9"], "--resume_from_checkpoint")
    # the run's name: the script's, and a hash of its arguments (the same command resumes, others start anew)
    assert s.name.startswith("train-") and s.name == parse("launch", ["train.py", "--num_processes", "9"]).spec().name
    assert parse("launch", ["train.py", "--num_processes", "8"]).spec().name != s.name
    assert any("--main_process_port: not needed" in n for n in spec.notes)
    # --cpu with several processes: accelerate launch runs one (its single-process launcher); raylaunch says what
    # it does instead, before anything starts (#48)
    assert [n for n in spec.notes if n.startswith("--cpu with --num_processes 4: accelerate launch would start a "
                                                  "single process") and "raylaunch starts 4 ranks on CPUs, 2 per "
                                                  "node" in n]
    assert not [n for n in parse("launch", ["--cpu", "--num_processes", "1", "t.py"]).notes if "--cpu" in n]
    # --use_fsdp alone is Accelerate's default FSDP: version 1, full state dicts
    f1 = parse("launch", ["--use_fsdp", "t.py"]).spec().accelerate.fsdp
    assert (f1.version, f1.state_dict_type) == (1, "full")
    # a config file gives the topology and the rest, as accelerate launch reads it
    (tmp_path / "acc.yaml").write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\n"
                                       "num_machines: 2\nnum_processes: 2\nmixed_precision: bf16\nuse_cpu: true\n")
    c = parse("launch", ["--config_file", str(tmp_path / "acc.yaml"), "t.py"]).spec()
    assert (c.scaling.num_nodes, c.scaling.workers_per_node, c.scaling.use_gpu) == (2, 1, False)
    assert c.accelerate.config_file == str(tmp_path / "acc.yaml")
    # ... where neither the command nor --spec gives one
    (tmp_path / "spec.yaml").write_text("name: big\nscaling: {num_nodes: 4, workers_per_node: 8}\n")
    b = parse("launch", ["--spec", str(tmp_path / "spec.yaml"), "--config_file", str(tmp_path / "acc.yaml"),
                         "t.py"]).spec()
    assert (b.name, b.scaling.num_nodes, b.scaling.workers_per_node) == ("big", 4, 8)


def test_an_unknown_accelerate_option_is_refused_naming_the_spec_key_before_anything_starts(tmp_path):
    (tmp_path / "train.py").write_text("raise SystemExit('must not run')\n")
    proc = subprocess.run([sys.executable, "-m", "jobs.cli", "launch", "--num_cpu_threads_per_process", "4",
                           "--monitor_interval", "3", "--zero_stage", "2", "--storage", str(tmp_path / "runs"),
                           "train.py"], cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "--num_cpu_threads_per_process: not an option of raylaunch launch; use scaling.cpus_per_worker" in proc.stderr
    assert "--monitor_interval: not an option of raylaunch launch, and not needed: the runner watches" in proc.stderr
    assert "--zero_stage: not an option of raylaunch launch; put it in accelerate.config_file" in proc.stderr
    assert not (tmp_path / "runs").exists()  # nothing started, no run directory
    wrong = subprocess.run([sys.executable, "-m", "jobs.cli", "validate", "--num_processes", "2", "nope.py"],
                           cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert wrong.returncode == 2 and "script 'nope.py': no such file in the working directory" in wrong.stderr
    (tmp_path / "with_flag.py").write_text("import argparse\np = argparse.ArgumentParser()\n"
                                           "p.add_argument('--resume_from_checkpoint')\n")
    ok = subprocess.run([sys.executable, "-m", "jobs.cli", "validate", "--num_processes", "2", "with_flag.py"],
                        cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "1 nodes x 2 workers, script with_flag.py" in ok.stdout and "(it reads that option: argparse" in ok.stdout


PROBE = """
import json, os, sys
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin

accelerator = Accelerator()
state = {"distributed_type": str(accelerator.distributed_type), "num_processes": accelerator.num_processes,
         "mixed_precision": accelerator.mixed_precision,
         "gradient_accumulation_steps": accelerator.gradient_accumulation_steps,
         "dynamo_backend": str(accelerator.state.dynamo_plugin.backend)}
if os.environ.get("ACCELERATE_USE_FSDP") == "true":
    plugin = getattr(accelerator.state, "fsdp_plugin", None) or FullyShardedDataParallelPlugin()
    state["fsdp"] = {"version": plugin.fsdp_version, "reshard_after_forward": str(plugin.reshard_after_forward),
                     "state_dict_type": str(plugin.state_dict_type), "activation_checkpointing":
                     plugin.activation_checkpointing, "transformer_cls_names_to_wrap":
                     plugin.transformer_cls_names_to_wrap, "auto_wrap_policy": getattr(plugin.auto_wrap_policy,
                     "__name__", str(plugin.auto_wrap_policy)), "min_num_params": plugin.min_num_params}
with open(os.path.join(sys.argv[1], f"state-rank{accelerator.process_index}.json"), "w") as f:
    json.dump(state, f)
# Every rank past gloo's init before any ends: with no collective of its own, a rank that ended at once failed the
# other's init under accelerate launch ("Connection closed by peer": CI, 2026-12-05; raylaunch's ranks pass a
# barrier after init themselves).
accelerator.wait_for_everyone()
accelerator.end_training()
"""

# On one machine with CPUs only, `accelerate launch --multi_gpu` with ACCELERATE_USE_CPU (what raylaunch sets on
# CPU nodes, and what `--cpu` sets for accelerate launch's single process) starts torchrun's processes on gloo.
OPTION_SETS = {
    "ddp": ["--multi_gpu", "--num_processes", "2", "--mixed_precision", "bf16", "--dynamo_backend", "no"],
    "fsdp": ["--use_fsdp", "--num_processes", "2", "--fsdp_version", "2", "--fsdp_state_dict_type",
             "FULL_STATE_DICT", "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP",
             "--fsdp_transformer_layer_cls_to_wrap", "BertLayer", "--fsdp_reshard_after_forward", "false",
             "--fsdp_activation_checkpointing", "true", "--mixed_precision", "bf16"],
}


@pytest.mark.parametrize("options", sorted(OPTION_SETS))
def test_a_rank_sees_what_accelerate_launch_gives_for_the_same_options(ray_cluster, tmp_path, monkeypatch, options):
    argv = OPTION_SETS[options]
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "theirs").mkdir()
    (tmp_path / "ours").mkdir()
    env = {**cli_env(), "ACCELERATE_USE_CPU": "true", "HF_HOME": str(tmp_path / "hf")}  # no saved config file
    port = free_ports(1)[0]
    accelerate = shutil.which("accelerate", path=os.path.dirname(sys.executable))
    theirs = subprocess.run([accelerate, "launch", "--main_process_port", str(port), *argv, "probe.py",
                             str(tmp_path / "theirs")], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=240)
    assert theirs.returncode == 0, theirs.stderr[-3000:]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    ours = launch([*argv, "probe.py", str(tmp_path / "ours")], tmp_path / "runs", f"probe-{options}").run()
    assert ours.status == "succeeded", ours.error
    for rank in (0, 1):
        a = json.loads((tmp_path / "theirs" / f"state-rank{rank}.json").read_text())
        b = json.loads((tmp_path / "ours" / f"state-rank{rank}.json").read_text())
        if options == "fsdp":
            # On CPUs Accelerate itself trains FSDP's plugin as DDP; raylaunch shards (docs/launch.md).
            assert (a["distributed_type"], b["distributed_type"]) == ("DistributedType.MULTI_CPU",
                                                                      "DistributedType.FSDP")
            a.pop("distributed_type"), b.pop("distributed_type")
        assert b == a, (rank, a, b)
        assert b["num_processes"] == 2


def test_the_runners_save_leaves_accelerates_automatic_checkpoint_naming_as_the_script_set_it(tmp_path):
    """A script with automatic_checkpoint_naming: its own folders are numbered and pruned as Accelerate does,
    and the committed checkpoint beside them lands where the runner puts it."""
    code = textwrap.dedent("""
        import json, os, sys
        import torch
        from accelerate import Accelerator
        from accelerate.utils import ProjectConfiguration
        from cluster.checkpoint.staged import _save_state
        config = ProjectConfiguration(project_dir=sys.argv[1], automatic_checkpoint_naming=True, total_limit=5)
        accelerator = Accelerator(cpu=True, project_config=config)
        model = torch.nn.Linear(2, 2)
        model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        accelerator.save_state()
        _save_state(accelerator, sys.argv[2], 1)
        accelerator.save_state()
        print(json.dumps([sorted(os.listdir(os.path.join(sys.argv[1], "checkpoints"))), sorted(os.listdir(sys.argv[2]))]))
    """)
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "p"), str(tmp_path / "staged")],
                          cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    mine, staged = json.loads(proc.stdout.strip().splitlines()[-1])
    assert mine == ["checkpoint_0", "checkpoint_1"]  # the runner's save in between was not counted
    assert "model.safetensors" in staged and "random_states_0.pkl" in staged


ACCUMULATING = """
import json, sys
import torch
from accelerate import Accelerator

accelerator = Accelerator(gradient_accumulation_steps=3)
before = accelerator.gradient_accumulation_steps
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.utils.data.TensorDataset(torch.randn(24, 4), torch.randn(24, 1))
loader = torch.utils.data.DataLoader(data, batch_size=1)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
after = accelerator.gradient_accumulation_steps
for x, y in loader:  # 12 micro-batches a rank: 4 optimizer steps at 3
    with accelerator.accumulate(model):
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
accelerator.save_state(sys.argv[1] + "/epoch_0")  # no step in the folder's name: the optimizer steps taken
if accelerator.is_main_process:
    json.dump({"before": before, "after": after}, open(sys.argv[1] + "/seen.json", "w"))
accelerator.end_training()
"""


def test_a_scripts_own_accumulation_is_kept_and_its_optimizer_steps_number_its_checkpoint(ray_cluster, tmp_path,
                                                                                          monkeypatch):
    """A script that sets gradient_accumulation_steps in code keeps it over the launch's (said once), and a
    save_state to a folder whose name has no step is committed at the optimizer steps the script took."""
    (tmp_path / "acc.py").write_text(ACCUMULATING)
    monkeypatch.chdir(tmp_path)
    said = io.StringIO()
    result = launch(["--num_processes", "2", "--gradient_accumulation_steps", "2", "acc.py", str(tmp_path)],
                    tmp_path / "runs", "acc", out=said).run()
    assert result.status == "succeeded", result.error
    assert json.loads((tmp_path / "seen.json").read_text()) == {"before": 3, "after": 3}
    text = said.getvalue()
    assert text.count("the script sets gradient_accumulation_steps=3 in its code; it is used instead of the "
                      "launch's 2") == 1, text[-3000:]
    committed = sorted(p.name for p in Path(result.run_dir, "checkpoints").iterdir() if p.is_dir())
    assert committed == [checkpoint_name(4)], committed
