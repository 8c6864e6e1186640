"""What raylaunch's own code costs a training step, part by part, in microseconds (#58): `python -m bench.step_costs`.

One process, no Ray and no collective (their noise on this 2-core machine is hundreds of microseconds a step): a tiny
model's step (the regime of a GPU step, where fixed costs show) with each of raylaunch's per-step parts on, against
the same step without it, in alternating blocks (the machine's other load cancels out), each part alone:

- ``loader``: the prepared dataloader's ``__iter__`` wrapper (``data_wait``: two clock reads and the meter a batch);
- ``backward``: the gradient hooks and end-of-backward callbacks of ``sync_wait`` (installed on the model as a rank of
  a world of several has them; a world of one has none);
- ``optimizer``: the optimizer step hooks (the step counter; the checkpoint writer's pre-hook);
- ``log``: ``session.log`` of one row (its line written to the rank's events file: by a thread, in batches; each
  block writes its own rows before its clock stops, so the batch's cost is the block's);
- ``all``: every part at once, as a rank under the runner runs.

The wall clock and the process's CPU time of each block; the median of the block pairs' differences. Prints a table
and writes ``bench/results-step-costs.md``; STEP_COST_BLOCKS=<n> (default 60) blocks of 100 steps a part and arm.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = int(os.environ.get("STEP_COST_BLOCKS", "60"))
STEPS = 100


def main() -> int:
    import torch
    from accelerate import Accelerator
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

    from cluster.rank.pace import PaceMeter, _LastGradients
    from cluster.rank.pace import install as install_pace

    torch.set_num_threads(1)
    pace = install_pace(lambda window: None)  # the loader wrapper and the step counter
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)

    def net() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128))

    data = torch.utils.data.TensorDataset(torch.randn(8 * 4096, 128), torch.randn(8 * 4096, 128))
    hooked, plain = net(), net()
    hooked_opt = torch.optim.SGD(hooked.parameters(), lr=1e-3)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=1e-3)
    loader = accelerator.prepare(torch.utils.data.DataLoader(data, batch_size=8))
    hooks = _LastGradients(pace.meter if isinstance(pace.meter, PaceMeter) else PaceMeter(), hooked,
                           [p for p in hooked.parameters()])  # what prepare adds in a world of several
    untimed = type(loader).__iter__.__wrapped__
    folder = tempfile.mkdtemp(prefix="step-costs-")
    session = _session(folder)
    iterators: dict[bool, object] = {}

    def batch(timed: bool):
        for _ in range(2):
            if iterators.get(timed) is None:
                iterators[timed] = iter(loader) if timed else untimed(loader)
            try:
                return next(iterators[timed])
            except StopIteration:
                iterators[timed] = None
        raise RuntimeError("empty loader")

    def block(loader_on: bool, backward_on: bool, optimizer_on: bool, log_on: bool) -> tuple[float, float]:
        model, opt = (hooked, hooked_opt) if backward_on else (plain, plain_opt)
        if backward_on:  # the other blocks' time is no gap between its backwards: a run's come back to back (the
            hooks._timed_at = None  # pace it samples them at is read within its blocks, or it timed twice as many)
        pre, post = dict(_global_optimizer_pre_hooks), dict(_global_optimizer_post_hooks)
        if not optimizer_on:
            _global_optimizer_pre_hooks.clear()
            _global_optimizer_post_hooks.clear()
        try:
            began, cpu = time.perf_counter(), time.process_time()
            for i in range(STEPS):
                x, y = batch(loader_on)
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                if log_on:
                    session.log({"loss": 0.5}, i)
            if log_on:
                session.write_rows()  # the block pays for its rows' lines, which a thread writes in batches
            return (time.perf_counter() - began) / STEPS, (time.process_time() - cpu) / STEPS
        finally:
            _global_optimizer_pre_hooks.update(pre)
            _global_optimizer_post_hooks.update(post)

    parts = {"loader": (True, False, False, False), "backward": (False, True, False, False),
             "optimizer": (False, False, True, False), "log": (False, False, False, True),
             "all": (True, True, True, True)}
    base = (False, False, False, False)
    for _ in range(3):  # warm: the hooks learn which gradients come last, the allocator, the caches
        block(*parts["all"])
        block(*base)
    rows = []
    for name, on in parts.items():
        pairs = []
        for b in range(BLOCKS):
            first, second = (on, base) if b % 2 == 0 else (base, on)
            a, z = block(*first), block(*second)
            pairs.append((a, z) if first is on else (z, a))
        wall = [1e6 * (w[0] - o[0]) for w, o in pairs]
        cpu = [1e6 * (w[1] - o[1]) for w, o in pairs]
        rows.append((name, 1e3 * statistics.median(o[0] for _, o in pairs), statistics.median(wall),
                     statistics.quantiles(wall, n=10)[-1], statistics.median(cpu)))
    lines = [f"One process, no collective, a 33k-parameter MLP, batch 8, {BLOCKS} alternating blocks of {STEPS} steps "
             f"a part and arm, {time.strftime('%Y-%m-%d')}; added = the block with the part on minus the block without, "
             "a step, median of the pairs.", "",
             "| part | step without it | added a step (median) | added (90th percentile of the pairs) "
             "| CPU added a step (median) |",
             "|---|---|---|---|---|"]
    for name, base_ms, med, p90, cpu_med in rows:
        lines.append(f"| {name} | {base_ms:.3f} ms | {med:+.1f} us | {p90:+.1f} us | {cpu_med:+.1f} us |")
    text = "\n".join(lines) + "\n"
    print(text)
    (ROOT / "bench" / "results-step-costs.md").write_text(text)
    import shutil

    shutil.rmtree(folder, ignore_errors=True)
    return 0


def _session(folder: str):
    """A rank's session writing its events where a node actor would tail them."""
    from cluster.context import WorkerContext
    from cluster.protocol import WorkerPayload
    from cluster.rank.session import Session

    ctx = WorkerContext(world_rank=0, local_rank=0, node_rank=0, world_size=2, local_world_size=2, num_nodes=1)
    payload = WorkerPayload(context=ctx, attempt=1, train_fn="x:y", config={},
                            events_path=str(Path(folder) / "events-rank0.jsonl"),
                            staging_uri=str(Path(folder) / "staging"), restore_uri=None, backend="gloo")
    return Session(payload)


if __name__ == "__main__":
    sys.exit(main())
