"""Where each rank is, without Ray: grouping stacks, reading real processes (py-spy and the
faulthandler signal), and a failed rank's traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from cluster import stacks
from cluster.stacks import Frame, RankStack, find_stragglers, ThreadStack, group_stacks, sample_processes, stack_from_traceback

SITE = "/venv/lib/python3.11/site-packages"


def _rank(rank: int, frames: list[tuple[str, str, int]], **kw) -> RankStack:
    main = ThreadStack("MainThread", tuple(Frame(*f) for f in frames), main=True)
    beat = ThreadStack("raylaunch-heartbeat", (Frame("beat", "/proj/cluster/rank/worker.py", rank),))
    return RankStack(rank, rank // 2, 100 + rank, (beat, main), **kw)


IN_ALL_REDUCE = [("all_reduce", f"{SITE}/torch/distributed/distributed_c10d.py", 2800),
                 ("wrapper", f"{SITE}/torch/distributed/c10d_logger.py", 81),
                 ("Accelerator.backward", f"{SITE}/accelerate/accelerator.py", 2400),
                 ("train", "/proj/train.py", 57),
                 ("run_worker", "/proj/cluster/rank/worker.py", 120),
                 ("wrapper", f"{SITE}/torch/distributed/elastic/multiprocessing/errors/__init__.py", 367)]
IN_DATA = [("__getitem__", "/proj/data.py", 12),
           ("fetch", f"{SITE}/torch/utils/data/_utils/fetch.py", 52),
           ("train", "/proj/train.py", 50),
           ("wrapper", f"{SITE}/torch/distributed/elastic/multiprocessing/errors/__init__.py", 367)]


def test_ranks_with_the_same_stack_are_one_line_and_the_odd_one_is_named():
    out = group_stacks([_rank(0, IN_ALL_REDUCE), _rank(1, IN_DATA), _rank(2, IN_ALL_REDUCE), _rank(3, IN_ALL_REDUCE),
                        RankStack(4, 2, 104, how="", error="py-spy: Permission denied", note="sleeping")])
    assert out.splitlines() == [
        "[ranks 0, 2, 3] in all_reduce (train.py:57 <- accelerate Accelerator.backward)",
        "[rank 1] in __getitem__ (data.py:12)",
        "[rank 4] could not be read (sleeping): py-spy: Permission denied",
    ]


def test_grouping_follows_the_main_thread_and_a_stopped_rank_says_so():
    # other threads (the heartbeat here) differ from rank to rank; the main thread decides
    out = group_stacks([_rank(0, IN_DATA, note="stopped (SIGSTOP)"), _rank(1, IN_DATA, note="sleeping")])
    assert out.splitlines() == ["[rank 0] in __getitem__ (data.py:12) [stopped (SIGSTOP)]",
                                "[rank 1] in __getitem__ (data.py:12)"]
    running = group_stacks([_rank(0, IN_DATA, note="sleeping"), _rank(1, IN_DATA, note="running")])
    assert running == "[ranks 0, 1] in __getitem__ (data.py:12)"


def test_a_failed_ranks_traceback_is_its_last_stack():
    tb = textwrap.dedent('''\
        Traceback (most recent call last):
          File "/proj/train.py", line 57, in train
            accelerator.reduce(x)
          File "%s/torch/distributed/distributed_c10d.py", line 2800, in all_reduce
            work.wait()
        RuntimeError: Timed out waiting 5000ms for recv operation to complete
        ''' % SITE)
    s = stack_from_traceback(0, 0, tb)
    assert s.how == "traceback" and [f.function for f in s.main.frames] == ["all_reduce", "train"]
    assert group_stacks([s]) == "[rank 0] in all_reduce (train.py:57 <- torch all_reduce) [failed]"
    assert stack_from_traceback(0, 0, "killed by signal SIGKILL") is None


SLEEPER = textwrap.dedent('''\
    import sys, time
    from cluster.stacks import install_signal_dump
    install_signal_dump(sys.argv[1])
    def load_batch():
        print("ready", flush=True)
        time.sleep(600)
    load_batch()
    ''')


@pytest.fixture
def sleeper(tmp_path):
    dump = str(tmp_path / "rank.stacks")
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    p = subprocess.Popen([sys.executable, "-c", SLEEPER, dump], stdout=subprocess.PIPE, text=True, env=env)
    assert p.stdout.readline().strip() == "ready"
    yield p, dump
    p.kill()
    p.wait()


def stop(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while psutil.Process(pid).status() != psutil.STATUS_STOPPED:
        assert time.monotonic() < deadline, "the process did not stop"
        time.sleep(0.01)


def _frames(s: RankStack) -> list[str]:
    return [f"{f.function}:{f.line}" for f in s.main.frames]


def test_py_spy_reads_a_live_process_and_a_stopped_one(sleeper):
    p, dump = sleeper
    [s] = sample_processes({3: p.pid}, node_rank=1, dump_paths={3: dump})
    assert s.error is None and s.how == "py-spy" and (s.rank, s.node_rank, s.pid) == (3, 1, p.pid)
    assert _frames(s)[0] == "load_batch:6" and group_stacks([s]).startswith("[rank 3] in load_batch (<string>:6)")
    stop(p.pid)
    try:
        began = time.monotonic()
        [s] = sample_processes({3: p.pid}, node_rank=1, dump_paths={3: dump})
        assert time.monotonic() - began < stacks.SAMPLE_TIMEOUT_S
        assert s.error is None and s.note == "stopped (SIGSTOP)" and _frames(s)[0] == "load_batch:6"
    finally:
        os.kill(p.pid, signal.SIGCONT)


def test_without_py_spy_the_rank_answers_the_signal_with_its_own_stacks(sleeper, monkeypatch):
    p, dump = sleeper
    monkeypatch.setattr(stacks, "_py_spy", lambda: None)  # as where ptrace is refused
    [s] = sample_processes({0: p.pid}, node_rank=0, dump_paths={0: dump})
    assert s.error is None and s.how == "faulthandler" and s.main.frames[0].function == "load_batch"
    # a stopped process cannot answer a signal: it is named, with why, within the bound
    stop(p.pid)
    try:
        [s] = sample_processes({0: p.pid}, node_rank=0, dump_paths={0: dump})
        assert group_stacks([s]) == "[rank 0] could not be read (stopped (SIGSTOP)): py-spy is not installed"
    finally:
        os.kill(p.pid, signal.SIGCONT)


def test_the_rank_the_others_wait_for_is_named_a_straggler():
    waiting = [("_engine_run_backward", f"{SITE}/torch/autograd/graph.py", 829),
               ("Accelerator.backward", f"{SITE}/accelerate/accelerator.py", 2400), ("train", "/proj/train.py", 57)]
    readings = [[_rank(0, waiting), _rank(1, IN_DATA if i % 5 else waiting), _rank(2, IN_ALL_REDUCE if i % 4 else IN_DATA)]
                for i in range(10)]
    assert find_stragglers(readings) == ("straggler: rank 1, which the others wait for (waited in a collective "
                                         "in 10 readings: rank 0 100%, rank 1 20%, rank 2 70%)")
    # ranks that wait alike (or all compute) have no straggler
    assert find_stragglers([[_rank(0, IN_ALL_REDUCE), _rank(1, IN_ALL_REDUCE)]] * 5) == \
        "no straggler: waited in a collective in 5 readings: rank 0 100%, rank 1 100%"
    assert find_stragglers([[_rank(0, IN_DATA), _rank(1, IN_DATA)]] * 5).startswith("no straggler: ")
