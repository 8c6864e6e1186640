"""What a resume puts back in a rank beside Accelerate's ``load_state``: each rank's own dataloader position, the
random states of the first batch, a defined RNG for a rank the checkpoint has none for, and under FSDP1 an
optimizer state to load into.

Each rank's own dataloader position, for exact resume of a stream:

With ``use_stateful_dataloader`` Accelerate's ``save_state`` writes every rank's
StatefulDataLoader state to one file, ``dl_state_dict.bin``: all ranks write the same path
and the last one wins. That is harmless when every rank is at the same place of the same
sampler, but not for a stream: sharded across ranks (each reads its own files) every rank's
position differs, and with ``dispatch_batches`` only rank 0 reads at all (a rank 1 that
writes last would send rank 0 back to the start of the stream on resume).

So the session also writes each rank's state as ``dl_state_rank<R>.bin`` (``_<i>`` for the
i-th prepared dataloader after the first) and loads it back after ``load_state``.

Each rank also writes where every prepared loader stood in its epoch (``dl_order_rank<R>.bin``: the epoch, the
batches handed over, a shuffling loader's order); a resume that begins that epoch again is said (``_check_resumed``).
"""

from __future__ import annotations

import os
import sys
import weakref
from typing import Any, Callable, Iterable

from cluster.layout import rank_part_file

__all__ = ["NEXT_BATCH", "at_next_batch", "epoch_begins", "init_optimizers_for_load", "keep_random_states_for_the_first_batch",
           "load_loader_states", "next_batch", "save_loader_states", "seed_missing_rng"]


def _stateful(accelerator: Any) -> list[tuple[int, Any]]:
    # The prepared dataloaders, in the order Accelerate saves them.
    return [(i, dl) for i, dl in enumerate(getattr(accelerator, "_dataloaders", []))
            if getattr(dl, "use_stateful_dataloader", False)]


def _file(path: str, index: int, rank: int) -> str:
    return os.path.join(path, f"dl_state_rank{rank}" + (f"_{index}" if index else "") + ".bin")


def save_loader_states(accelerator: Any, path: str) -> None:
    """Write this rank's stateful dataloaders' positions, and where each shuffling loader's order comes from
    (``epoch_begins``), into the checkpoint folder ``path``."""
    import torch

    _save_orders(accelerator, path)
    for i, dl in _stateful(accelerator):
        torch.save(dl.state_dict(), _file(path, i, accelerator.process_index))


# The order of a shuffling loader's epoch (Accelerate's ``synchronized_generator``: a non-seedable ``RandomSampler``'s
# generator, seeded once at ``prepare``) is drawn from that generator when the epoch's iteration begins; Accelerate's
# save_state keeps no state of it, so a resumed process drew epoch 0's order again for every later epoch (the digits
# script resumed at step 7, in its second epoch, trained on the first epoch's batches: under accelerate launch too).
# Each generator's state as its current epoch began, by generator (a loader and those ``skip_first_batches`` makes of
# it share one): (the loader's epoch, the state, the loader iterating it).
_EPOCH_BEGAN: dict[int, tuple[int, Any, Any]] = {}
_ORDER_SAID: list[str] = []


def _order_file(path: str, index: int, rank: int) -> str:
    return os.path.join(path, f"dl_order_rank{rank}" + (f"_{index}" if index else "") + ".bin")


def _skips(loader: Any) -> bool:
    """The loader skips batches at its start (``skip_first_batches``: in the loader, or in its batch sampler)."""
    return any(getattr(part, "skip_batches", 0) for part in (loader, getattr(loader, "batch_sampler", None)))


def _order_failed(what: str, exc: BaseException) -> None:
    if not _ORDER_SAID:  # never the training's failure: the order of a resumed epoch may differ, said once
        _ORDER_SAID.append(what)
        print(f"raylaunch: {what} a shuffling loader's order failed ({type(exc).__name__}: {exc}); a resume may draw "
              "another order for the epoch it resumes", file=sys.stderr, flush=True)


def epoch_begins(loader: Any) -> None:
    """Called by a prepared dataloader's ``__iter__`` (``cluster.rank.pace``) before it draws its epoch's order: the
    loader that reads its data now, and the state its order is drawn from, kept for the next save."""
    try:
        _ITERATING[_source(loader)] = (int(getattr(loader, "iteration", 0) or 0), weakref.ref(loader))
    except (AttributeError, TypeError, ValueError):  # no dataset, or an epoch that is no number: no position kept
        pass
    gen = getattr(loader, "synchronized_generator", None)
    if gen is None:
        return
    try:
        _EPOCH_BEGAN[id(gen)] = (loader.iteration, gen.get_state(), weakref.ref(loader))
    except Exception as exc:  # noqa: BLE001
        _order_failed("keeping", exc)


# The loader that began an epoch over each source of batches last (``_source``: a prepared loader and those
# ``skip_first_batches`` makes of it share one), by the source: (that epoch, the loader). Where a resume finds its
# epoch (``_check_resumed``).
_ITERATING: dict[int, tuple[int, Any]] = {}


def _source(loader: Any) -> int:
    """What a prepared loader and the loaders ``skip_first_batches`` makes of it share, told from every other loader's
    (an evaluation loader over the same dataset): the sampler under their batch samplers (``SkipBatchSampler`` wraps
    the loader's own), else the dataset (``SkipDataLoader``, of a loader without a batch sampler)."""
    sampler = getattr(loader, "batch_sampler", None)
    while getattr(sampler, "batch_sampler", None) is not None:
        sampler = sampler.batch_sampler
    inner = getattr(sampler, "sampler", None)
    return id(inner) if inner is not None else id(loader.dataset)


# The batches a prepared loader's current epoch has handed to the training code, set by its iteration
# (``cluster.rank.pace``) on the loader: one attribute a batch.
HANDED = "_raylaunch_handed"


def handed(loader: Any) -> int:
    """Where a loader stands in its epoch: the batches handed over, those it skipped at its start included."""
    skipped = max([getattr(part, "skip_batches", 0) or 0 for part in (loader, getattr(loader, "batch_sampler", None))])
    return skipped + getattr(loader, HANDED, 0)


def _save_orders(accelerator: Any, path: str) -> None:
    """Each prepared loader's place: the epoch it reads, the batches of it handed over, whether it had ended (its last
    batch handed over); for a shuffling loader also where its epoch's order was drawn from and where the next one's
    will be."""
    import torch

    for i, dl in enumerate(getattr(accelerator, "_dataloaders", [])):
        gen = getattr(dl, "synchronized_generator", None)
        began = _EPOCH_BEGAN.get(id(gen)) if gen is not None else None
        try:
            reading = began[::2] if began is not None else _ITERATING.get(_source(dl))  # (epoch, loader)
        except AttributeError:  # a loader with no dataset
            reading = None
        if reading is None:
            continue
        loader = reading[1]()
        place = {"epoch": reading[0], "ended": bool(getattr(loader, "end_of_dataloader", False)),
                 "handed": handed(loader) if loader is not None else 0, "world": accelerator.num_processes}
        if began is not None:
            place.update(began=began[1], now=gen.get_state())
        torch.save(place, _order_file(path, i, accelerator.process_index))


def _check_resumed(accelerator: Any, resumed: dict[int, tuple[int, int]]) -> None:
    """At the first optimizer step after a resume saved mid-epoch (``resumed``: source -> (the epoch, the batches of
    it its loader had handed over)): a loader of that epoch that stands before that point began the epoch again (no
    ``skip_first_batches``, no skipping of its own), so the resumed run trains on those batches twice and does not
    end as the uninterrupted run would. Said once, on the main process; never stops training."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    said: list[bool] = []

    def check(*_: Any) -> None:
        if said:
            return
        said.append(True)
        at_next_batch(lambda _loader: handle.remove())  # (not from inside torch's loop over the hooks)
        for key, (epoch, saved) in resumed.items():
            reading = _ITERATING.get(key)
            loader = reading[1]() if reading is not None else None
            # (one that resumed it stands past its place by the step's batches: at it, or before, it began again)
            if loader is None or reading[0] != epoch or (now := handed(loader)) > saved:
                continue
            print(f"raylaunch: this run resumed in the middle of an epoch, where its data loader had handed over "
                  f"{saved} batches, and the loader began that epoch again (at its first optimizer step it had "
                  f"handed over {now}): the resumed run trains on those batches twice and will not end as the "
                  "uninterrupted run would. Resume the epoch past them, as an Accelerate function does: iterate "
                  f"accelerator.skip_first_batches(loader, {saved}) for that epoch (train_fn/digits.py shows it), or "
                  "set accelerate.dataloader.use_stateful_dataloader: true (unless its sampler or dataset keeps its "
                  "own place and resumed it)", file=sys.stderr, flush=True)
            return

    if accelerator.is_main_process:
        handle = register_optimizer_step_post_hook(check)


def _load_orders(accelerator: Any, path: str) -> None:
    """After ``load_state``: each shuffling loader's generator as the saved run's was. Saved mid-epoch, at that
    epoch's start, so the code that resumes the epoch (``skip_first_batches``, or skipping batches itself) draws its
    order again; saved at an epoch's end, as it was, for the next epoch's. A rank the checkpoint has no file of takes
    rank 0's (the generators are synchronized across ranks). Saved mid-epoch, a loader that begins that epoch again
    is said (``_check_resumed``)."""
    import torch

    resumed: dict[int, tuple[int, int]] = {}
    for i, dl in enumerate(getattr(accelerator, "_dataloaders", [])):
        gen = getattr(dl, "synchronized_generator", None)
        found = [f for f in (_order_file(path, i, accelerator.process_index), _order_file(path, i, 0))
                 if os.path.exists(f)]
        if not found:
            continue
        try:
            order = torch.load(found[0], weights_only=True)
            ended = bool(order.get("ended", False))
            # (at another world size a rank's share of the epoch differs: its place there is not this one's)
            if not ended and order.get("handed") and order.get("world") == accelerator.num_processes and \
                    not getattr(dl, "use_stateful_dataloader", False):
                resumed[_source(dl)] = (int(order["epoch"]), int(order["handed"]))
            if gen is not None and "began" in order:
                gen.set_state(order["now"] if ended else order["began"])
                dl.set_epoch(int(order["epoch"]) + (1 if ended else 0))
        except Exception as exc:  # noqa: BLE001
            _order_failed("putting back", exc)
    if resumed:
        _check_resumed(accelerator, resumed)


def load_loader_states(accelerator: Any, path: str) -> None:
    """After ``load_state``: put back this rank's own positions, where the checkpoint has them.

    A position is a place in the rank's own share of the data at the world size that saved it; at
    another world size (an elastic resize) the shares differ and no position maps onto them, which
    rank 0 says (the samples of the resumed epoch may repeat or be skipped)."""
    import sys

    import torch

    _load_orders(accelerator, path)
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


def keep_random_states_for_the_first_batch() -> None:
    """After ``load_state``: the random states it restored (Python's, NumPy's, torch's, every CUDA device's) are put
    back once more just before the first batch of a resumed epoch reaches the training code.

    A checkpoint saved mid-epoch is resumed by a loader that skips the batches already seen
    (``skip_first_batches``); starting it draws from those states (``iter`` of a shuffling sampler takes a seed from
    torch's generator), which the uninterrupted run never did at that point: so dropout masks and every other draw of
    the resumed steps differed, and a resumed model with dropout did not end equal to an uninterrupted one, under
    ``accelerate launch`` either. Put back there, they are the uninterrupted run's (the digits script with dropout 0.3
    resumed mid-epoch under ``accelerate launch``: equal bit for bit, against a different model before). A resume at
    an epoch's start (its first loader skips nothing) is left alone: the uninterrupted run drew there too."""
    import random

    import numpy as np
    import torch

    states = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
              torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None)

    def put_back(loader: Any) -> None:
        if not _skips(loader):
            return
        python, numpy_state, torch_state, cuda = states
        random.setstate(python)
        np.random.set_state(numpy_state)
        torch.set_rng_state(torch_state)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)

    at_next_batch(put_back)


# Called once, with the dataloader, just before the next batch any prepared dataloader hands the training code.
# What runs before the next batch; read by the dataloaders' iteration before it calls ``next_batch`` (a list's truth
# test on every batch, not a call: #58)
NEXT_BATCH: list[Callable[[Any], None]] = []


def at_next_batch(call: Callable[[Any], None]) -> None:
    """Run ``call(dataloader)`` once, just before the next batch of any prepared dataloader reaches the training
    code (the random states a resume restored, put back there); ``next_batch`` runs them."""
    NEXT_BATCH.append(call)


def next_batch(loader: Any) -> None:
    """Called by the prepared dataloaders' iteration (``cluster.rank.pace``) before each batch it hands over."""
    while NEXT_BATCH:
        NEXT_BATCH.pop(0)(loader)


def seed_missing_rng(files: Iterable[str], rank: int, step: int) -> int | None:
    """A defined RNG state for a rank that the checkpoint has none for (it was saved by fewer ranks).

    Accelerate's ``load_state`` then leaves the rank's RNGs as they were; this seeds Python's,
    NumPy's and torch's with ``step * 1000 + rank`` (``accelerate.utils.set_seed``) and says so.
    Returns the seed, or None when the checkpoint holds the rank's own state.
    """
    if rank_part_file(rank) in set(files):
        return None
    from accelerate.utils import set_seed

    seed = step * 1000 + rank
    set_seed(seed)
    print(f"raylaunch: rank {rank}: the checkpoint of step {step} has no RNG state for this rank (it was saved by "
          f"fewer ranks); its RNGs are seeded with {seed} (step * 1000 + rank)", file=sys.stderr, flush=True)
    return seed


def init_optimizers_for_load(accelerator: Any) -> None:
    """Before ``load_state`` under FSDP1 with sharded checkpoints: give every optimizer its state.

    Accelerate reads an FSDP1 sharded optimizer checkpoint into ``FSDP.optim_state_dict(model,
    optimizer)`` of the optimizer as it is; one that never stepped (every resume) has no state
    there, so nothing of it was loaded and training went on with fresh Adam moments, without a word
    (a resumed run diverged from an uninterrupted one). torch's own initialisation for its
    state-dict API (a step with zero gradients and learning rate 0) makes the state to load into.
    FSDP2 and full checkpoints load without it."""
    from accelerate.utils import DistributedType

    plugin = getattr(getattr(accelerator, "state", None), "fsdp_plugin", None)
    if (getattr(accelerator, "distributed_type", None) != DistributedType.FSDP or plugin is None
            or getattr(plugin, "fsdp_version", 1) != 1 or "FULL" in str(plugin.state_dict_type)):
        return
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    for optimizer in accelerator._optimizers:
        _init_optim_state(getattr(optimizer, "optimizer", optimizer))
