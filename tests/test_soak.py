"""`make soak`, short: jobs back to back on one warm two-node `ray start` cluster leave nothing behind.

bench/soak.py's own cluster, jobs and samples: a rank SIGKILLed after a commit (restarted, succeeding), then a job
stopped with `raylaunch stop`; after the second, what raylaunch holds on the machine is what it held after the first
(its temporary folders, its processes, the warm hosts' open files), and every job's outcome is right.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import psutil

from bench.soak import Job, Soak, WarmCluster, sample


def test_jobs_back_to_back_leave_no_folder_process_or_open_file_behind():
    work = Path(tempfile.mkdtemp(prefix="raylaunch-soak-test-"))
    cluster = WarmCluster()
    try:
        soak = Soak(work, cluster, store=None)
        jobs, samples = [], []
        for i, kind in enumerate(("rank_kill", "stop"), start=1):
            job = Job(i, kind, f"soak-{i}-{kind.replace('_', '-')}")
            soak.run(job)
            jobs.append(job)
            samples.append(sample(cluster))
        assert [j.problems for j in jobs] == [[], []], [j.problems for j in jobs]
        keys = ("raylaunch_tmp_mb", "raylaunch_processes", "warm_hosts", "warm_host_fds")
        assert {k: samples[1][k] for k in keys} == {k: samples[0][k] for k in keys}, samples
        assert samples[0]["warm_hosts"] == 2 and samples[0]["raylaunch_processes"] == 2  # a warm host per node, idle
        # each job's driver on the head says in result.json how much memory it took (a Python with Ray: 100+ MB)
        memory = [j.driver_rss_mb for j in jobs]
        assert all(m is not None and 50 < m < 2000 for m in memory), memory
    finally:
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)
    # the cluster and its warm hosts are gone, by PID
    assert not [p for p in psutil.process_iter() if cluster.ours(p)]


def test_the_soak_verdict_fails_a_figure_that_grows_and_passes_flat_ones():
    from bench.soak import LIMITS, judge

    flat = [{k: 10.0 for k in LIMITS} for _ in range(12)]
    assert judge(flat)[1] == []
    leaking = [{**s, "raylaunch_tmp_mb": 10.0 + 0.3 * i, "ray_session_mb": 5.0 + i} for i, s in enumerate(flat)]
    grew = judge(leaking)[1]  # 0.3 MiB a job of raylaunch's over the last 8 jobs; Ray's own logs are not judged
    assert len(grew) == 1 and grew[0].startswith("raylaunch_tmp_mb grew +2.10 over the last 8 jobs"), grew


def test_drivers_of_different_kinds_are_judged_each_against_its_own_kind():
    """A driver on an object store holds 25 MB more than one on a path: a run ending on one is no growth; a driver
    that grows over the jobs of its kind is."""
    from bench.soak import LIMITS, driver_figures, judge

    def run(memory):
        jobs, samples = [], []
        for i in range(1, 25):
            kind = ("ok", "s3")[i % 2]
            job = Job(i, kind, f"j{i}", ok=True, driver_rss_mb=memory(i, kind))
            jobs.append(job)
            samples.append({**{k: 10.0 for k in LIMITS}, **driver_figures(job, jobs)})
        return judge(samples)[1]

    assert run(lambda i, kind: 144.0 if kind == "ok" else 169.0) == []
    grew = run(lambda i, kind: (144.0 if kind == "ok" else 169.0) + 0.5 * i)
    assert len(grew) == 1 and grew[0].startswith("driver_rss_over_kind_mb grew"), grew
