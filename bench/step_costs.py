"""Where raylaunch's time on a training step goes, cause by cause, in microseconds (#58): `python -m bench.step_costs`.

One process, no Ray, world size 1 (gloo): a tiny model's step (the regime of a GPU step, where fixed costs show) with
each of raylaunch's per-step parts on, against the same step without it, in alternating blocks of the same process
(the machine's other load cancels out), each part alone:

- ``loader``: the prepared dataloader's ``__iter__`` wrapper (``data_wait``: two clock reads and the meter a batch);
- ``backward``: the gradient hooks and end-of-backward callback of ``sync_wait``;
- ``optimizer``: the optimizer step hooks (the step counter; the checkpoint writer's pre-hook);
- ``log``: ``session.log`` of one row (the event written to the rank's events file);
- ``all``: every part at once, as a rank under the runner runs.

Prints a table and writes ``bench/results-step-costs.md``; STEP_COST_BLOCKS=<n> (default 40) blocks of 50 steps a
part and arm.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = int(os.environ.get("STEP_COST_BLOCKS", "40"))
STEPS = 50


def main() -> int:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", ACCELERATE_USE_CPU="true")
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from cluster.rank.pace import install as install_pace

    pace = install_pace(lambda window: None)  # the loader wrapper, the backward hooks, the step counter
    accelerator = Accelerator()
    torch.manual_seed(0)

    def net() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128))

    data = torch.utils.data.TensorDataset(torch.randn(8 * 4096, 128), torch.randn(8 * 4096, 128))
    hooked = net()
    plain = torch.nn.parallel.DistributedDataParallel(net())  # the same model, never prepared: no hooks
    hooked_opt = torch.optim.SGD(hooked.parameters(), lr=1e-3)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=1e-3)
    hooked, hooked_opt, loader = accelerator.prepare(hooked, hooked_opt,
                                                     torch.utils.data.DataLoader(data, batch_size=8))
    untimed = type(loader).__iter__.__wrapped__
    session, events = _session(tempfile.mkdtemp(prefix="step-costs-"))

    state = {"it": None, "unwrapped": None}

    def batch(timed: bool):
        key = "it" if timed else "unwrapped"
        for _ in range(2):
            if state[key] is None:
                state[key] = iter(loader) if timed else untimed(loader)
            try:
                return next(state[key])
            except StopIteration:
                state[key] = None
        raise RuntimeError("empty loader")

    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

    def step(loader_on: bool, backward_on: bool, optimizer_on: bool, log_on: bool, n: int) -> float:
        model, opt = (hooked, hooked_opt) if backward_on else (plain, plain_opt)
        pre, post = dict(_global_optimizer_pre_hooks), dict(_global_optimizer_post_hooks)
        if not optimizer_on:
            _global_optimizer_pre_hooks.clear()
            _global_optimizer_post_hooks.clear()
        try:
            began = time.perf_counter()
            for i in range(n):
                x, y = batch(loader_on)
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                if log_on:
                    session.log({"loss": 0.5}, i)
            return (time.perf_counter() - began) / n
        finally:
            _global_optimizer_pre_hooks.update(pre)
            _global_optimizer_post_hooks.update(post)

    parts = {"loader": (True, False, False, False), "backward": (False, True, False, False),
             "optimizer": (False, False, True, False), "log": (False, False, False, True),
             "all": (True, True, True, True)}
    base = (False, False, False, False)
    step(*parts["all"], 200)  # warm: the hooks learn which gradients come last, allocator, caches
    step(*base, 200)
    rows = []
    for name, on in parts.items():
        with_, without = [], []
        for b in range(BLOCKS):
            order = (on, base) if b % 2 == 0 else (base, on)
            for arm in order:
                (with_ if arm is on else without).append(step(*arm, STEPS))
        added = [1e6 * (a - b) for a, b in zip(with_, without)]
        rows.append((name, 1e3 * statistics.median(without), statistics.median(added),
                     statistics.quantiles(added, n=10)[-1]))
    pace.report()
    session.flush_metrics()
    lines = [f"One process, world size 1 (gloo), a 33k-parameter MLP, batch 8, {BLOCKS} alternating blocks of {STEPS} "
             f"steps a part and arm, {time.strftime('%Y-%m-%d')}; added = the step with the part on minus without, "
             "per block pair.", "",
             "| part | step without it | added a step (median) | added (90th percentile of block pairs) |",
             "|---|---|---|---|"]
    for name, base_ms, med, p90 in rows:
        lines.append(f"| {name} | {base_ms:.3f} ms | {med:+.1f} us | {p90:+.1f} us |")
    text = "\n".join(lines) + "\n"
    print(text)
    (ROOT / "bench" / "results-step-costs.md").write_text(text)
    dist.destroy_process_group()
    events.unlink(missing_ok=True)
    return 0


def _session(folder: str):
    """A rank's session writing its events where a node actor would tail them."""
    from cluster.context import WorkerContext
    from cluster.protocol import WorkerPayload
    from cluster.rank.session import Session

    events = Path(folder) / "events-rank0.jsonl"
    ctx = WorkerContext(world_rank=0, local_rank=0, node_rank=0, world_size=1, local_world_size=1, num_nodes=1)
    payload = WorkerPayload(context=ctx, attempt=1, train_fn="x:y", config={}, events_path=str(events),
                            staging_uri=str(Path(folder) / "staging"), restore_uri=None, backend="gloo")
    return Session(payload), events


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())
