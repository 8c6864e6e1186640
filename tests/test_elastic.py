"""Elastic world size on the shared multi-node Ray cluster: a run that loses a node goes on with
fewer within timeouts.resize_s, keeping the global batch and the data order, and grows back at a
committed checkpoint when a node returns."""

from __future__ import annotations

import io
import json
import re
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest
import ray

from cluster.nodes.connect import embedded_node
from conftest import wait_for
from jobs.driver.driver import Driver
from jobs.runs import format_show, series
from jobs.spec import load_spec_text

SAMPLES, BATCH, EPOCHS = 128, 8, 4
GLOBAL_BATCH = 2 * BATCH  # 2 nodes x 1 worker x accumulation 1
STEPS_PER_EPOCH = SAMPLES // GLOBAL_BATCH
# On one node the function waits after this step until the test saw the driver notice the node that
# came back: the grow needs a checkpoint committed after that (every 3 steps) before the run ends.
GATE_STEP = 16

ELASTIC = """
name: {name}
train_fn: fns:elastic
config: {{samples: %d, batch_size: %d, epochs: %d, every: 3, step_s: {step_s}, pid_dir: {pid_dir},
          gate: {pid_dir}/gate, gate_step: %d}}
scaling: {{num_nodes: 2, workers_per_node: 1, min_nodes: 1}}
failure: {{max_restarts: 1}}
timeouts: {{heartbeat_s: 20, placement_s: 60, resize_s: 3}}
storage: {storage}
""" % (SAMPLES, BATCH, EPOCHS, GATE_STEP)


class Shown(io.StringIO):
    """The driver's output, kept for the test and printed too, each line with the time since the
    run started (pytest shows it when a test fails: where the time went)."""

    def __init__(self) -> None:
        super().__init__()
        self.began = time.monotonic()
        self._at_line_start = True

    def write(self, text: str) -> int:
        stamp = f"[{time.monotonic() - self.began:6.1f}s] "
        for line in text.splitlines(keepends=True):
            sys.stdout.write((stamp if self._at_line_start else "") + line)
            self._at_line_start = line.endswith("\n")
        return super().write(text)


def spec(tmp_path: Path, name: str, step_s: float = 0.25, overrides: list[str] | None = None):
    return load_spec_text(ELASTIC.format(name=name, step_s=step_s, pid_dir=tmp_path / "pids",
                                         storage=tmp_path / "runs"), overrides)


def rows(tmp_path: Path, name: str) -> list[dict]:
    return [json.loads(l) for l in (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()]


def samples_by_step(tmp_path: Path, name: str) -> dict[int, list[int]]:
    """The sample ids of each optimizer step, from the attempt whose state the run kept (the last
    one that ran the step), across its ranks."""
    last: dict[int, int] = {}
    for r in rows(tmp_path, name):
        if "ids" in r:
            last[r["step"]] = max(last.get(r["step"], 0), r["attempt"])
    out: dict[int, list[int]] = defaultdict(list)
    for r in rows(tmp_path, name):
        if "ids" in r and r["attempt"] == last[r["step"]]:
            out[r["step"]] += r["ids"]
    return dict(out)


class Background:
    """A driver's run of ``job`` in a thread, as `raylaunch run` runs it, while the test changes
    the cluster; its output in ``out``."""

    def __init__(self, job) -> None:
        self.out = Shown()
        self.driver, self.box = Driver(job, can_grow=True, out=self.out), {}
        self.thread = threading.Thread(target=lambda: self.box.setdefault("result", self.driver.run()))
        self.thread.start()

    def nodes_once_committed(self, tmp_path: Path, step: int) -> list[str]:
        """The node ids of the run's nodes, in node-rank order, once it committed ``step``."""
        name = self.driver.spec.name
        wait_for(lambda: (committed(tmp_path, name) or 0) >= step, 120, "a committed checkpoint")
        return [i.node_id for i in self.driver.group.infos]

    def join(self, timeout_s: float = 240) -> None:
        self.thread.join(timeout_s)

    def result(self):
        assert "result" in self.box, "the run did not end in time"
        return self.box["result"]


def each_sample_once_per_epoch(got: dict[int, list[int]], steps_per_epoch: int, samples: int) -> None:
    for epoch in range(len(got) // steps_per_epoch):
        steps = range(epoch * steps_per_epoch + 1, (epoch + 1) * steps_per_epoch + 1)
        assert sorted(i for s in steps for i in got[s]) == list(range(samples)), epoch


def autoscaler_request() -> list[dict]:
    """The resources the cluster's autoscaler is asked to make room for (``request_resources``),
    where Ray's autoscaler reads them on this cluster (v1: one key of the GCS's store)."""
    from ray._private.ray_constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
    from ray.autoscaler.v2.utils import is_autoscaler_v2
    from ray.experimental.internal_kv import _internal_kv_get

    assert not is_autoscaler_v2(), "this test reads the v1 autoscaler's request"
    raw = _internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL)
    return json.loads(raw) if raw else []


def committed(tmp_path: Path, name: str) -> int | None:
    latest = tmp_path / "runs" / name / "checkpoints" / "latest.json"
    return json.loads(latest.read_text())["step"] if latest.exists() else None


@pytest.fixture(scope="module")
def below(ray_cluster, tmp_path_factory):
    """Three nodes asked for, two in the cluster (min_nodes 1): the run starts on two and trains to the end
    there. Uninterrupted at world size 2 and gradient accumulation 1, it is also the reference for the data
    order and the loss of the run that shrinks and grows back. (tmp, result, the driver's output)"""
    assert len([n for n in ray.nodes() if n["Alive"]]) == 2, "the shared cluster is a head and one node"
    tmp = tmp_path_factory.mktemp("below")
    out = io.StringIO()
    job = spec(tmp, "short", step_s=0.0, overrides=["scaling.num_nodes=3", "scaling.keep_global_batch=false"])
    return tmp, Driver(job, can_grow=False, out=out).run(), out.getvalue()


def test_a_run_shrinks_on_a_lost_node_and_grows_back_keeping_batch_and_data_order(ray_cluster, tmp_path, below):
    assert len([n for n in ray.nodes() if n["Alive"]]) == 2, "the shared cluster is a head and one node"
    # The uninterrupted run: the reference for the data order and the loss.
    reference_tmp, reference, _ = below
    assert reference.status == "succeeded", reference.error
    assert reference.resizes == [] and reference.world_size == 2

    run = Background(spec(tmp_path, "elastic"))
    try:
        used = run.nodes_once_committed(tmp_path, 3)
        victim = next(n for n in ray_cluster.worker_nodes if n.node_id in used)  # not the head: it runs the driver
        lost = used.index(victim.node_id)
        ray_cluster.remove_node(victim)
        lost_at = time.monotonic()
        # no node comes back: within resize_s (3 s) plus a restart it trains on the one node left
        wait_for(lambda: any(r.get("world_size") == 1 and "ids" in r for r in rows(tmp_path, "elastic")), 90,
                 "training on one node")
        shrunk_s = time.monotonic() - lost_at
        step_at_one = max(r["step"] for r in rows(tmp_path, "elastic") if r.get("world_size") == 1)
        wait_for(lambda: max(r["step"] for r in rows(tmp_path, "elastic") if r.get("world_size") == 1)
                 >= step_at_one + 2, 60, "two more steps on one node")
        ray_cluster.add_node(num_cpus=2)  # the node returns
        wait_for(lambda: "nodes came back" in run.out.getvalue(), 60, "the driver to see the node back")
        (tmp_path / "pids" / "gate").touch()
    finally:
        run.join()
    result = run.result()
    assert result.status == "succeeded", result.error
    assert shrunk_s < 60, shrunk_s
    text = run.out.getvalue()
    assert f"world size 2 -> 1 (node {lost} lost); gradient accumulation 1 -> 2 keeps the global batch" in text
    assert "world size 1 -> 2 (nodes came back); gradient accumulation 2 -> 1 keeps the global batch" in text
    # a lost node used the one restart allowed; growing back used none
    assert result.restarts == 1 and result.attempts == 3
    saved = json.loads((tmp_path / "runs" / "elastic" / "result.json").read_text())
    assert [(z["attempt"], z["old_world_size"], z["new_world_size"], z["reason"]) for z in saved["resizes"]] == [
        (2, 2, 1, f"node {lost} lost"), (3, 1, 2, "nodes came back")]
    shrink, grow = saved["resizes"]
    assert 3 <= shrink["step"] < grow["step"] < STEPS_PER_EPOCH * EPOCHS
    assert saved["world_size"] == 2 and saved["num_nodes"] == 2
    # show, the progress lines and plot's curves carry the world size and its changes
    shown = format_show(str(tmp_path / "runs"), "elastic")
    assert (f"resized     attempt 2 from step {shrink['step']}: world size 2 -> 1 (node {lost} lost)\n"
            f"  resized     attempt 3 from step {grow['step']}: world size 1 -> 2 (nodes came back)") in shown
    assert re.search(r"raylaunch: step \d+ .*world_size=1", text)
    (curve,) = series(rows(tmp_path, "elastic"), "rank_loss")
    assert curve.resizes == [(shrink["step"] + 1, 1), (grow["step"] + 1, 2)]
    # the function saw accumulation 2 on one node, 1 on two
    assert {(r["world_size"], r["attempt"]) for r in rows(tmp_path, "elastic") if "ids" in r} == {
        (2, 1), (1, 2), (2, 3)}

    # The data order: every optimizer step had the same global batch, each sample of each epoch
    # was used exactly once, and each step used the samples the uninterrupted run used.
    got, want = samples_by_step(tmp_path, "elastic"), samples_by_step(reference_tmp, "short")
    assert sorted(got) == list(range(1, STEPS_PER_EPOCH * EPOCHS + 1))
    assert {len(ids) for ids in got.values()} == {GLOBAL_BATCH}
    each_sample_once_per_epoch(got, STEPS_PER_EPOCH, SAMPLES)
    assert {s: sorted(v) for s, v in got.items()} == {s: sorted(v) for s, v in want.items()}
    # the final loss is the uninterrupted run's, within float noise (sums in another order)
    final, ref = result.rank_results["0"]["final_loss"], reference.rank_results["0"]["final_loss"]
    assert abs(final - ref) <= 1e-4 * ref, (final, ref)


@ray.remote(num_cpus=2)
class OtherWork:
    """Another job's work holding a node's CPUs (a busy cluster)."""

    def ready(self) -> bool:
        return True


def test_an_elastic_run_starts_below_num_nodes_on_the_nodes_there_are(below):
    """Three nodes asked for, two in the cluster (min_nodes 1): the run says so and trains on two."""
    tmp, result, out = below
    assert result.status == "succeeded", result.error
    assert ("raylaunch: elastic: asking for 3 nodes, 2 can hold the job now: starting on 2 nodes (world size 2, "
            "gradient accumulation 1); the run grows back when nodes come") in out, out
    assert len(result.rank_results) == 2 and {r["world_size"] for r in result.rank_results.values()} == {2}
    got = samples_by_step(tmp, "short")
    assert sorted(got) == list(range(1, STEPS_PER_EPOCH * EPOCHS + 1))  # 2 x 8 samples a step
    each_sample_once_per_epoch(got, STEPS_PER_EPOCH, SAMPLES)


def test_losing_the_rendezvous_node_trains_on_and_grows_onto_a_node_other_work_frees(ray_cluster, tmp_path):
    """Node 0 hosts the rendezvous store: losing it must not stop the run. The head is busy with
    other work, so the run's two nodes are the two others and node 0 can be removed; when the
    other work ends, the run grows back onto the head."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ray_cluster.add_node(**embedded_node(num_cpus=2))
    ray_cluster.wait_for_nodes()
    head = ray_cluster.head_node.node_id
    other = OtherWork.options(scheduling_strategy=NodeAffinitySchedulingStrategy(head, soft=False)).remote()
    ray.get(other.ready.remote(), timeout=60)
    run = Background(spec(tmp_path, "node0"))
    try:
        used = run.nodes_once_committed(tmp_path, 3)
        assert head not in used, "the head is held by other work"
        victim = next(n for n in ray_cluster.worker_nodes if n.node_id == used[0])
        ray_cluster.remove_node(victim)
        lost_at = time.monotonic()
        print(f"[{lost_at - run.out.began:6.1f}s] the test removed node 0")
        wait_for(lambda: any(r.get("world_size") == 1 and "ids" in r for r in rows(tmp_path, "node0")), 90,
                 "training on the node that is left")
        shrunk_s = time.monotonic() - lost_at
        # below num_nodes, the run asks an autoscaler for room for its two nodes
        assert autoscaler_request() == [run.driver.group.placement.bundle] * 2
        ray.kill(other)  # the other work ends: the head can take a bundle
        other = None
        wait_for(lambda: "nodes came back" in run.out.getvalue(), 60, "the driver to see the head free")
        (tmp_path / "pids" / "gate").touch()
    finally:
        if other is not None:
            ray.kill(other)
        run.join()
    result = run.result()
    assert result.status == "succeeded", result.error
    assert shrunk_s < 60, shrunk_s
    text = run.out.getvalue()
    assert "world size 2 -> 1 (node 0 lost); gradient accumulation 1 -> 2 keeps the global batch" in text
    assert "world size 1 -> 2 (nodes came back); gradient accumulation 2 -> 1 keeps the global batch" in text
    assert [(z["old_world_size"], z["new_world_size"]) for z in result.resizes] == [(2, 1), (1, 2)]
    assert autoscaler_request() == []  # withdrawn when the run was whole again
    assert result.restarts == 1 and result.attempts == 3
    got = samples_by_step(tmp_path, "node0")
    assert sorted(got) == list(range(1, STEPS_PER_EPOCH * EPOCHS + 1))
    assert {len(ids) for ids in got.values()} == {GLOBAL_BATCH}
    each_sample_once_per_epoch(got, STEPS_PER_EPOCH, SAMPLES)
    assert len([n for n in ray.nodes() if n["Alive"]]) == 2  # the shared cluster: a head and one node again


THREE = """
name: {name}
train_fn: fns:elastic
config: {{samples: 96, batch_size: 8, epochs: 3, every: 2, step_s: 0.3, pid_dir: {pid_dir}}}
scaling: {{num_nodes: 3, workers_per_node: 1, min_nodes: 1, keep_global_batch: {keep}}}
failure: {{max_restarts: 1}}
timeouts: {{heartbeat_s: 20, placement_s: 60, resize_s: 2}}
storage: {storage}
"""


def lose_a_node_mid_run(ray_cluster, tmp_path: Path, name: str, keep: bool):
    """Run the 3-node job, remove one of its nodes (not the head) after its first checkpoint; the
    cluster gets no node back. Returns the result, the driver's output and the lost node's rank."""
    spec = load_spec_text(THREE.format(name=name, keep=str(keep).lower(), pid_dir=tmp_path / "pids",
                                       storage=tmp_path / "runs"))
    run = Background(spec)
    try:
        used = run.nodes_once_committed(tmp_path, 1)
        victim = next(n for n in ray_cluster.worker_nodes if n.node_id in used)
        ray_cluster.remove_node(victim)
    finally:
        run.join(300)
    return run.result(), run.out.getvalue(), used.index(victim.node_id)


def three_nodes(ray_cluster) -> None:
    ray_cluster.add_node(num_cpus=2)  # the node the test removes: a head and one node are left
    ray_cluster.wait_for_nodes()
    assert len([n for n in ray.nodes() if n["Alive"]]) == 3


def test_three_nodes_with_two_left_keep_the_global_batch_on_one(ray_cluster, tmp_path):
    """keep_global_batch (the default): 2 nodes cannot take 3 nodes' micro-batches evenly; 1 can."""
    three_nodes(ray_cluster)
    result, text, lost = lose_a_node_mid_run(ray_cluster, tmp_path, "keep", keep=True)
    assert result.status == "succeeded", result.error
    assert ("2 nodes are there, but at 2 the global batch of 3 nodes x gradient accumulation 1 is not a whole "
            "number of micro-batches per node: running on 1 node (world size 1, gradient accumulation 3)") in text
    assert f"world size 3 -> 1 (node {lost} lost); gradient accumulation 1 -> 3 keeps the global batch" in text
    assert [(z["old_world_size"], z["new_world_size"], z["global_batch_kept"]) for z in result.resizes] == [
        (3, 1, True)]
    got = samples_by_step(tmp_path, "keep")
    assert {len(ids) for ids in got.values()} == {24} and len(got) == 12
    each_sample_once_per_epoch(got, 4, 96)
    assert len([n for n in ray.nodes() if n["Alive"]]) == 2  # the shared cluster: a head and one node again


def test_three_nodes_with_two_left_and_keep_global_batch_false_run_on_two(ray_cluster, tmp_path):
    """keep_global_batch: false runs on the two nodes there are, and says the global batch changed."""
    three_nodes(ray_cluster)
    result, text, lost = lose_a_node_mid_run(ray_cluster, tmp_path, "free", keep=False)
    assert result.status == "succeeded", result.error
    assert (f"world size 3 -> 2 (node {lost} lost); the global batch changes with it "
            "(scaling.keep_global_batch is false)") in text
    assert [(z["old_world_size"], z["new_world_size"], z["global_batch_kept"]) for z in result.resizes] == [
        (3, 2, False)]
    sizes = {r["world_size"]: len(r["ids"]) for r in rows(tmp_path, "free") if "ids" in r}
    assert sizes == {3: 8, 2: 8}  # the per-device batch stays; the global batch goes from 24 to 16
    assert len([n for n in ray.nodes() if n["Alive"]]) == 2  # the shared cluster: a head and one node again
