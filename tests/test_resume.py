"""Exact resume: a run interrupted mid-epoch and resumed ends with the same weights, bit for bit."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

from jobs.driver.driver import Driver
from jobs.spec import load_spec_text

SPEC = """
name: {name}
train_fn: train_fn.digits:train
config: {{epochs: 2, train_samples: 800, batch_size: 16, checkpoint_every: 15, throttle_s: {throttle}, dropout: 0.1}}
scaling: {{num_nodes: 2, workers_per_node: 1}}
checkpoint: {{snapshots: {{every: 0}}}}  # from storage (tests/test_snapshots.py resumes from memory)
failure: {{max_restarts: 1}}
storage: {storage}
"""


def test_interrupted_mid_epoch_and_resumed_equals_uninterrupted(ray_cluster, tmp_path):
    # the uninterrupted run and the one cut short run at once (each holds one CPU of each of the two nodes)
    box = {}
    whole_run = threading.Thread(target=lambda: box.setdefault("whole", Driver(
        load_spec_text(SPEC.format(name="whole", throttle=0.0, storage=tmp_path)), can_grow=False).run()))
    whole_run.start()
    driver = Driver(load_spec_text(SPEC.format(name="cut", throttle=0.08, storage=tmp_path)), can_grow=False)
    thread = threading.Thread(target=lambda: box.setdefault("result", driver.run()))
    thread.start()
    latest = tmp_path / "cut" / "checkpoints" / "latest.json"
    deadline = time.monotonic() + 120
    # step 30 is 5 optimizer steps into the second epoch (800 images: 400 a rank, 25 steps an epoch); the next
    # commit is 15 throttled steps (1.2 s) away when the rank is killed
    while time.monotonic() < deadline and not (latest.exists() and json.loads(latest.read_text())["step"] >= 30):
        time.sleep(0.05)
    pids = driver.group.pids()
    os.kill(pids[1], signal.SIGKILL)
    thread.join(180)
    whole_run.join(180)
    whole, cut = box["whole"], box["result"]
    assert whole.status == "succeeded", whole.error
    assert cut.status == "succeeded" and cut.restarts == 1, cut.error
    r0 = cut.rank_results["0"]
    assert r0["restored_step"] == 30 and r0["steps"] == 50
    # zero tolerance: every weight identical
    assert r0["weights"] == whole.rank_results["0"]["weights"]
    assert r0["eval_accuracy"] == whole.rank_results["0"]["eval_accuracy"]
