"""Chaos, short: `make chaos`'s injector (bench/chaos.py) on the shared multi-node Ray cluster, three faults of a
fixed schedule, one landing inside the recovery from the one before and one inside a commit, then the object store
the run is kept on stalling mid-upload; the elastic job ends with every sample of every epoch seen once, the global
batch kept, its storage consistent and no process left."""

from __future__ import annotations

import random

import pytest

from bench.chaos import Chaos, Fault, ObjectStore, StoreProxy, check_job, make_job, mount_small_disk, unmount_small_disk

THREE = [Fault("rank_kill", "training", 1.0, 0), Fault("actor_kill", "recovery", 0.5, 0),
         Fault("driver_kill", "commit", 0.1, 0)]
STALL = Fault("store_stall", "commit", 0, 3.0)  # from the next upload into staging, 3 s


@pytest.fixture
def store(tmp_path):
    """moto's S3 server and chaos's proxy in front of it (the credentials: conftest.ray_cluster set them)."""
    server = ObjectStore(tmp_path / "moto.log")
    proxy = StoreProxy(server.port)
    try:
        yield server, proxy
    finally:
        proxy.close()
        server.stop()


def test_three_faults_one_in_a_recovery_one_in_a_commit_are_survived(ray_cluster, store, tmp_path):
    server, proxy = store
    chaos = Chaos(ray_cluster, tmp_path / "runs", None, random.Random(33), say=print, proxy=proxy)
    job = make_job(tmp_path, ObjectStore.uri("runs", proxy.port), ray_cluster.address, "elastic", "chaos", epochs=4,
                   step_s=0.3, reads=ObjectStore.uri("runs", server.port))
    injected = chaos.run_job(job, [*THREE, STALL], timeout_s=150)
    assert [i.skipped for i in injected] == ["", "", "", ""], (injected, job.log.read_text()[-4000:])
    assert proxy.counts["held"] > 0 and "/.staging/" in proxy.fired_on, (proxy.counts, proxy.fired_on)  # mid-upload
    outcome = check_job(chaos, job, injected, None, 4, {})
    assert outcome.survived, (outcome.status, outcome.problems, job.log.read_text()[-3000:])
    assert outcome.attempts >= 3 and outcome.launches == 2  # result.json counts restarts per command: see #33


def test_a_disk_full_inside_a_recovery_does_not_fail_the_run(ray_cluster, tmp_path):
    """Found by `make chaos` (seed 1): a rank killed, then the storage's disk full for a few seconds while the
    driver started the next attempt; writing result.json there raised ENOSPC and the driver failed the run."""
    disk = tmp_path / "disk"
    if not mount_small_disk(disk, "32m"):
        pytest.skip("cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN)")
    try:
        chaos = Chaos(ray_cluster, disk, disk, random.Random(1), say=print)
        job = make_job(tmp_path, disk, ray_cluster.address, "elastic", "full", epochs=3, step_s=0.3)
        faults = [Fault("rank_kill", "training", 0.5, 0), Fault("disk_full", "recovery", 1.0, 15)]
        injected = chaos.run_job(job, faults, timeout_s=150)
        assert [i.skipped for i in injected] == ["", ""], (injected, job.log.read_text()[-4000:])
        outcome = check_job(chaos, job, injected, None, 3, {})
        assert outcome.survived, (outcome.status, outcome.problems, job.log.read_text()[-3000:])
    finally:
        unmount_small_disk(disk)
