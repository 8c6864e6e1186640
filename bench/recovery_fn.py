"""The recovery bench's training function (bench/recovery.py): an MLP whose state is ``state_mb`` MiB a rank.

``state_mb`` sets the width of a stack of square bias-free layers trained with AdamW (parameters and two moments,
fp32: 12 bytes a parameter): 576 MiB is 6 layers of 2,896 (50M parameters, as bench/checkpoint_fn.py), the
issue's size; 0.3 is the bar's tiny case. It trains until ``config["stop_file"]`` exists (rank 0 looks and
broadcasts, so every rank stops after the same step) or ``max_steps`` are done, and writes what the bench
measures, the same under every launcher:

- ``<pid_dir>/rank-<R>.pid``: the rank's pid, rewritten by every attempt (the bench kills ranks by it);
- ``steps_file``, rank 0 only, one JSON line each: ``{"restored": step, "pid", "at"}`` when an attempt has
  restored (0: from the beginning), ``{"step", "began", "ended", "pid"}`` for each optimizer step,
  ``{"saved": step, "held_s", "at", "pid"}`` for each save.

When to save is the function's, the same rule under every launcher: every ``every`` steps when the config says so;
with ``mtbf_s``, Young and Daly's interval ``sqrt(2 x C x mtbf_s)`` seconds, C the mean of the holds measured so far
(a save assumed to hold 1 s until one is measured; a save that waits for the previous one's background write holds
that wait too), rank 0 deciding; and whenever the launcher's own ``due`` says so (raylaunch:
``session.checkpoint_due``, i.e. the spec's ``checkpoint.every``).

The launcher-specific parts come in as ``Hooks``: ``train`` takes raylaunch's session; bench/recovery.py passes Ray
Train's ``report`` and ``get_checkpoint`` instead.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast

from bench.elastic_fn import _append
from cluster.runtime import get_session
from train_fn.digits import Progress

__all__ = ["Hooks", "recovery_train", "shape", "train"]

LAYERS = 6


def shape(state_mb: float) -> tuple[int, int]:
    """(width, layers) of a bias-free square MLP whose parameters and AdamW moments take about ``state_mb`` MiB.

    >>> shape(576)
    (2896, 6)
    >>> shape(0.3)
    (66, 6)
    """
    width = max(4, round(math.sqrt(state_mb * 2**20 / 12 / LAYERS)))
    return width, LAYERS


@dataclass(frozen=True)
class Hooks:
    """What a launcher gives the function.

    ``due(accelerator, step)`` (every rank, after an optimizer step, the same answer on every rank): the launcher's
    own rule says save now?
    ``save(accelerator, model, optimizer, step)`` on every rank; ``restore(accelerator, model, optimizer)``
    loads the latest checkpoint, if any, and returns its step; ``log(step, loss)`` the launcher's metrics.
    """

    accelerator_kwargs: dict
    due: Callable[[Accelerator, int], bool]
    save: Callable[[Accelerator, Any, Any, int], Any]
    restore: Callable[[Accelerator, Any, Any], int | None]
    log: Callable[[int, float], None] = lambda step, loss: None


def recovery_train(config: dict, hooks: Hooks) -> dict:
    accelerator = Accelerator(**hooks.accelerator_kwargs)
    rank = accelerator.process_index
    pid_file = Path(config["pid_dir"]) / f"rank-{rank}.pid"
    pid_file.parent.mkdir(parents=True, exist_ok=True)
    pid_file.with_suffix(".tmp").write_text(str(os.getpid()))
    pid_file.with_suffix(".tmp").replace(pid_file)  # whole or absent: the bench reads it at any moment
    torch.manual_seed(0)
    width, layers = shape(float(config["state_mb"]))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    step_s, max_steps, batch = float(config.get("step_s", 0.0)), int(config["max_steps"]), int(config.get("batch", 8))
    # Batches through a prepared loader, as a real function reads them: raylaunch puts its epoch's order back on a
    # resume, and takes its snapshots where the next batch is asked for after an optimizer step (cluster/rank/pace.py);
    # the function resumes its epoch past the batches trained on (``skip_first_batches``), as an Accelerate function
    # does. (Until 2026-12-07 it began the epoch again: a resumed arm trained on its first batches twice, its loss
    # half the uninterrupted run's at the step after a resume; steps and seconds were the same.)
    inputs = torch.randn(64 * batch * accelerator.num_processes, width, generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs), batch_size=batch, shuffle=True,
                                         generator=torch.Generator().manual_seed(0))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    progress = Progress()  # the optimizer step, saved with the checkpoint
    accelerator.register_for_checkpointing(progress)
    progress.step = hooks.restore(accelerator, model, optimizer) or 0
    if rank == 0:
        _append(config["steps_file"], {"restored": progress.step, "pid": os.getpid(), "at": time.time()})
    every, mtbf_s, holds, last_save = int(config.get("every") or 0), config.get("mtbf_s"), [], time.time()

    def due(step: int) -> bool:
        mine = bool(every and step % every == 0)
        if mtbf_s:
            interval = math.sqrt(2 * (sum(holds) / len(holds) if holds else 1.0) * float(mtbf_s))
            now = torch.tensor([float(mine or time.time() - last_save >= interval)])
            mine = bool((broadcast(now, from_process=0) if accelerator.num_processes > 1 else now).item())
        return hooks.due(accelerator, step) or mine

    stop = False
    done = progress.step % len(loader)  # batches of the resumed epoch already trained on (one a step)
    batches = accelerator.skip_first_batches(loader, done) if done else loader
    while progress.step < max_steps and not stop:
        for (x,) in batches:
            began = time.time()
            loss = model(x).square().mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if step_s:
                time.sleep(step_s)  # a floor under the tiny model's step, so steps lost count in seconds too
            progress.step += 1
            if rank == 0:
                _append(config["steps_file"], {"step": progress.step, "began": began, "ended": time.time(),
                                               "pid": os.getpid()})
            hooks.log(progress.step, loss.item())
            if due(progress.step):
                saving = time.perf_counter()
                hooks.save(accelerator, model, optimizer, progress.step)
                holds.append(time.perf_counter() - saving)
                last_save = time.time()
                if rank == 0:
                    _append(config["steps_file"], {"saved": progress.step, "held_s": holds[-1], "at": last_save,
                                                   "pid": os.getpid()})
            flag = torch.tensor([float(rank == 0 and os.path.exists(config["stop_file"]))])
            if accelerator.num_processes > 1:
                flag = broadcast(flag, from_process=0)
            stop = bool(flag.item())
            if stop or progress.step >= max_steps:
                break
        batches = loader  # the next epoch whole
    accelerator.end_training()
    return {"steps": progress.step}


def train(config: dict) -> dict:
    """raylaunch's entry point: the session keeps the checkpoints (and, with ``checkpoint.snapshots``, the snapshots
    in memory); a save is also due when the spec's ``checkpoint.every`` says so."""
    session = get_session()
    return recovery_train(config, Hooks(
        session.accelerator_kwargs(), due=lambda accelerator, _step: session.checkpoint_due(accelerator),
        save=lambda accelerator, _model, _optimizer, step: session.save(accelerator, step),
        restore=lambda accelerator, _model, _optimizer: session.restore(accelerator),
        log=lambda step, loss: session.log({"loss": loss}, step=step)))
