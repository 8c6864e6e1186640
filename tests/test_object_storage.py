"""Runs on an object store: a real S3-compatible server (moto) on 127.0.0.1, reached over HTTP.

The storage URI carries the endpoint (``?endpoint_override=...&scheme=http``), so the
driver, the node actors and the ranks open the same bucket; the dummy credentials
come from the environment every process inherits (see ``conftest.ray_cluster``).
"""

from __future__ import annotations

import contextlib
import io
import json
import threading
import time
from pathlib import Path

import pytest
from pyarrow import fs as pafs

from cluster.storage_io import join_uri, open_uri
from conftest import LoadsRecorded, dummy_aws_credentials, rank_session
from jobs.driver.driver import Driver
from jobs.run import appendlog as storage  # the growing files: their flush and segment bounds
from jobs.run.storage import CheckpointError, RunDir
from jobs.spec import load_spec_text

BUCKET = "raylaunch-test"

STEADY = """
name: {name}
train_fn: fns:steady
config: {{steps: {steps}, every: 10, step_s: 0.02, pid_dir: {pid_dir}}}
scaling: {{num_nodes: 2, workers_per_node: 1}}
failure: {{max_restarts: 0}}
storage: "{storage}"
"""


class S3Server:
    """moto's S3 app behind werkzeug on a free port; PUTs into ``.staging/`` can be made slow."""

    def __init__(self) -> None:
        from moto.server import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
        from werkzeug.serving import make_server

        self.slow_staging_s = 0.0
        self.staging_reads = 0  # GETs of an object in .staging/ (listings are GETs of the bucket)
        self.checkpoint_reads = 0  # GETs of an object in a committed checkpoint
        moto_app = DomainDispatcherApplication(create_backend_app)

        def app(environ, start_response):
            path = environ.get("PATH_INFO", "")
            if environ["REQUEST_METHOD"] == "GET" and "/.staging/" in path:
                self.staging_reads += 1
            if environ["REQUEST_METHOD"] == "GET" and "/checkpoints/checkpoint-" in path:
                self.checkpoint_reads += 1
            if (self.slow_staging_s and environ["REQUEST_METHOD"] == "PUT"
                    and "/.staging/" in path and not path.endswith("/")):  # not a folder marker
                time.sleep(self.slow_staging_s)  # a slow link to the store: each upload of data
            return moto_app(environ, start_response)

        class Quiet(MotoRequestHandler):
            def log_request(self, *args, **kwargs) -> None:  # one line per request otherwise
                pass

        self._server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=Quiet)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True, name="moto-s3")
        self._thread.start()

    def uri(self, prefix: str) -> str:
        return f"s3://{BUCKET}/{prefix}?endpoint_override=127.0.0.1:{self.port}&scheme=http&region=us-east-1"

    def fs(self) -> pafs.FileSystem:
        return pafs.FileSystem.from_uri(self.uri(""))[0]

    def read(self, key: str) -> bytes:
        with self.fs().open_input_stream(f"{BUCKET}/{key}") as f:
            return f.read()

    def keys(self, prefix: str) -> list[str]:
        infos = self.fs().get_file_info(pafs.FileSelector(f"{BUCKET}/{prefix}", recursive=True, allow_not_found=True))
        return sorted(i.path[len(BUCKET) + 1:] for i in infos if i.type == pafs.FileType.File)

    def stop(self) -> None:
        self._server.shutdown()
        self._thread.join(10)


@contextlib.contextmanager
def s3_server():
    """An S3 server with the test bucket, stopped at the end."""
    dummy_aws_credentials()
    server = S3Server()
    try:
        pafs.FileSystem.from_uri(server.uri("") + "&allow_bucket_creation=true")[0].create_dir(BUCKET)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def s3():
    with s3_server() as server:
        yield server


def stage(s3: S3Server, run: RunDir, attempt: int, step: int, ranks: list[int]) -> str:
    """What the ranks upload for one checkpoint."""
    uri = join_uri(run.staging_uri(attempt), f"checkpoint-{step:08d}")
    fs, path = open_uri(uri)
    with fs.open_output_stream(f"{path}/model.safetensors") as f:
        f.write(b"weights %d" % step)
    for r in ranks:
        with fs.open_output_stream(f"{path}/random_states_{r}.pkl") as f:
            f.write(b"rng %d" % r)
    return uri


def test_commit_on_the_bucket_writes_manifest_then_latest_and_prunes(s3):
    run = RunDir(s3.uri("unit"), "commit")
    run.prepare({"name": "commit"})
    assert "?endpoint_override=" in run.staging_uri(1)  # every URI handed out opens the same server
    run.checkpoints.commit(stage(s3, run, 1, 5, [0, 1]), 5, 1, world_size=2, keep=1)
    c = run.checkpoints.commit(stage(s3, run, 1, 10, [0, 1]), 10, 1, world_size=2, keep=1)
    assert c.name == "checkpoint-00000010" and c.uri.endswith(f"?endpoint_override=127.0.0.1:{s3.port}&scheme=http&region=us-east-1")
    manifest = json.loads(s3.read("unit/commit/checkpoints/checkpoint-00000010/manifest.json"))
    assert sorted(manifest["files"]) == ["model.safetensors", "random_states_0.pkl", "random_states_1.pkl"]
    assert manifest["files"]["model.safetensors"]["size"] == len(b"weights 10")
    assert json.loads(s3.read("unit/commit/checkpoints/latest.json")) == {"name": "checkpoint-00000010", "step": 10}
    # keep: 1 pruned step 5 after 10 was committed; staging is empty again
    assert [k for k in s3.keys("unit/commit/checkpoints") if k.endswith("manifest.json")] == \
        ["unit/commit/checkpoints/checkpoint-00000010/manifest.json"]
    assert s3.keys("unit/commit/.staging") == []
    assert run.checkpoints.loadable().step == 10


def test_an_uncommitted_or_tampered_checkpoint_on_the_bucket_is_never_loaded(s3):
    run = RunDir(s3.uri("unit"), "tamper")
    run.prepare({"name": "tamper"})
    run.checkpoints.commit(stage(s3, run, 1, 5, [0, 1]), 5, 1, world_size=2, keep=3)
    with pytest.raises(CheckpointError, match=r"lacks the part of ranks \[1\]"):
        run.checkpoints.commit(stage(s3, run, 1, 10, [0]), 10, 1, world_size=2, keep=3)
    assert run.checkpoints.latest().step == 5
    newest = run.checkpoints.commit(stage(s3, run, 2, 15, [0, 1]), 15, 2, world_size=2, keep=3)
    with s3.fs().open_output_stream(f"{BUCKET}/unit/tamper/checkpoints/{newest.name}/random_states_1.pkl") as f:
        f.write(b"rng 7")  # same size, other bytes
    said = []
    run = RunDir(s3.uri("unit"), "tamper")  # the next run's driver: it reads every file it did not commit itself
    assert run.checkpoints.loadable(warn=said.append).step == 5
    assert said and said[0].startswith(f"raylaunch: not loading s3://{BUCKET}/unit/tamper/checkpoints/checkpoint-00000015:")
    assert "random_states_1.pkl does not match the checksum in its manifest" in said[0]


def test_a_rank_loads_exactly_the_bytes_it_checked_and_nothing_altered_on_the_bucket(s3, tmp_path):
    """The rank-side check on an object store: the rank downloads the checkpoint, checks those
    files against the manifest, and hands Accelerate the same local copy."""
    run = RunDir(s3.uri("unit"), "rankside")
    run.prepare({"name": "rankside"})
    c = run.checkpoints.commit(stage(s3, run, 1, 5, [0]), 5, 1, world_size=1, keep=2)
    run.checkpoints.verify(c)  # what the driver checked before it started the attempt
    accelerator = LoadsRecorded()
    assert rank_session(tmp_path, run, c.uri).restore(accelerator) == 5
    ((path, files),) = accelerator.loaded
    assert not path.startswith("s3:") and not Path(path).exists()  # a local copy, gone after the load
    assert files["model.safetensors"] == b"weights 5" and files["random_states_0.pkl"] == b"rng 0"
    with s3.fs().open_output_stream(f"{BUCKET}/unit/rankside/checkpoints/{c.name}/random_states_0.pkl") as f:
        f.write(b"rng 9")  # a pickle swapped in on the bucket after the driver's check
    with pytest.raises(CheckpointError, match=r"checkpoint-00000005/random_states_0.pkl does not match the checksum"):
        rank_session(tmp_path, run, c.uri).restore(accelerator)
    assert len(accelerator.loaded) == 1  # nothing unpickled from it
    theirs = RunDir(s3.uri("unit"), "theirs")
    theirs.prepare({"name": "theirs"})
    other = theirs.checkpoints.commit(stage(s3, theirs, 1, 5, [0]), 5, 1, world_size=1, keep=2)
    with pytest.raises(CheckpointError, match="is not a committed checkpoint of this run"):
        rank_session(tmp_path, run, other.uri).restore(accelerator)


def test_the_rows_of_a_committed_step_are_on_the_bucket_before_the_driver_could_die(s3):
    """Found by `make chaos` (tests/test_chaos.py's elastic job on the bucket: a rank killed, a node actor killed in the
    recovery, the driver killed 0.1 s into a commit): a rank's metrics row of the step just committed was in the same
    poll as its part of the checkpoint, and was added to metrics.jsonl after the commit's flush; the killed driver never
    wrote it, the rerun resumed past that step, and the row (8 sample ids of epoch 0) was lost for good."""
    from cluster.protocol import CheckpointPart, Metrics
    from jobs.driver.routing import AttemptRouter, AttemptState

    run = RunDir(s3.uri("unit"), "rowsfirst")
    run.prepare({"name": "rowsfirst"})

    class Recorder:  # what the router asks of the driver's recorder: only the metrics are kept
        def metrics(self, records):
            run.append_metrics(records)

        def rows(self, batch):
            run.append_metric_text(batch.text)

        def mark(self, *args): pass
        def progress(self, *args): pass
        def say(self, *args): pass
        def event(self, *args): pass

    route = AttemptRouter(AttemptState(1, run.staging_uri(1), {0: 0}), Recorder(), run, keep=2)
    route.events([Metrics(time=1.0, rank=0, step=1, values={"loss": 1.0}).to_dict()])  # the first rows go out at once
    uri = stage(s3, run, 1, 2, [0])
    route.events([Metrics(time=2.0, rank=0, step=2, values={"loss": 0.5}).to_dict(),  # one poll: the row, then the part
                  CheckpointPart(time=2.1, rank=0, step=2, uri=uri).to_dict()])
    # the driver is killed here: nothing is flushed after the commit
    assert run.checkpoints.latest().step == 2
    assert [json.loads(line)["step"] for line in s3.read("unit/rowsfirst/metrics.jsonl").splitlines()] == [1, 2]


def test_gs_uris_keep_their_scheme_and_options_on_every_path_handed_out():
    """gs:// goes through the same pyarrow layer (no GCS server here: opening, not writing)."""
    storage = "gs://bucket/runs?endpoint_override=127.0.0.1:1&scheme=http"
    run = RunDir(storage, "g")
    assert type(run.fs).__name__ == "GcsFileSystem"
    assert run.uri == "gs://bucket/runs/g?endpoint_override=127.0.0.1:1&scheme=http"
    staging = run.staging_uri(3)
    assert staging == "gs://bucket/runs/g/.staging/attempt-3?endpoint_override=127.0.0.1:1&scheme=http"
    fs, path = open_uri(join_uri(staging, "checkpoint-00000005"))  # what a rank opens to save
    assert type(fs).__name__ == "GcsFileSystem" and path == "bucket/runs/g/.staging/attempt-3/checkpoint-00000005"


def test_metrics_on_the_bucket_survive_a_driver_that_never_closes(s3):
    """Object stores cannot append; what was flushed is in the object even if the driver dies."""
    run = RunDir(s3.uri("unit"), "append")
    run.prepare({"name": "append"})
    run.append_metrics([{"step": 1}])  # the first rows go out at once
    assert s3.read("unit/append/metrics.jsonl") == b'{"step": 1}\n'
    run.append_metrics([{"step": 2}])
    run.flush()  # what every commit and the end of a run do
    # the driver dies here, without close(); a rerun of the same run keeps appending
    rerun = RunDir(s3.uri("unit"), "append")
    rerun.append_metrics([{"step": 3}])
    rerun.close()
    assert [json.loads(line)["step"] for line in s3.read("unit/append/metrics.jsonl").splitlines()] == [1, 2, 3]


def test_stacks_of_a_hang_land_in_the_runs_logs_on_the_bucket(s3):
    run = RunDir(s3.uri("unit"), "stacks")
    run.prepare({"name": "stacks"})
    shown = run.write_stacks(2, "rank 0 (node 0, pid 7, read by py-spy)\n", {1: b"nccl trace"})
    keys = s3.keys("unit/stacks/logs")
    assert len(keys) == 2 and keys[0].startswith("unit/stacks/logs/nccl-trace-2-") and keys[0].endswith("-rank1")
    assert keys[1].startswith("unit/stacks/logs/stacks-2-") and shown == f"s3://{BUCKET}/{keys[1]}"
    assert s3.read(keys[1]).startswith(b"rank 0 (node 0") and s3.read(keys[0]) == b"nccl trace"


def test_a_growing_metrics_file_on_the_bucket_is_rewritten_less_often_as_it_grows(s3, monkeypatch):
    """Each rewrite sends the whole object: a long run's file must not go out every 2 s."""
    monkeypatch.setattr(storage, "OBJECT_FLUSH_S", 0.2)  # 2 s in production
    monkeypatch.setattr(storage, "OBJECT_REWRITE_BYTES_PER_S", 10_000)  # 1 MB/s in production
    run = RunDir(s3.uri("unit"), "grow")
    run.prepare({"name": "grow"})
    rows = [{"step": i, "loss": 0.5, "note": "x" * 100} for i in range(1, 1001)]  # ~130 KB in all
    run.append_metrics(rows[:500])  # the first rows go out at once
    assert len(s3.read("unit/grow/metrics.jsonl").splitlines()) == 500
    time.sleep(0.5)  # a small file would be due again now
    run.append_metrics(rows[500:900])  # 130 KB at 10 KB/s: not due for 13 s
    assert len(s3.read("unit/grow/metrics.jsonl").splitlines()) == 500
    # once due, the next rows take everything to the bucket without a flush
    monkeypatch.setattr(storage, "OBJECT_REWRITE_BYTES_PER_S", 10_000_000)  # now due after OBJECT_FLUSH_S
    time.sleep(0.5)
    run.append_metrics(rows[900:950])
    assert [json.loads(line)["step"] for line in s3.read("unit/grow/metrics.jsonl").splitlines()] == \
        list(range(1, 951))
    run.append_metrics(rows[950:])
    run.flush()  # every commit and the end of the run write it all
    assert [json.loads(line)["step"] for line in s3.read("unit/grow/metrics.jsonl").splitlines()] == \
        list(range(1, 1001))


def run_steady(s3, tmp_path, name: str, steps: int, out: io.StringIO | None = None, sets: list[str] | None = None):
    spec = load_spec_text(STEADY.format(name=name, steps=steps, pid_dir=tmp_path / "pids", storage=s3.uri("runs")),
                          sets)
    return Driver(spec, can_grow=False, out=out).run()


def test_a_multi_node_run_on_s3_commits_checkpoints_and_a_rerun_resumes(ray_cluster, s3, tmp_path):
    s3.staging_reads = 0
    first = run_steady(s3, tmp_path, "s3run", steps=30)
    assert first.status == "succeeded", first.error
    # The ranks hashed their parts on local disk: committing read nothing back from the bucket.
    assert s3.staging_reads == 0
    keys = s3.keys("runs/s3run")
    assert {"runs/s3run/spec.yaml", "runs/s3run/metrics.jsonl", "runs/s3run/result.json",
            "runs/s3run/checkpoints/latest.json"} <= set(keys)
    assert json.loads(s3.read("runs/s3run/checkpoints/latest.json")) == {"name": "checkpoint-00000030", "step": 30}
    manifest = json.loads(s3.read("runs/s3run/checkpoints/checkpoint-00000030/manifest.json"))
    assert {"model.safetensors", "random_states_0.pkl", "random_states_1.pkl"} <= set(manifest["files"])
    assert not [k for k in keys if "/.staging/" in k]
    result = json.loads(s3.read("runs/s3run/result.json"))
    assert result["status"] == "succeeded" and result["last_step"] == 30
    rows = [json.loads(line) for line in s3.read("runs/s3run/metrics.jsonl").splitlines()]
    assert sorted({r["rank"] for r in rows}) == [0, 1]
    assert [r["step"] for r in rows if r["rank"] == 0 and "loss" in r] == list(range(1, 31))

    out = io.StringIO()
    again = run_steady(s3, tmp_path, "s3run", steps=40, out=out)
    assert again.status == "succeeded", again.error
    assert f"resuming from s3://{BUCKET}/runs/s3run/checkpoints/checkpoint-00000030" in out.getvalue()
    assert again.rank_results["0"]["restored_step"] == 30 and again.rank_results["0"]["steps"] == 40
    assert json.loads(s3.read("runs/s3run/checkpoints/latest.json"))["step"] == 40
    rows = [json.loads(line) for line in s3.read("runs/s3run/metrics.jsonl").splitlines()]
    # the rerun appended to the first run's metrics: nothing lost, nothing twice
    assert [r["step"] for r in rows if r["rank"] == 0 and "loss" in r] == list(range(1, 41))


def test_a_slow_upload_does_not_hold_training_and_the_last_checkpoint_is_committed(ray_cluster, s3, tmp_path):
    s3.slow_staging_s = 5.0  # every upload of data into .staging/ takes 5 s
    try:
        began = time.monotonic()
        result = run_steady(s3, tmp_path, "slow", steps=20)
        took = time.monotonic() - began
    finally:
        s3.slow_staging_s = 0.0
    assert result.status == "succeeded", result.error
    first_save, second_save = result.rank_results["0"]["save_s"]
    first_at, second_at = result.rank_results["0"]["saved_at"]
    # the first save returned once the state was on local disk, long before its upload ended
    # (half the upload's time: a margin for a loaded machine, and still no wait for the upload)
    assert first_save < 2.5, result.rank_results
    # the second save (10 steps later) waited for the first upload, which cannot have ended before 5 s after the
    # first save began: one upload in flight, no pile-up (however slowly the steps between went on a loaded machine)
    assert second_at + second_save >= first_at + 5.0, result.rank_results
    # and the run did not finish before its last checkpoint was uploaded and committed
    assert json.loads(s3.read("runs/slow/checkpoints/latest.json")) == {"name": "checkpoint-00000020", "step": 20}
    assert [c.rsplit("/", 1)[-1].split("?")[0] for c in result.checkpoints][-1] == "checkpoint-00000020"
    assert took > 10.0, result.rank_results  # two uploads of at least 5 s each, one after the other
    # and it can be looked at where it lies: runs, show, plot, TensorBoard files in the bucket
    from jobs.runs import format_runs, format_show, plot

    storage = s3.uri("runs")
    row = next(line.split() for line in format_runs(storage).splitlines() if line.startswith("slow "))
    assert row[1:6] == ["succeeded", "2", "x", "1", "20"]
    assert "checkpoints (2 committed):" in format_show(storage, "slow")
    png = tmp_path / "slow.png"
    (curve,) = plot(storage, ["slow"], "loss", str(png))
    assert png.stat().st_size > 10_000 and curve.steps == list(range(1, 21))
    assert [k for k in s3.keys("runs/slow/tensorboard") if "events.out.tfevents" in k]


def test_async_false_on_s3_writes_before_the_save_returns_commits_and_resumes(ray_cluster, s3, tmp_path):
    """checkpoint.async: false on an object store: each save writes the rank's part to local disk before it returns
    (the upload still follows in the background); the commit happens, its manifest says how long training was held
    and when the checkpoint was committed, and a rerun resumes from it."""
    s3.slow_staging_s = 1.0  # every upload of data into .staging/ takes a second: longer than the local write
    try:
        first = run_steady(s3, tmp_path, "syncs3", steps=20, sets=["checkpoint.async=false"])
    finally:
        s3.slow_staging_s = 0.0
    assert first.status == "succeeded", first.error
    assert json.loads(s3.read("runs/syncs3/checkpoints/latest.json")) == {"name": "checkpoint-00000020", "step": 20}
    for step in (10, 20):
        manifest = json.loads(s3.read(f"runs/syncs3/checkpoints/checkpoint-{step:08d}/manifest.json"))
        assert {"model.safetensors", "random_states_0.pkl", "random_states_1.pkl"} <= set(manifest["files"])
        timing = manifest["timing"]
        # committed after the upload (a second at least), and never before the save returned
        assert 0 < timing["blocked_s"] < timing["to_commit_s"] < 60 and timing["to_commit_s"] >= 1.0, timing
        if step == 10:  # nothing in flight before it: held while written to local disk, not while uploaded
            assert timing["blocked_s"] < 1.0, timing
        # (step 20's save first waits for the rest of step 10's upload: one in flight per rank)
    rows = [json.loads(line) for line in s3.read("runs/syncs3/metrics.jsonl").splitlines()]
    held = {(r["rank"], r["step"]): r for r in rows if "checkpoint_blocked_s" in r}
    assert sorted(held) == [(0, 10), (0, 20), (1, 10), (1, 20)]
    assert all(r["checkpoint_host_mb"] == 0 and r["checkpoint_blocked_s"] > 0 for r in held.values()), held
    assert held[(0, 10)]["checkpoint_blocked_s"] < 1.0 and held[(1, 10)]["checkpoint_blocked_s"] < 1.0, held
    assert not [k for k in s3.keys("runs/syncs3") if "/.staging/" in k]

    out = io.StringIO()
    again = run_steady(s3, tmp_path, "syncs3", steps=30, out=out, sets=["checkpoint.async=false"])
    assert again.status == "succeeded", again.error
    assert f"resuming from s3://{BUCKET}/runs/syncs3/checkpoints/checkpoint-00000020" in out.getvalue()
    assert again.rank_results["0"]["restored_step"] == 20 and again.rank_results["0"]["steps"] == 30
    assert json.loads(s3.read("runs/syncs3/checkpoints/latest.json"))["step"] == 30


def test_a_long_run_on_the_bucket_writes_rolled_segments_that_readers_see_whole_and_in_order(s3, monkeypatch):
    """The driver holds one segment of each file, not the whole file; readers list them in order."""
    monkeypatch.setattr(storage, "SEGMENT_BYTES", 2_000)  # 4 MiB in production
    run = RunDir(s3.uri("unit"), "segments")
    run.prepare({"name": "segments"})
    for step in range(1, 101):  # ~45 bytes a row: a new segment every ~44 rows
        run.append_metrics([{"step": step, "rank": 0, "loss": 1.0 / step}])
        run.append_log(0, [f"step {step}"])
    run.flush()  # the driver dies here, without close(): what was flushed is on the bucket
    keys = s3.keys("unit/segments")
    metrics = [k for k in keys if "/metrics.jsonl" in k]
    assert metrics[:3] == ["unit/segments/metrics.jsonl", "unit/segments/metrics.jsonl.000001",
                           "unit/segments/metrics.jsonl.000002"]
    assert all(len(s3.read(k)) <= 2_000 for k in metrics)
    assert [r["step"] for r in RunDir(s3.uri("unit"), "segments").read_metrics()] == list(range(1, 101))
    # a rerun of the same run continues the last segment, and the readers still see every row once
    rerun = RunDir(s3.uri("unit"), "segments")
    rerun.append_metrics([{"step": step, "rank": 0, "loss": 0.5} for step in range(101, 121)])
    rerun.close()
    assert [r["step"] for r in RunDir(s3.uri("unit"), "segments").read_metrics()] == list(range(1, 121))
    # a segment also rolls when it is old, however small
    monkeypatch.setattr(storage, "SEGMENT_S", 0.2)  # 10 minutes in production
    aged = RunDir(s3.uri("unit"), "aged")
    aged.prepare({"name": "aged"})
    aged.append_metrics([{"step": 1}])
    time.sleep(0.4)
    aged.append_metrics([{"step": 2}])
    aged.close()
    assert [k for k in s3.keys("unit/aged") if "/metrics" in k] == \
        ["unit/aged/metrics.jsonl", "unit/aged/metrics.jsonl.000001"]
    assert [r["step"] for r in aged.read_metrics()] == [1, 2]


def test_many_rank_logs_on_the_bucket_roll_together_once_they_hold_too_much(s3, monkeypatch):
    """A thousand ranks' logs each holding part of a segment: the driver's memory stays bounded."""
    monkeypatch.setattr(storage, "HELD_BYTES", 5_000)  # 64 MiB in production
    run = RunDir(s3.uri("unit"), "held")
    run.prepare({"name": "held"})
    for _ in range(4):
        for rank in range(40):  # 40 ranks x 41 bytes a round: past 5 KB early in round 4, every file rolls
            run.append_log(rank, [f"rank {rank:02d} says something of fifty bytes..."])
    run.close()
    logs = s3.keys("unit/held/logs")
    # rank 39 wrote its fourth line after the roll: into its second segment
    assert "unit/held/logs/rank-39.log" in logs and "unit/held/logs/rank-39.log.000001" in logs
    text = b"".join(s3.read(k) for k in logs if k.startswith("unit/held/logs/rank-39.log"))
    assert text.decode().splitlines() == ["rank 39 says something of fifty bytes..."] * 4


def test_a_run_on_the_bucket_with_small_segments_reads_back_whole_in_runs_show_and_plot(
        ray_cluster, s3, tmp_path, monkeypatch):
    from jobs.runs import format_runs, format_show, plot

    monkeypatch.setattr(storage, "SEGMENT_BYTES", 1_500)  # a few rows a segment
    result = run_steady(s3, tmp_path, "segrun", steps=30)
    assert result.status == "succeeded", result.error
    keys = s3.keys("runs/segrun")
    assert len([k for k in keys if k.startswith("runs/segrun/metrics.jsonl")]) >= 3
    rows = RunDir(s3.uri("runs"), "segrun").read_metrics()
    assert [r["step"] for r in rows if r["rank"] == 0 and "loss" in r] == list(range(1, 31))
    assert {r["rank"] for r in rows} == {0, 1}
    storage_uri = s3.uri("runs")
    row = next(line.split() for line in format_runs(storage_uri).splitlines() if line.startswith("segrun "))
    assert row[1] == "succeeded" and row[5] == "30"
    (curve,) = plot(storage_uri, ["segrun"], "loss", str(tmp_path / "segrun.png"))
    assert curve.steps == list(range(1, 31))
    assert "loss" in format_show(storage_uri, "segrun").split("checkpoints")[0]  # its last metrics, read back


def test_a_restore_reads_the_checkpoint_once_per_node_however_many_ranks_it_has(s3, tmp_path):
    """The ranks of one node (threads here, each its own session) restore at once: one of them
    downloads and verifies, the others load that copy. GETs do not grow with ranks per node."""
    from cluster.context import assign_ranks
    from cluster.protocol import WorkerPayload
    from cluster.runtime import Session

    reads = {}
    for ranks in (1, 3):
        run = RunDir(s3.uri("unit"), f"pernode{ranks}")
        run.prepare({"name": f"pernode{ranks}"})
        c = run.checkpoints.commit(stage(s3, run, 1, 5, [0, 1, 2]), 5, 1, world_size=ranks, keep=2)  # same files
        node_dir = tmp_path / f"node-{ranks}"
        sessions = [Session(WorkerPayload(
            context=ctx, attempt=2, train_fn="fns:steady", config={}, events_path=str(node_dir / f"events-rank{i}.jsonl"),
            staging_uri=run.staging_uri(2), restore_uri=c.uri, backend="gloo"))
            for i, ctx in enumerate(assign_ranks([ranks]))]
        loaders = [LoadsRecorded() for _ in sessions]
        s3.checkpoint_reads = 0
        threads = [threading.Thread(target=s.restore, args=(a,)) for s, a in zip(sessions, loaders)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        reads[ranks] = s3.checkpoint_reads
        for a in loaders:  # every rank loaded the verified bytes
            ((path, files),) = a.loaded
            assert files["model.safetensors"] == b"weights 5"
        assert not any(node_dir.glob("restore-checkpoint-*/*"))  # the node's copy is gone after the last load
    assert reads[3] == reads[1] > 0, reads


def test_a_commit_meeting_a_store_that_refuses_for_some_seconds_is_tried_again(s3, capsys):
    """Found by `make chaos` (seed 5, digits on the object store: the store refusing requests during training, then
    stalling): the store answered the driver's commit with 503 ("Slow Down") and the driver ended the run
    "could not commit the checkpoint of step 45". A commit meeting an object store that refuses or does not answer
    is tried again (up to a minute), and commits once the store answers."""
    from bench.chaos import StoreProxy

    staged = RunDir(s3.uri("refused"), "run")
    staged.prepare({"name": "run"})
    uri = stage(s3, staged, 1, 5, [0, 1])
    proxy = StoreProxy(s3.port)
    try:
        through = RunDir(f"s3://{BUCKET}/refused?endpoint_override=127.0.0.1:{proxy.port}&scheme=http&region=us-east-1",
                         "run")
        proxy.start("refuse", 12.0)  # every request answered 503 for 12 s (the client's own retries give up)
        began = time.monotonic()
        c = through.checkpoints.commit(uri.replace(f"127.0.0.1:{s3.port}", f"127.0.0.1:{proxy.port}"), 5, 1,
                                      world_size=2, keep=2)
        assert time.monotonic() - began >= 11.5 and proxy.counts["503"] + proxy.counts["reset"] > 0
    finally:
        proxy.close()
    assert c.step == 5 and [k.step for k in staged.checkpoints.committed()] == [5]
    assert "committing the checkpoint of step 5 failed" in capsys.readouterr().err


def test_a_commit_whose_latest_pointer_the_store_refuses_is_finished_not_redone(s3, monkeypatch, capsys):
    """Found by `make chaos` (seed 7, digits on the object store: a node lost and the store refusing during a
    commit): the checkpoint of step 30 was in place with its manifest and its staging folder gone when the store
    refused the write of latest.json; the retry began the commit again, found no staged parts ("lacks the part of
    ranks [0, 1]") and the run ended failed, latest.json naming step 15. A retry now only finishes what is left."""
    run = RunDir(s3.uri("pointer"), "run")
    run.prepare({"name": "run"})
    run.checkpoints.commit(stage(s3, run, 1, 5, [0, 1]), 5, 1, world_size=2, keep=2)
    write, refused = run.files.write, []

    def refusing(path: str, data: bytes) -> None:  # the store's 503s, on the pointer's first two writes
        if path.endswith("latest.json") and len(refused) < 2:
            refused.append(path)
            raise OSError("When uploading 'latest.json': AWS Error SLOW_DOWN (HTTP status 503) during PutObject")
        write(path, data)

    monkeypatch.setattr(run.files, "write", refusing)
    c = run.checkpoints.commit(stage(s3, run, 1, 10, [0, 1]), 10, 1, world_size=2, keep=2)
    assert c.step == 10 and len(refused) == 2
    assert json.loads(s3.read("pointer/run/checkpoints/latest.json")) == {"name": "checkpoint-00000010", "step": 10}
    assert [k.step for k in run.checkpoints.committed()] == [5, 10] and run.checkpoints.loadable().step == 10
    assert not [k for k in s3.keys("pointer/run") if "/.staging/" in k], "the staged parts were removed"
    assert "committing the checkpoint of step 10 failed" in capsys.readouterr().err


def test_a_part_waiting_for_its_upload_waits_in_the_nodes_folder_of_the_attempt(s3, tmp_path):
    """#47: a rank killed while its checkpoint waited for the upload left raylaunch-ckpt-* in the temporary folder,
    for good. It waits in the node's folder of the attempt now, which goes with the node actor's scratch folder (at
    the job's end, or when the next node actor on the machine finds its process gone)."""
    import tempfile

    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from cluster.checkpoint.staged import StagedCheckpoints
    from cluster.context import WorkerContext

    AcceleratorState._reset_state(True)
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(torch.nn.Linear(8, 8), torch.optim.SGD(torch.nn.Linear(8, 8).parameters()))
    node_dir = tmp_path / "node0-x" / "attempt-1"
    node_dir.mkdir(parents=True)
    ctx = WorkerContext(world_rank=0, local_rank=0, node_rank=0, world_size=1, local_world_size=1, num_nodes=1)
    checkpoints = StagedCheckpoints(s3.uri("runs/up/.staging/attempt-1"), None, lambda *a, **k: None, context=ctx,
                                    node_dir=str(node_dir), background=True)
    before = set(Path(tempfile.gettempdir()).glob("raylaunch-ckpt-*"))
    s3.slow_staging_s = 3.0
    try:
        checkpoints.save(accelerator, 7)
        waiting = list(node_dir.glob("raylaunch-ckpt-00000007-*"))
        assert len(waiting) == 1, list(node_dir.iterdir())  # where its files are written, then uploaded from
        assert set(Path(tempfile.gettempdir()).glob("raylaunch-ckpt-*")) <= before  # none in the temporary folder
        checkpoints.wait_for_upload()
    finally:
        s3.slow_staging_s = 0.0
        checkpoints._writer.close()
        AcceleratorState._reset_state(True)
    assert not list(node_dir.glob("raylaunch-ckpt-*"))  # uploaded: gone
    assert [k for k in s3.keys("runs/up/.staging/attempt-1/checkpoint-00000007") if k.endswith("model.safetensors")]
