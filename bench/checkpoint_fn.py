"""The checkpoint bench's training function (bench/checkpoints.py): a model with about 600 MB of state a rank.

Each repetition, in alternating order, times Accelerate's own ``save_state`` to the node's local disk and
``session.save`` (committed on the run's storage), as the training loop sees them: the seconds until the call
returns, and for ``session.save`` the wait of the next optimizer step for the copies the save left to its write
(the hold the rank reports; the longest of any rank's). After each ``session.save`` it keeps stepping while that
save's background write runs and times those
steps; the reference is the steps just before each ``session.save`` (no write of any rank in flight), and the
steps before the first save. Rank 0 returns every figure.
"""

from __future__ import annotations

import resource
import shutil
import tempfile
import time

import torch
from accelerate import Accelerator

from cluster.runtime import get_session


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _writer_uss_mb(session) -> float:
    """The memory the rank's checkpoint writer process holds of its own (its torch; the segments it maps are the
    rank's copy, counted there)."""
    import psutil

    pid = session._checkpoints._writer.pid
    return psutil.Process(pid).memory_full_info().uss / 2**20 if pid else 0.0


def train(config: dict) -> dict:
    session = get_session()
    accelerator = Accelerator(**session.accelerator_kwargs())
    torch.manual_seed(0)
    width, layers = config.get("width", 2896), config.get("layers", 6)  # 6 x 2896^2 = 50M parameters, 200 MB
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)  # + 400 MB of moments: 600 MB of state
    model, optimizer = accelerator.prepare(model, optimizer)
    x = torch.randn(8, width)

    def step() -> float:
        began = time.perf_counter()
        accelerator.backward(model(x).square().mean())
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - began

    def writing(pending) -> bool:
        mine = pending is not None and pending.busy()
        return accelerator.reduce(torch.tensor([1.0 if mine else 0.0]), "sum").item() > 0

    steady = [step() for _ in range(config.get("warmup", 4))]
    before_saves_rss = _rss_mb()
    local = tempfile.mkdtemp(prefix="raylaunch-bench-savestate-")
    out = {"state_mb": sum(p.numel() * 3 * 4 for p in model.parameters()) / 2**20, "save_state_s": [],
           "session_save_s": [], "session_call_s": [], "steps_during_write_s": [], "steps_before_s": steady[1:],
           "steps_quiet_s": []}
    n = 0
    try:
        for rep in range(config.get("reps", 3)):
            order = ("save_state", "session") if rep % 2 == 0 else ("session", "save_state")
            for which in order:
                n += 1
                step()
                if which == "save_state":
                    session.wait_for_upload()  # a plain save alone, not beside a background write
                    began = time.perf_counter()
                    accelerator.save_state(f"{local}/{n}")
                    accelerator.wait_for_everyone()
                    out["save_state_s"].append(time.perf_counter() - began)
                    shutil.rmtree(f"{local}/{n}", ignore_errors=True)
                else:
                    session.wait_for_upload()
                    accelerator.wait_for_everyone()
                    out["steps_quiet_s"] += [step() for _ in range(config.get("quiet", 3))]
                    began = time.perf_counter()
                    session.save(accelerator, n)
                    out["session_call_s"].append(time.perf_counter() - began)
                    pending = getattr(session._checkpoints, "_upload", None)  # the background write, if any
                    # The next step waits for what the save left to copy: the hold is the call and that wait, as
                    # the rank reports it, the longest of any rank's.
                    out["steps_during_write_s"].append(step())
                    held = accelerator.gather(torch.tensor([session._checkpoints.last_hold_s]))
                    out["session_save_s"].append(held.max().item())
                    while writing(pending):  # every rank steps while any rank's write runs
                        out["steps_during_write_s"].append(step())
    finally:
        shutil.rmtree(local, ignore_errors=True)
    session.wait_for_upload()
    out["peak_rss_extra_mb"] = _rss_mb() - before_saves_rss
    out["writer_uss_mb"] = _writer_uss_mb(session)
    return out if accelerator.is_main_process else {"rank": accelerator.process_index}
