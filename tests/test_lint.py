"""No name in the project is undefined, unused or shadowed before use (pyflakes' checks, through ruff): the class of
bug that made every `raylaunch run --local-nodes` fail once (a local named `cluster` shadowing the package)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_no_name_is_undefined_unused_or_shadowed():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent))
    assert ruff, "ruff is not installed beside this Python: pip install -e '.[test]' (make install does)"
    out = subprocess.run([ruff, "check", "--isolated", "--select", "F", "--output-format", "concise",
                          "cluster", "jobs", "train_fn", "bench", "tests"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
