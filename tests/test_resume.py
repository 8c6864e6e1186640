"""Exact resume: a run interrupted mid-epoch and resumed ends with the same weights, bit for bit."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

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


RESUMES_EPOCH = """
name: {name}
train_fn: fns:resumes_epoch
config: {{resume: {resume}, out: {out}}}
scaling: {{num_nodes: 2, workers_per_node: 1}}
checkpoint: {{snapshots: {{every: 0}}}}
failure: {{max_restarts: 1}}
storage: {storage}
"""


@pytest.mark.parametrize("resume", ["again", "skip", "manual"])
def test_a_function_that_begins_a_resumed_epoch_again_is_told_so(ray_cluster, tmp_path, capsys, resume):
    """A function resumed mid-epoch whose loader begins that epoch again (no ``skip_first_batches``) trains on the
    epoch's first batches twice, silently under ``accelerate launch``: the run says so, with the call that resumes
    the epoch; one that skips them (through Accelerate, or itself) hears nothing."""
    result = Driver(load_spec_text(RESUMES_EPOCH.format(name=resume, resume=resume, out=tmp_path, storage=tmp_path)),
                    can_grow=False).run()
    assert result.status == "succeeded" and result.restarts == 1, result.error
    out = capsys.readouterr()
    said = ("raylaunch: this run resumed in the middle of an epoch, where its data loader had handed over 6 batches, "
            "and the loader began that epoch again (at its first optimizer step it had handed over 1)")
    first, second = ([int(x) for x in (tmp_path / f"seen-{a}-0").read_text().split()] for a in (1, 2))
    assert len(first) >= 9 and len(second) == 6  # attempt 1 trained to step 9 at least; attempt 2 steps 7-12
    if resume == "again":
        assert said in out.out + out.err, out.out[-3000:]
        assert "accelerator.skip_first_batches(loader, 6)" in out.out + out.err
        assert second == first[:6]  # the epoch's first six batches, twice
    else:
        assert "resumed in the middle of an epoch" not in out.out + out.err
        assert second[:3] == first[6:9]  # the epoch went on where the checkpoint stood


def test_a_checkpoint_keeps_the_training_loaders_place_beside_an_evaluation_loader_over_the_same_data(tmp_path):
    """Two prepared loaders over one dataset (training, shuffled; an evaluation pass over the same samples): each
    checkpoint's place is its own loader's, not that of the loader that began an epoch over the data last."""
    import torch
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.state import AcceleratorState
    from torch.utils.data import DataLoader, TensorDataset

    from cluster.checkpoint import resume

    AcceleratorState._reset_state(True)
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    data = TensorDataset(torch.arange(40))
    train, evaluate = accelerator.prepare(DataLoader(data, batch_size=4, shuffle=True), DataLoader(data, batch_size=8))
    resume.epoch_begins(train)
    train._raylaunch_handed = 3  # (what the prepared loader's iteration counts, cluster/rank/pace.py)
    resume.epoch_begins(evaluate)  # then a whole evaluation pass over the same dataset
    evaluate._raylaunch_handed = 5
    resume._save_orders(accelerator, str(tmp_path))
    place = torch.load(tmp_path / "dl_order_rank0.bin", weights_only=True)
    assert place["handed"] == 3 and place["epoch"] == 0 and place["world"] == 1, place
    assert torch.load(tmp_path / "dl_order_rank0_1.bin", weights_only=True)["handed"] == 5
    # a loader that skip_first_batches makes of the training loader stands where the training loader does
    skipping = accelerator.skip_first_batches(train, 3)
    resume.epoch_begins(skipping)
    skipping._raylaunch_handed = 1
    resume._save_orders(accelerator, str(tmp_path))
    assert torch.load(tmp_path / "dl_order_rank0.bin", weights_only=True)["handed"] == 4
    AcceleratorState._reset_state(True)


INIT_APART = """
name: {name}
train_fn: fns:ranks_init_apart
config: {{restore: {restore}, fail: {fail}}}
scaling: {{num_nodes: 2, workers_per_node: 1}}
checkpoint: {{snapshots: {{every: 0}}}}
failure: {{max_restarts: 1}}
storage: {storage}
"""


@pytest.mark.parametrize("restore", [True, False])
def test_a_restart_skips_ddps_first_broadcast_and_the_ranks_still_train_one_model(ray_cluster, tmp_path, restore):
    """A restarted attempt's DDP model is wrapped without DDP's broadcast of rank 0's parameters, which the restore
    overwrites on every rank (cluster/rank/restart_sync.py): right after ``prepare`` rank 1 still holds its own
    initialisation. The ranks' values are compared once the code has restored (or, if it does not, at the first
    forward): after a restore they agree and the run ends bitwise equal to the uninterrupted one; a function that does
    not restore gets rank 0's values broadcast at its first forward, as DDP's own rule gives, so the ranks train one
    model."""
    def run(name: str, fail: bool) -> dict:
        result = Driver(load_spec_text(INIT_APART.format(name=name, restore=restore, fail=fail, storage=tmp_path)),
                        can_grow=False).run()
        assert result.status == "succeeded" and result.restarts == int(fail), result.error
        return {int(rank): out for rank, out in result.rank_results.items()}

    whole, cut = run("whole", False), run("cut", True)
    assert cut[0]["attempt"] == cut[1]["attempt"] == 2
    assert whole[0]["prepared"] == whole[1]["prepared"]  # a first attempt: DDP broadcast rank 0's as it wrapped
    assert cut[0]["prepared"] != cut[1]["prepared"]  # the restart's: no broadcast, each rank its own values
    assert cut[0]["trained"] == cut[1]["trained"]  # one model from the first forward on
    if restore:
        assert cut[0]["restored"] == cut[1]["restored"]
        assert cut[0]["trained"] == whole[0]["trained"]  # bitwise the uninterrupted run
    else:
        assert cut[0]["restored"] != cut[1]["restored"]  # (nothing loaded: the first forward's broadcast did it)
