"""Data at cluster scale, on the shared multi-node Ray cluster: Hugging Face datasets read from
local files go through Accelerate's sharding so that every sample is consumed exactly once per
epoch across all ranks of all nodes, in the same order at any topology of the same world size;
streams resume exactly; dataloader workers leave nothing behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from conftest import wait_for
from datafns import write_samples
from jobs.driver.driver import Driver
from jobs.spec import load_spec_text

N = 96  # samples: 12 batches of 4 per rank and epoch at world size 2, 6 at world size 4: no padding

SPEC = """
name: {name}
train_fn: datafns:record_ids
config: {{data: {data}, out: {out}, source: {source}, epochs: 2, batch_size: 4}}
scaling: {{num_nodes: {nodes}, workers_per_node: {workers}}}
failure: {{max_restarts: 0}}
timeouts: {{heartbeat_s: 20, placement_s: 60}}
env: {{vars: {{HF_DATASETS_OFFLINE: "1", HF_HUB_OFFLINE: "1"}}}}
storage: {storage}
"""


@pytest.fixture(scope="module")
def samples(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("samples")
    write_samples(folder, N, shards=8)
    return folder


def run(tmp_path: Path, samples: Path, name: str, source: str, nodes: int = 2, workers: int = 1,
        overrides: list[str] | None = None):
    out = tmp_path / name
    spec = load_spec_text(SPEC.format(name=name, data=samples, out=out, source=source, nodes=nodes, workers=workers,
                                      storage=tmp_path / "runs"), overrides)
    result = Driver(spec, can_grow=False).run()
    return result, out


def consumed(out: Path, attempt: int | None = None) -> dict[int, list[dict]]:
    """rank -> its batches, in order (of one attempt, or all)."""
    by_rank = {}
    for f in sorted(out.glob("ids-rank*.jsonl")):
        rows = [json.loads(l) for l in f.read_text().splitlines()]
        by_rank[int(f.stem.removeprefix("ids-rank"))] = [r for r in rows if attempt is None or r["attempt"] == attempt]
    return by_rank


def assert_each_sample_once_per_epoch(by_rank: dict[int, list[dict]], epochs: int = 2) -> None:
    for epoch in range(epochs):
        per_rank = {r: [i for b in batches if b["epoch"] == epoch for i in b["ids"]] for r, batches in by_rank.items()}
        everything = [i for ids in per_rank.values() for i in ids]
        assert sorted(everything) == list(range(N)), f"epoch {epoch}: not every sample exactly once"
        assert all(ids for ids in per_rank.values()), "a rank consumed nothing"


def test_map_style_from_parquet_and_json_lines_each_sample_once_in_the_same_order_at_any_topology(
        ray_cluster, tmp_path, samples):
    two_nodes, out_a = run(tmp_path, samples, "parquet-2x1", "parquet", nodes=2, workers=1)
    assert two_nodes.status == "succeeded", two_nodes.error
    one_node, out_b = run(tmp_path, samples, "jsonl-1x2", "jsonl", nodes=1, workers=2)
    assert one_node.status == "succeeded", one_node.error
    a, b = consumed(out_a), consumed(out_b)
    assert sorted(a) == sorted(b) == [0, 1]
    assert_each_sample_once_per_epoch(a)
    assert_each_sample_once_per_epoch(b)
    # the same global order: rank R sees the same batches at 2 nodes x 1 and at 1 node x 2
    assert [x["ids"] for x in a[0]] == [x["ids"] for x in b[0]] and [x["ids"] for x in a[1]] == [x["ids"] for x in b[1]]
    # shuffled, and differently in each epoch
    assert a[0][0]["ids"] != [0, 2, 4, 6] and [x["ids"] for x in a[0][:12]] != [x["ids"] for x in a[0][12:]]


def test_load_from_disk_at_world_size_four(ray_cluster, tmp_path, samples):
    result, out = run(tmp_path, samples, "disk-2x2", "disk", nodes=2, workers=2)
    assert result.status == "succeeded", result.error
    by_rank = consumed(out)
    assert sorted(by_rank) == [0, 1, 2, 3] and all(len(b) == 12 for b in by_rank.values())  # 6 batches x 2 epochs
    assert_each_sample_once_per_epoch(by_rank)
    assert result.rank_results["3"]["world"] == 4


@pytest.mark.parametrize("split, dispatch", [(True, "auto"), (False, True), (True, True)])
def test_split_batches_and_dispatch_batches_from_the_spec(ray_cluster, tmp_path, samples, split, dispatch):
    name = f"split-{split}-dispatch-{dispatch}".lower()
    result, out = run(tmp_path, samples, name, "parquet", overrides=[
        f"accelerate.dataloader.split_batches={str(split).lower()}",
        f"accelerate.dataloader.dispatch_batches={str(dispatch).lower()}"])
    assert result.status == "succeeded", result.error
    by_rank = consumed(out)
    assert_each_sample_once_per_epoch(by_rank)
    # split_batches: batch_size is the global batch, each rank gets its part; otherwise each rank gets batch_size
    per_rank_batch = 2 if split else 4
    assert {len(b["ids"]) for batches in by_rank.values() for b in batches} == {per_rank_batch}
    assert len(by_rank[0]) == 2 * N // (2 * per_rank_batch)


def test_dataloader_workers_across_a_restart_leave_no_process_behind(ray_cluster, tmp_path, samples):
    result, out = run(tmp_path, samples, "workers", "parquet", overrides=[
        "config.num_workers=2", "config.every=4", "config.fail_at=9", "failure.max_restarts=1"])
    assert result.status == "succeeded", result.error
    assert result.attempts == 2 and result.rank_results["0"]["restored"] == 8
    # every rank of both attempts ran its two persistent workers (the first attempt's rank 1 failed)
    seen = set()
    for rank in (0, 1):
        for attempt in (1, 2):
            pids = json.loads((out / f"children-rank{rank}-attempt{attempt}.json").read_text())
            assert len(pids) >= 2
            seen |= set(pids)
    wait_for(lambda: not [p for p in seen if psutil.pid_exists(p) and _alive(p)], 30,
             "the dataloader workers to end")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_stream_over_shard_files_resumes_exactly_after_a_rank_is_killed(ray_cluster, tmp_path, samples):
    """8 parquet shards, 2 ranks: each rank streams 4 files of its own (datasets' shard split, no
    dispatching); rank 1 is SIGKILLed mid-epoch; the next attempt restores each rank's stream
    position from the checkpoint and goes on with the very batches that followed it."""
    import signal

    from test_faults import committed

    name = "stream"
    out = tmp_path / name
    spec = load_spec_text(SPEC.format(name=name, data=samples, out=out, source="stream", nodes=2, workers=1,
                                      storage=tmp_path / "runs"),
                          ["config.every=5", "config.step_s=0.3", "failure.max_restarts=1",
                           "accelerate.dataloader.dispatch_batches=false",
                           "accelerate.dataloader.use_stateful_dataloader=true"])
    driver = Driver(spec, can_grow=False)
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("result", driver.run()))
    thread.start()
    def past_the_checkpoint() -> bool:  # mid-epoch, two steps after the checkpoint of step 5
        rows = consumed(out, attempt=1).get(1, [])
        return committed(tmp_path, name) == 5 and bool(rows) and rows[-1]["step"] >= 7

    wait_for(past_the_checkpoint, 180, "rank 1 at step 7, past the checkpoint of step 5")
    os.kill(int((out / "pid-rank1-attempt1").read_text()), signal.SIGKILL)
    thread.join(300)
    result = box["result"]
    assert result.status == "succeeded", result.error
    # from the commit of step 5, or from a snapshot in memory taken past it (#59): the streams' positions either way
    restored = result.rank_results["0"]["restored"]
    assert result.attempts == 2 and restored >= 5
    first, second = consumed(out, attempt=1), consumed(out, attempt=2)
    for rank in (0, 1):
        # the second attempt starts with the batch after the one it restored, and repeats what the
        # first attempt had read past it, batch for batch
        assert second[rank][0]["step"] == restored + 1 and second[rank][0]["epoch"] == 0
        replayed = {b["step"]: b["ids"] for b in first[rank] if b["step"] > restored}
        assert replayed and all(b["ids"] == replayed[b["step"]] for b in second[rank] if b["step"] in replayed)
    # up to the restored step from the first attempt, then the second: every sample once per epoch
    kept = {rank: [b for b in first[rank] if b["step"] <= restored] + second[rank] for rank in (0, 1)}
    assert_each_sample_once_per_epoch(kept)
    # each rank read its own files: rank 0 the ids of 4 shards, rank 1 those of the other 4
    assert not {i for b in kept[0] for i in b["ids"]} & {i for b in kept[1] for i in b["ids"]}


def test_the_streaming_example_trains_the_digits_bert_from_parquet_shards(ray_cluster, tmp_path):
    from jobs.spec import load_spec

    spec = load_spec(Path(__file__).resolve().parent.parent / "jobs" / "examples" / "digits-stream.yaml", [
        "config.epochs=2", "config.train_samples=256", "config.checkpoint_every=5", f"config.data_dir={tmp_path / 'data'}",
        f"storage={tmp_path / 'runs'}", "timeouts.placement_s=60"])
    result = Driver(spec, can_grow=False).run()
    assert result.status == "succeeded", result.error
    # 256 images in 8 equal files, 4 per rank: 128 a rank, 8 batches of 16 an epoch
    assert sorted(p.name for p in (tmp_path / "data").iterdir())[0] == "train-00000-of-00008.parquet"
    assert result.return_value["steps"] == 16 and result.return_value["world_size"] == 2
    assert 0.0 <= result.return_value["eval_accuracy"] <= 1.0
    latest = json.loads((tmp_path / "runs" / "digits-stream" / "checkpoints" / "latest.json").read_text())
    files = os.listdir(tmp_path / "runs" / "digits-stream" / "checkpoints" / f"checkpoint-{latest['step']:08d}")
    assert {"dl_state_rank0.bin", "dl_state_rank1.bin"} <= set(files)

    # Resumed on one node (an elastic shrink): a stream's per-rank position cannot carry over, and
    # rank 0 says so; the run goes on, its one rank reading all 8 files (16 batches an epoch).
    import io

    spec = load_spec(Path(__file__).resolve().parent.parent / "jobs" / "examples" / "digits-stream.yaml", [
        "config.epochs=3", "config.train_samples=256", "config.checkpoint_every=5", f"config.data_dir={tmp_path / 'data'}",
        f"storage={tmp_path / 'runs'}", "timeouts.placement_s=60", "scaling.num_nodes=1"])
    out = io.StringIO()
    one = Driver(spec, can_grow=False, out=out).run()
    assert one.status == "succeeded", one.error
    assert one.return_value["restored_step"] == 16 and one.return_value["steps"] == 32
    assert "data loader positions were saved by 2 ranks and this attempt has 1" in out.getvalue()


def test_a_ranks_dataloader_workers_start_as_under_torchrun(ray_cluster, tmp_path):
    """A rank starts processes as the interpreter does by default (fork on Linux before Python 3.14), as a rank of
    torchrun or `accelerate launch` does: a DataLoader worker inherits a collate function that cannot be pickled (a
    closure), and the datasets the rank built in memory, rather than being sent them. A rank is forked from the
    node's fork server, whose "forkserver" it inherited until 2026-12-07: that loader failed ("Can't pickle local
    object"), and every lock a library made (tqdm's) left a named semaphore in /dev/shm when the rank was killed."""
    default = subprocess.run([sys.executable, "-c", "import multiprocessing; print(multiprocessing.get_start_method())"],
                             capture_output=True, text=True, check=True).stdout.strip()
    if default != "fork":  # (Python 3.14 on: forkserver, under torchrun too, where such a loader fails alike)
        pytest.skip(f"this interpreter starts processes by {default}")
    spec = load_spec_text(f"name: workers-fork\ntrain_fn: datafns:workers_as_under_torchrun\nconfig: {{out: {tmp_path}}}\n"
                          f"scaling: {{num_nodes: 2, workers_per_node: 1}}\nstorage: {tmp_path}\n")
    result = Driver(spec, can_grow=False).run()
    assert result.status == "succeeded", result.error
    seen = [r["seen"] for r in result.rank_results.values()]
    assert len(seen) == 2 and min(seen) > 0 and sum(seen) == 2 * sum(range(16))  # 0..15 shared, doubled by the closure
    assert {r["start_method"] for r in result.rank_results.values()} == {default}
    # the worker does not keep the rank's stop-notice handler: DataLoader's SIGTERM to a lingering worker ends it
    assert {r["worker_sigterm"] for r in result.rank_results.values()} == {"default"}
