"""A rank's end is python's end (cluster/rank/exiting.py), checked in a process of its own that ends with os._exit
as a rank does: the training code's atexit handlers run, its open files and its threads' writes reach the disk, and
nothing there changes how the code ended."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import ROOT

RANK = textwrap.dedent("""
    import atexit, io, os, threading, time
    from cluster.rank.exiting import as_python_ends, end_process

    atexit.register(lambda: open("inherited.txt", "w").write("ran"))  # the host's, before the fork: not the rank's

    class Gone(io.RawIOBase):  # a stream of a library's whose far end is gone
        def writable(self):
            return True
        def write(self, b):
            raise RuntimeError("bucket gone")

    broken = io.BufferedWriter(Gone())
    broken.write(b"pending")
    left_open = open("open.txt", "w")
    left_open.write("left open")
    by_thread = open("thread.txt", "w")

    def late():
        time.sleep(0.3)
        by_thread.write("written after the code ended")

    try:
        with as_python_ends():
            atexit.register(lambda: open("handler.txt", "w").write("ran"))
            threading.Thread(target=late).start()
            raise ValueError("the training code's own error")
    except ValueError as exc:
        print("raised:", exc, flush=True)
    end_process()
    os._exit(0)
""")


def test_a_ranks_end_runs_its_handlers_and_writes_its_files_and_keeps_its_outcome(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", RANK], cwd=tmp_path, env={"PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "raised: the training code's own error\n"  # the code's exception, not the flush's
    assert (tmp_path / "handler.txt").read_text() == "ran"
    assert not (tmp_path / "inherited.txt").exists()
    assert (tmp_path / "open.txt").read_text() == "left open"
    assert (tmp_path / "thread.txt").read_text() == "written after the code ended"
    assert "a file left open could not be written at the rank's end (RuntimeError: bucket gone)" in proc.stderr
