"""The elastic bench's training function (Accelerate only, no Ray).

A small MLP on synthetic data, a fixed sleep per optimizer step (``step_s``, so compute does
not dominate the step), a checkpoint every ``every`` optimizer steps, and one JSON line per
optimizer step in ``config["steps_file"]`` (rank 0: the step, the world size it ran at, when it
began and ended): the bench measures both launchers from that same record.

The launcher-specific parts come in as ``Hooks``: ``train`` takes raylaunch's session;
``bench/elastic.py`` passes Ray Train's ``report`` and ``get_checkpoint`` instead. The job
trains until ``config["stop_file"]`` exists (rank 0 looks and broadcasts the answer, so every
rank stops after the same step) or ``max_steps`` are done.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast

from cluster.runtime import get_session
from train_fn.digits import Progress

__all__ = ["Hooks", "elastic_train", "train"]


@dataclass(frozen=True)
class Hooks:
    """What a launcher gives the function: Accelerator arguments, a checkpoint save and restore.

    ``save(accelerator, model, optimizer, step)`` runs on every rank at an optimizer step;
    ``restore(accelerator, model, optimizer)`` loads the latest checkpoint, if any, and returns its step.
    """

    accelerator_kwargs: dict
    save: Callable[[Accelerator, Any, Any, int], Any]
    restore: Callable[[Accelerator, Any, Any], int | None]


def _append(path: str, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def elastic_train(config: dict, hooks: Hooks) -> dict:
    accelerator = Accelerator(**hooks.accelerator_kwargs)
    rank, world = accelerator.process_index, accelerator.num_processes
    _append(config["ranks_file"], {"rank": rank, "pid": os.getpid(), "world_size": world, "at": time.time()})
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    progress = Progress()  # the optimizer step, saved with the checkpoint
    accelerator.register_for_checkpointing(progress)
    progress.step = hooks.restore(accelerator, model, optimizer) or 0
    accumulation = accelerator.gradient_accumulation_steps
    data = torch.Generator().manual_seed(1000 * progress.step + rank)
    every, step_s, max_steps = int(config.get("every", 5)), float(config.get("step_s", 0.1)), int(config["max_steps"])
    while progress.step < max_steps:
        began = time.time()
        for _ in range(accumulation):  # the global batch is per-rank batch x world x accumulation
            with accelerator.accumulate(model):
                x = torch.randn(16, 64, generator=data)
                loss = torch.nn.functional.mse_loss(model(x), x)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
        time.sleep(step_s)  # the same step time under both launchers
        progress.step += 1
        if rank == 0:
            _append(config["steps_file"], {"step": progress.step, "world_size": world, "began": began,
                                           "ended": time.time(), "accumulation": accumulation})
        if progress.step % every == 0:
            hooks.save(accelerator, model, optimizer, progress.step)
            if rank == 0:
                _append(config["steps_file"], {"checkpoint": progress.step, "world_size": world, "at": time.time()})
        stop = torch.tensor([float(rank == 0 and os.path.exists(config["stop_file"]))])
        if world > 1:
            stop = broadcast(stop, from_process=0)
        if stop.item():
            break
    accelerator.end_training()
    return {"steps": progress.step, "world_size": world, "accumulation": accumulation}


def train(config: dict) -> dict:
    """raylaunch's entry point: the session gives the accumulation and keeps the checkpoints."""
    session = get_session()
    return elastic_train(config, Hooks(
        session.accelerator_kwargs(),
        save=lambda accelerator, _model, _optimizer, step: session.save(accelerator, step),
        restore=lambda accelerator, _model, _optimizer: session.restore(accelerator)))
