"""Training functions for tests. Like train_fn/, they import nothing from Ray."""

from __future__ import annotations

import os

import torch
from accelerate import Accelerator

from cluster.runtime import get_session

ENV_KEYS = ["MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
            "NODE_RANK", "OMP_NUM_THREADS", "ACCELERATE_USE_CPU"]


def probe(config: dict) -> dict:
    """What a rank sees: its environment, Accelerate's view of the world, a collective."""
    accelerator = Accelerator(**get_session().accelerator_kwargs())
    total = accelerator.reduce(torch.tensor([float(accelerator.process_index)]), "sum").item()
    return {
        "env": {k: os.environ.get(k) for k in ENV_KEYS},
        "num_processes": accelerator.num_processes,
        "process_index": accelerator.process_index,
        "sum_of_ranks": total,
        "torch_threads": torch.get_num_threads(),
        "pid": os.getpid(),
        "ppid": os.getppid(),
    }


def fail_on_all_ranks(config: dict) -> None:
    Accelerator(**get_session().accelerator_kwargs())
    raise ValueError(f"bad batch shape {config.get('shape', '(3, 4)')}")
