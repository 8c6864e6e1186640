"""transformers' Trainer, unchanged, under `raylaunch launch` on the shared two-node Ray cluster (gloo on CPU).

tests/trainer_script.py is a script in the shape of transformers' examples (HfArgumentParser over TrainingArguments,
`trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)`, a 2-layer GPT-2 with dropout from a
config, data made there). Its checkpoint-<n> folders become committed checkpoints, its logs the run's metrics at
Trainer's global step; a killed rank and a stop notice resume it through Trainer's own resume, bitwise equal to an
uninterrupted run, and the same weights come out as under `accelerate launch`.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from conftest import ROOT, wait_for
from jobs.driver.driver import Driver
from jobs.spec import load_spec_text
from jobs.spec.launch import parse
from test_launch import killed_when, rank_process

SCRIPT = "tests/trainer_script.py"
STEPS = 12  # 64 sequences / 4 a rank / 2 ranks = 8 steps an epoch: the run crosses an epoch's end
TRAIN = ["--max_steps", str(STEPS), "--save_steps", "4", "--logging_steps", "2", "--per_device_train_batch_size", "4",
         "--eval_strategy", "steps", "--eval_steps", "6", "--report_to", "none", "--seed", "7", "--disable_tqdm",
         "true"]
TWO_NODES = ["--num_machines", "2", "--num_processes", "2"]


def trainer_run(storage: Path, name: str, out: Path, launcher: list[str] = (), script: list[str] = (),
                terminal: io.StringIO | None = None) -> Driver:
    cmd = parse("launch", ["--storage", str(storage), "--name", name, *TWO_NODES, "--set", "failure.max_restarts=1",
                           *launcher, SCRIPT, *TRAIN, "--output_dir", str(out), *script])
    return Driver(cmd.spec(), can_grow=False, out=terminal)


def rows(run_dir: str) -> list[dict]:
    return [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]


def final(out: Path) -> dict:
    return json.loads((out / "final.json").read_text())


def committed(run_dir: str) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in Path(run_dir, "checkpoints").iterdir() if p.is_dir())


@pytest.fixture(scope="module")
def reference(ray_cluster, tmp_path_factory):
    """The script start to end under raylaunch, and beside it under `accelerate launch` (2 processes on CPU)."""
    tmp = tmp_path_factory.mktemp("trainer")
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "PYTHONPATH": str(ROOT), "TRAINER_SCRIPT_EXIT_NOW": "1"}
    peer = subprocess.Popen([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                             "--main_process_port", "0", SCRIPT, *TRAIN, "--output_dir", str(tmp / "peer")],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    said = io.StringIO()
    result = trainer_run(tmp / "runs", "straight", tmp / "out", terminal=said).run()
    peer_out = peer.communicate(timeout=240)[0]
    assert result.status == "succeeded", result.error
    assert peer.returncode == 0, peer_out[-3000:]
    return result, tmp, said.getvalue()


def test_trainer_checkpoints_are_committed_and_its_logs_are_the_runs_metrics_at_its_steps(reference):
    result, tmp, said = reference
    assert result.attempts == 1 and result.world_size == 2
    assert committed(result.run_dir) == [8, 12]  # checkpoint-4, -8, -12; checkpoint.keep 2
    manifest = json.loads(Path(result.run_dir, "checkpoints", "checkpoint-00000012", "manifest.json").read_text())
    assert manifest["step"] == 12
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json", "rng_state_0.pth",
            "rng_state_1.pth"} <= set(manifest["files"])
    assert f"(Trainer's {tmp / 'out' / 'checkpoint-12'}; training held" in said, said[-3000:]
    metrics = rows(result.run_dir)
    assert [r["step"] for r in metrics if r["rank"] == 0 and "loss" in r] == [2, 4, 6, 8, 10, 12]
    assert [r["step"] for r in metrics if r["rank"] == 0 and "eval_loss" in r] == [6, 12]
    assert any("train_runtime" in r for r in metrics)
    # a step is an optimizer step: 12, not 12 plus the evaluation batches
    assert max(r["step"] for r in metrics if r.get("step") is not None) == STEPS
    assert "no argparse option" not in said  # HfArgumentParser reads --resume_from_checkpoint


def test_trainer_under_raylaunch_trains_the_same_weights_as_under_accelerate_launch(reference):
    _, tmp, _ = reference
    ours, peer = final(tmp / "out"), final(tmp / "peer")
    assert ours["global_step"] == peer["global_step"] == STEPS
    assert ours["weights"] == peer["weights"]


def test_the_launchs_accumulation_leaves_trainer_alone_and_a_subclass_is_committed_too(reference):
    """`--gradient_accumulation_steps 2` on the launch line: accelerate launch leaves a Trainer alone (it makes its
    Accelerator with 1 and accumulates itself); applied behind its back, every loss was halved. Seq2SeqTrainer, a
    subclass, trains a causal model the same way and gets the same commits."""
    reference_result, tmp, _ = reference
    said = io.StringIO()
    result = trainer_run(tmp / "runs", "accumulation", tmp / "out-acc", ["--gradient_accumulation_steps", "2"],
                         ["--trainer_class", "Seq2SeqTrainer", "--save_only_model", "true"], terminal=said).run()
    assert result.status == "succeeded", result.error
    assert "the launch's gradient_accumulation_steps=2 is not applied to transformers' Trainer" in said.getvalue()
    assert final(tmp / "out-acc")["weights"] == final(tmp / "out")["weights"]
    # save_only_model: rank 1 writes nothing into the folder, and its (empty) part still lets the commit happen
    assert committed(result.run_dir) == [8, 12]
    manifest = json.loads(Path(result.run_dir, "checkpoints", "checkpoint-00000012", "manifest.json").read_text())
    assert "model.safetensors" in manifest["files"] and "optimizer.pt" not in manifest["files"]


def _in_background(driver: Driver, box: dict) -> threading.Thread:
    thread = threading.Thread(target=lambda: box.setdefault("result", driver.run()))
    thread.start()
    return thread


def _killed_after_the_first_commit(driver: Driver):
    """The run, with rank 1 SIGKILLed once its first checkpoint is committed; its result."""
    return killed_when(driver, Path(driver.run_dir.uri, "checkpoints", "latest.json").exists, "the first commit")


def _stopped_after_step_3(driver: Driver):
    """The run, with rank 1 sent SIGTERM (what a spot node's shutdown sends its processes) once rank 0 logged the
    loss of step 3; its result."""
    box: dict = {}
    thread = _in_background(driver, box)
    try:
        metrics = Path(driver.run_dir.uri, "metrics.jsonl")
        wait_for(lambda: metrics.exists() and any(r.get("step", 0) and r["step"] >= 3 and "loss" in r
                                                  for r in rows(driver.run_dir.uri)), 120, "step 3")
        rank_process(1).send_signal(signal.SIGTERM)
    finally:
        thread.join(300)
    return box["result"]


def test_a_killed_rank_resumes_trainer_from_the_last_commit_and_ends_bitwise_equal(reference):
    _, tmp, _ = reference
    said = io.StringIO()
    # save_total_limit 1: Trainer deletes checkpoint-4 while checkpoint-8 is saved, maybe while it is still copied
    driver = trainer_run(tmp / "runs", "killed", tmp / "out-killed", terminal=said,
                         script=["--throttle_s", "0.4", "--save_total_limit", "1"])
    result = _killed_after_the_first_commit(driver)
    assert result.status == "succeeded", result.error
    assert result.attempts == 2 and result.restarts == 1
    assert "gets --resume_from_checkpoint" in said.getvalue() and "checkpoint-" in said.getvalue()
    second = [r["step"] for r in rows(result.run_dir) if r["attempt"] == 2 and r["rank"] == 0 and "loss" in r]
    assert second and second[0] > 2 and second[-1] == STEPS  # went on from a commit, not from step 0
    assert final(tmp / "out-killed")["weights"] == final(tmp / "out")["weights"]


def test_a_stop_notice_saves_trainer_at_its_next_step_and_the_restart_loses_none(reference):
    _, tmp, _ = reference
    said = io.StringIO()
    driver = trainer_run(tmp / "runs", "stopped", tmp / "out-stopped", launcher=["--set", "failure.max_restarts=0"],
                         script=["--throttle_s", "0.4", "--logging_steps", "1", "--save_steps", "1000"], terminal=said)
    result = _stopped_after_step_3(driver)
    assert result.status == "succeeded", result.error
    assert result.preemptions == 1 and result.restarts == 0
    first = [r["step"] for r in rows(result.run_dir) if r["attempt"] == 1 and r["rank"] == 0 and "loss" in r]
    second = [r["step"] for r in rows(result.run_dir) if r["attempt"] == 2 and r["rank"] == 0 and "loss" in r]
    # no periodic save was due (every 1000 steps): attempt 2 began right after the step the notice saved
    assert second[0] == first[-1] + 1, (first, second)
    assert "stop notice: Trainer saves checkpoint-" in said.getvalue()
    assert final(tmp / "out-stopped")["weights"] == final(tmp / "out")["weights"]


def test_a_function_that_builds_a_trainer_is_committed_and_resumed_with_one_line(reference):
    """A train_fn calling the same code with `resume_from_checkpoint=get_session().checkpoint_folder()`: its
    checkpoints committed, its loss rows logged, a killed rank resumed from the commit, the script's weights."""
    _, tmp, _ = reference
    argv = [*TRAIN, "--output_dir", str(tmp / "out-fn"), "--throttle_s", "0.4"]
    spec = load_spec_text(f"name: fn\ntrain_fn: fns:trainer\nconfig: {{argv: {json.dumps(argv)}}}\n"
                          f"scaling: {{num_nodes: 2, workers_per_node: 1}}\nfailure: {{max_restarts: 1}}\n"
                          f"storage: {tmp / 'runs'}\n")
    driver = Driver(spec, can_grow=False)
    result = _killed_after_the_first_commit(driver)
    assert result.status == "succeeded", result.error
    assert result.attempts == 2 and committed(result.run_dir) == [8, 12]
    second = [r["step"] for r in rows(result.run_dir) if r["attempt"] == 2 and r["rank"] == 0 and "loss" in r]
    assert second and second[0] > 2 and second[-1] == STEPS
    assert result.rank_results["0"]["weights"] == final(tmp / "out")["weights"]


def test_an_elastic_trainer_run_below_its_size_keeps_the_global_batch_through_trainers_accumulation(reference):
    """Four nodes asked for, two in the cluster (min_nodes 1): the run starts on two, and Trainer's own
    gradient_accumulation_steps (1 in the script) is 2 there, so each step still sees four nodes' batches."""
    _, tmp, _ = reference
    cmd = parse("launch", ["--storage", str(tmp / "runs"), "--name", "elastic", "--num_machines", "4",
                           "--num_processes", "4", "--set", "scaling.min_nodes=1", SCRIPT, *TRAIN, "--max_steps", "4",
                           "--output_dir", str(tmp / "out-elastic")])
    result = Driver(cmd.spec(), can_grow=False).run()
    assert result.status == "succeeded", result.error
    assert result.world_size == 2
    ran = final(tmp / "out-elastic")
    assert (ran["world_size"], ran["accumulation"], ran["global_step"]) == (2, 2, 4)
    logs = Path(result.run_dir, "logs", "rank-0.log").read_text()
    assert "elastic: Trainer's gradient_accumulation_steps=1 is 2 at this world size (2), which keeps the global " \
           "batch" in logs, logs[-2000:]


def test_a_function_that_builds_a_trainer_stops_on_a_notice_and_resumes_where_it_saved(reference):
    """The stop notice in a function: Trainer saves at the agreed step, the function ends there (reported as
    preempted, never as finished), and the restart resumes it from that step to the script's weights."""
    _, tmp, _ = reference
    argv = [*TRAIN, "--output_dir", str(tmp / "out-fn-stop"), "--throttle_s", "0.4", "--logging_steps", "1",
            "--save_steps", "1000"]
    spec = load_spec_text(f"name: fn-stop\ntrain_fn: fns:trainer\nconfig: {{argv: {json.dumps(argv)}}}\n"
                          f"scaling: {{num_nodes: 2, workers_per_node: 1}}\nstorage: {tmp / 'runs'}\n")
    driver = Driver(spec, can_grow=False)
    result = _stopped_after_step_3(driver)
    assert result.status == "succeeded", result.error
    assert result.preemptions == 1 and result.attempts == 2
    first = [r["step"] for r in rows(result.run_dir) if r["attempt"] == 1 and r["rank"] == 0 and "loss" in r]
    second = [r["step"] for r in rows(result.run_dir) if r["attempt"] == 2 and r["rank"] == 0 and "loss" in r]
    assert first[-1] < STEPS and second[0] == first[-1] + 1, (first, second)
    assert result.rank_results["0"]["weights"] == final(tmp / "out")["weights"]


def _events(run_dir: str) -> list[dict]:
    return [json.loads(line) for line in Path(run_dir, "events.jsonl").read_text().splitlines()]


def test_a_killed_rank_resumes_trainer_from_a_snapshot_in_memory_and_ends_bitwise_equal(reference):
    """Snapshots every step and no save of Trainer's due (save_steps 1000): rank 1 SIGKILLed after step 5. The restart
    hands Trainer a checkpoint-<n> put together from the nodes' memory, written as Trainer writes its own, at most two
    steps before the kill; Trainer's own resume loads it, and the weights are the uninterrupted run's."""
    _, tmp, _ = reference
    said = io.StringIO()
    driver = trainer_run(tmp / "runs", "snapshot", tmp / "out-snapshot", terminal=said,
                         launcher=["--set", "checkpoint.snapshots.every=1"],
                         script=["--throttle_s", "0.4", "--save_steps", "1000", "--logging_steps", "1"])
    metrics = Path(driver.run_dir.uri, "metrics.jsonl")
    result = killed_when(driver, lambda: metrics.exists() and any(r.get("step", 0) and r["step"] >= 5 and "loss" in r
                                                                  for r in rows(driver.run_dir.uri)), "step 5")
    assert result.status == "succeeded", result.error
    assert result.attempts == 2 and committed(result.run_dir) == [12]
    first = [r["step"] for r in rows(result.run_dir) if r["attempt"] == 1 and r["rank"] == 0 and "loss" in r]
    second = [r["step"] for r in rows(result.run_dir) if r["attempt"] == 2 and r["rank"] == 0 and "loss" in r]
    starts = [e for e in _events(result.run_dir) if e["kind"] == "attempt"]
    assert starts[-1]["resume_from"] == "memory", starts
    resumed = starts[-1]["resume_step"]
    assert first[-1] - 2 <= resumed <= first[-1] and second[0] == resumed + 1, (first, second, resumed)
    assert "gets --resume_from_checkpoint" in said.getvalue() and f"checkpoint-{resumed} " in said.getvalue()
    assert final(tmp / "out-snapshot")["weights"] == final(tmp / "out")["weights"]
