"""Each rank's own dataloader position in a checkpoint, for exact resume of a stream.

With ``use_stateful_dataloader`` Accelerate's ``save_state`` writes every rank's
StatefulDataLoader state to one file, ``dl_state_dict.bin``: all ranks write the same path
and the last one wins. That is harmless when every rank is at the same place of the same
sampler, but not for a stream: sharded across ranks (each reads its own files) every rank's
position differs, and with ``dispatch_batches`` only rank 0 reads at all (a rank 1 that
writes last would send rank 0 back to the start of the stream on resume).

So the session also writes each rank's state as ``dl_state_rank<R>.bin`` (``_<i>`` for the
i-th prepared dataloader after the first) and loads it back after ``load_state``.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["load_loader_states", "save_loader_states"]


def _stateful(accelerator: Any) -> list[tuple[int, Any]]:
    # The prepared dataloaders, in the order Accelerate saves them.
    return [(i, dl) for i, dl in enumerate(getattr(accelerator, "_dataloaders", []))
            if getattr(dl, "use_stateful_dataloader", False)]


def _file(path: str, index: int, rank: int) -> str:
    return os.path.join(path, f"dl_state_rank{rank}" + (f"_{index}" if index else "") + ".bin")


def save_loader_states(accelerator: Any, path: str) -> None:
    """Write this rank's stateful dataloaders' positions into the checkpoint folder ``path``."""
    import torch

    for i, dl in _stateful(accelerator):
        torch.save(dl.state_dict(), _file(path, i, accelerator.process_index))


def load_loader_states(accelerator: Any, path: str) -> None:
    """After ``load_state``: put back this rank's own positions, where the checkpoint has them.

    A position is a place in the rank's own share of the data at the world size that saved it; at
    another world size (an elastic resize) the shares differ and no position maps onto them, which
    rank 0 says (the samples of the resumed epoch may repeat or be skipped)."""
    import sys

    import torch

    loaders = _stateful(accelerator)
    if not loaders:
        return
    saved = len([f for f in os.listdir(path) if f.startswith("dl_state_rank") and "_" not in f[len("dl_state_rank"):]])
    if saved and saved != accelerator.num_processes and accelerator.is_main_process:
        print(f"raylaunch: the checkpoint's data loader positions were saved by {saved} ranks and this attempt has "
              f"{accelerator.num_processes}: each is a place in one rank's share of the data, which differs now, so "
              "samples of the resumed epoch may repeat or be skipped (the stateful data loader cannot carry a "
              "position to another world size; a seedable sampler with skip_first_batches can, see "
              "train_fn/digits.py)", file=sys.stderr, flush=True)
    for i, dl in loaders:
        f = _file(path, i, accelerator.process_index)
        if os.path.exists(f):
            dl.load_state_dict(torch.load(f, weights_only=True))
