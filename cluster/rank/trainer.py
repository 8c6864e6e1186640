"""transformers' ``Trainer`` in a rank: its ``checkpoint-<n>`` folders committed, its resume handed over, its logs the
run's metrics, a stop notice honoured at its next step; the script (or function) unchanged.

Trainer never calls ``accelerator.save_state`` or ``accelerator.log``: it saves ``checkpoint-<global_step>`` itself
and reports through its callbacks. At the first ``Accelerator.prepare`` a Trainer (or a subclass: TRL's
``SFTTrainer``, ``Seq2SeqTrainer``) calls, before its training begins, :class:`RunnerCallback` is added to it with
Trainer's public ``add_callback`` (``cluster.rank.prepared``'s callback; nothing of transformers is changed), on every
rank:

- ``on_save`` (every rank, after Trainer wrote the folder): this rank's files of the folder are hard-linked aside
  (Trainer may prune the folder meanwhile) and copied to the attempt's staging by a thread (training goes on), then
  reported; the driver commits the checkpoint of step n once
  every rank's part is there (:func:`owner` says which rank stages which file). A folder Trainer did not finish is
  never reported, so never committed nor resumed.
- ``on_log``: every row (loss, grad_norm, learning_rate, epoch, eval_*, train_runtime ...) is a metrics row at
  Trainer's ``global_step``, on every rank; the user's own trackers (``--report_to``) still get theirs.
- ``on_step_end``: a stop notice (SIGTERM to the ranks, a preemption) is agreed by every rank at a step all of them
  check (``StopCheck``), Trainer saves there and the training code ends (:class:`TrainerStopped`); the restart
  resumes from that checkpoint. From Trainer's first step to its last, that is: before and after, a SIGTERM ends
  the rank, as it ends a process.
- accumulation (:func:`trainer_accumulation`, when a script's Trainer makes its Accelerator): an elastic run's
  smaller world keeps the global batch through Trainer's own ``gradient_accumulation_steps``; the launch's
  accumulation is never applied behind Trainer's back (Trainer makes its Accelerator with accumulation 1 and
  accumulates itself, as under ``accelerate launch``).

Between its saves, snapshots in memory (``cluster.checkpoint.memory``) hold what its own ``checkpoint-<n>`` would
(:func:`snapshots_of`): a restart may hand Trainer one of them, put together from the nodes' memory, as it hands a
commit.

After a restart a script gets ``--resume_from_checkpoint <folder>`` (``cluster.rank.worker``); a function passes
``get_session().checkpoint_folder()`` to ``trainer.train(resume_from_checkpoint=...)``. Imports nothing from Ray.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable

from cluster.layout import SCRIPT_FOLDER, checkpoint_name
from cluster.rank.stops import StopCheck
from cluster.storage_io import is_local, join_uri, open_uri

if TYPE_CHECKING:
    from cluster.protocol import ScriptCall
    from cluster.rank.session import Session

__all__ = ["RunnerCallback", "TrainerStopped", "install", "made_by_trainer", "owner", "snapshots_of",
           "trainer_accumulation", "trainer_unsnapshotted"]

TRAINER_MODULE = "transformers.trainer"

# Files of a checkpoint folder that name the rank that wrote them: Trainer's RNG states, DCP's shards (FSDP's
# SHARDED_STATE_DICT), DeepSpeed ZeRO's partitions. Every other file is global rank 0's (Trainer writes the model,
# optimizer, scheduler and trainer_state.json on the main process).
_RANK_FILE = re.compile(r"^rng_state_(\d+)\.pth$|^__(\d+)_\d+\.distcp$|zero_pp_rank_(\d+)_")


def owner(rel: str) -> int:
    """The global rank that stages ``rel`` (a path inside a checkpoint folder) into the committed checkpoint.

    >>> owner("rng_state_3.pth"), owner("model.safetensors"), owner("pytorch_model_fsdp_0/__2_0.distcp")
    (3, 0, 2)
    >>> owner("global_step8/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"), owner("rng_state.pth")
    (1, 0)
    """
    m = _RANK_FILE.search(os.path.basename(rel))
    if m is None:
        return 0
    return int(next(g for g in m.groups() if g is not None))


def made_by_trainer(depth: int = 8) -> Any:
    """The Trainer (or subclass) whose method called, ``depth`` frames up at most, into what asks (an ``Accelerator``
    it makes, a ``prepare`` it calls); None when no Trainer did."""
    module = sys.modules.get(TRAINER_MODULE)
    if module is None:
        return None
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        if isinstance(me := frame.f_locals.get("self"), module.Trainer):
            return me
        frame = frame.f_back
    return None


def install(session: "Session", script: "ScriptCall | None" = None) -> None:
    """Give every Trainer of this rank the runner's callback: at each ``Accelerator.prepare`` a Trainer makes (its
    first is its training dataloader's, before ``on_train_begin``), with Trainer's public ``add_callback``."""
    from cluster.rank.prepared import after_prepare

    def adopt(accelerator: Any, new_models: list[Any]) -> None:
        trainer = made_by_trainer()
        if trainer is None or any(isinstance(c, RunnerCallback) for c in trainer.callback_handler.callbacks):
            return
        if not _BRIDGES:
            _BRIDGES.append(_callback_class()(session, script))
        trainer.add_callback(_BRIDGES[0])

    after_prepare("trainer", adopt)


_BRIDGES: list[Any] = []  # the one callback of this rank, shared by its Trainers
_SCALED: "weakref.WeakSet[Any]" = weakref.WeakSet()  # the Trainers whose accumulation was scaled


def snapshots_of(trainer: Any) -> Any:
    """Snapshots in memory of ``trainer`` (``cluster.checkpoint.memory``) in its own format: what its
    ``_save_checkpoint`` writes into ``checkpoint-<global_step>``, so its own ``resume_from_checkpoint`` restores one
    exactly as it restores its checkpoints. Written by Trainer's own methods (the model's ``save_model``, then its
    optimizer, scheduler, scaler and RNG states), under the capture that holds them in memory; left out, its
    tokenizer (which its resume never reads), and what
    ``_save_checkpoint`` does beyond the files: the flos gathered across ranks and the best model's barrier (each rank
    decides alone whether it takes a snapshot: no collective may be waited on there; the state written counts this
    rank's flos as every rank's), the pruning of the output folder and the upload to the Hub."""
    from cluster.checkpoint.memory import CodeSave

    ref = weakref.ref(trainer)

    def save(folder: str, default: Callable[[], None]) -> None:
        me = ref()
        if me is not None:
            _save_like_trainer(me, folder)

    return CodeSave(save, name="checkpoint-0", step=lambda: ref().state.global_step)


def trainer_unsnapshotted(trainer: Any) -> str | None:
    """Why ``trainer`` gets no snapshots (its committed checkpoints are restored), or None.

    Its model sharded as it loaded (tensor parallel): every rank's ``save_model`` gathers the shards, a collective
    a rank that skips a snapshot would leave the others waiting in. ``save_only_model``: nothing to resume the
    optimizer from. A subclass's own ``_save_checkpoint`` may write what its own resume reads, which a snapshot would
    not hold (TRL's trainers add a model card there, nothing their resume reads: theirs are taken)."""
    from transformers import Trainer

    if getattr(trainer, "is_distributed_loading_by_transformers", False):
        return "its model is sharded across ranks as it loaded (tensor parallel): saving it is a collective"
    if getattr(trainer.args, "save_only_model", False):
        return "Trainer's save_only_model keeps no optimizer state to resume from"
    own = type(trainer)._save_checkpoint
    if own is not Trainer._save_checkpoint and not own.__module__.startswith("trl."):
        return (f"{type(trainer).__name__} has its own _save_checkpoint ({own.__module__}), whose files a snapshot "
                "(Trainer's own) would not hold")
    return None


def _save_like_trainer(trainer: Any, folder: str) -> None:
    import copy

    from transformers.trainer import TRAINER_STATE_NAME
    from transformers.trainer_callback import ExportableState
    from transformers.utils import logging as hf_logging

    args = trainer.args
    os.makedirs(folder, exist_ok=True)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # ("Writing model shards" a snapshot)
    # Not its tokenizer (or processor): Trainer's resume never reads it, and serializing one (a large vocabulary's
    # tokenizer.json, megabytes of JSON) would hold training at every snapshot. Trainer's save_model writes the
    # processing class, or else the data collator's tokenizer: both are set aside for the call, on this thread.
    kept = trainer.processing_class, trainer.data_collator
    trainer.processing_class = trainer.data_collator = None
    try:
        trainer.save_model(folder, _internal_call=True)
        trainer._save_optimizer_and_scheduler(folder)
        trainer._save_scaler(folder)
        trainer._save_rng_state(folder)
    finally:
        trainer.processing_class, trainer.data_collator = kept
        if bars:
            hf_logging.enable_progress_bar()
    if not args.should_save:
        return
    # Trainer's state as its own save would write it now, on a copy: the live state is Trainer's to change
    state = copy.copy(trainer.state)
    state.stateful_callbacks = {k: list(v) if isinstance(v, list) else v for k, v in state.stateful_callbacks.items()}
    for cb in [c for c in trainer.callback_handler.callbacks + [trainer.control] if isinstance(c, ExportableState)]:
        name = cb.__class__.__name__
        if isinstance(state.stateful_callbacks.get(name), list):
            state.stateful_callbacks[name].append(cb.state())
        else:
            state.stateful_callbacks[name] = cb.state()
    state.total_flos = trainer.state.total_flos + getattr(trainer, "current_flos", 0) * args.world_size
    state.save_to_json(os.path.join(folder, TRAINER_STATE_NAME))


class TrainerStopped(BaseException):
    """Raised out of ``trainer.train()`` once every rank agreed to stop and Trainer saved: the training code ends
    there (the rest of a script, an evaluation or a final save, is the restart's); the worker reports the rank as
    preempted. A BaseException, as SystemExit is: the training code's ``except Exception`` does not take it."""


class RunnerCallback:
    """The runner's side of a Trainer (see the module): made a ``TrainerCallback`` subclass by ``_callback_class``
    once transformers is imported. One instance serves every Trainer of the rank."""


_CLASS: list[type] = []


def _callback_class() -> type:
    if _CLASS:
        return _CLASS[0]
    from transformers import TrainerCallback

    class _Runner(_Bridge, RunnerCallback, TrainerCallback):
        pass

    _Runner.__name__ = _Runner.__qualname__ = "RunnerCallback"
    _CLASS.append(_Runner)
    return _Runner


# This rank's links to the files of a checkpoint it stages, in Trainer's output folder (hidden from Trainer's
# checkpoint-* globs): <output_dir>/.raylaunch-stage-<rank>-<step>
_LINKS = ".raylaunch-stage-{rank}-"


def _linked(files: list[str], folder: str, into: str) -> None:
    """``files`` of ``folder`` as hard links in ``into`` (made at once, on the training thread): Trainer may delete
    the folder (``save_total_limit``, the best model's pruning at the end) while the copy runs, never the links. A
    file that cannot be linked (another filesystem) is copied here instead."""
    for rel in files:
        dest = os.path.join(into, rel)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        try:
            os.link(os.path.join(folder, rel), dest)
        except OSError:
            shutil.copy2(os.path.join(folder, rel), dest)


class _Copy:
    """One rank's part of one Trainer checkpoint, copied (and hashed) from this rank's links to it into staging by a
    thread; reported when done, the links removed."""

    def __init__(self, files: list[str], folder: str, uri: str, report: Callable[[dict], None]) -> None:
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(files, folder, uri, report), daemon=True,
                                        name="raylaunch-trainer-checkpoint")
        self._thread.start()

    def _run(self, files: list[str], folder: str, uri: str, report: Callable[[dict], None]) -> None:
        try:
            self._copy(files, folder, uri, report)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _copy(self, files: list[str], folder: str, uri: str, report: Callable[[dict], None]) -> None:
        try:
            fs, base = open_uri(uri)
            local = is_local(fs)
            described: dict[str, dict] = {}
            for rel in files:
                dest = f"{base}/{rel}"
                fs.create_dir(os.path.dirname(dest), recursive=True)
                tmp = f"{os.path.dirname(dest)}/.{os.path.basename(dest)}.raylaunch-{os.getpid()}" if local else dest
                h, size = hashlib.sha256(), 0
                with open(os.path.join(folder, rel), "rb") as src, fs.open_output_stream(tmp) as out:
                    while chunk := src.read(1 << 22):
                        h.update(chunk)
                        size += len(chunk)
                        out.write(chunk)
                if local:
                    os.replace(tmp, dest)
                described[rel] = {"size": size, "sha256": h.hexdigest()}
            report(described)
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread by wait()
            self.error = exc

    def wait(self) -> None:
        self._thread.join()
        if self.error is not None:
            from cluster.checkpoint.staged import CheckpointSaveError

            raise CheckpointSaveError(f"staging Trainer's checkpoint failed: {self.error}. The previous committed "
                                      "checkpoint is kept.") from self.error


class _Bridge:
    """What ``RunnerCallback`` does (the ``TrainerCallback`` methods), kept apart from transformers' base class so
    this module imports without it."""

    def __init__(self, session: "Session", script: "ScriptCall | None") -> None:
        self.session, self.script = session, script
        ctx = session.payload.context
        self.rank, self.world = ctx.world_rank, ctx.world_size
        self._copy: _Copy | None = None
        self._staged: set[int] = set()
        self._stop = StopCheck()
        self._stopping = False
        self._said: set[str] = set()
        session.also_wait(self.wait)

    def say_once(self, text: str) -> None:
        if self.rank == 0 and text not in self._said:
            self._said.add(text)
            print(f"raylaunch: {text}", file=sys.stderr, flush=True)

    # --- TrainerCallback ---------------------------------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.session.stops_cooperatively()  # a SIGTERM now asks for a save at the next agreed step
        self._stop.begin()
        self._staged = set()  # per train(): a second one saves its own steps
        prefix = _LINKS.format(rank=self.rank)
        if os.path.isdir(args.output_dir):  # this rank's links left by an attempt that was killed while copying
            for name in os.listdir(args.output_dir):
                if name.startswith(prefix):
                    shutil.rmtree(os.path.join(args.output_dir, name), ignore_errors=True)
        resumed = self.session.resumed_step
        if resumed is not None and state.global_step == resumed:  # Trainer loaded it (train() began with the load)
            self.session.restored(resumed, 0.0)
        if getattr(args, "save_total_limit", None):
            self.say_once(f"Trainer's save_total_limit={args.save_total_limit} prunes the checkpoint folders of "
                          f"{args.output_dir}; the run's committed copies are pruned by checkpoint.keep alone")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._stopping or not self._stop.due():
            return
        if self._stop.agreed(self.session.stop_requested):
            self._stopping = True
            self.session.stop_for_preemption()
            control.should_save = True
            control.should_training_stop = True
            self.say_once(f"stop notice: Trainer saves checkpoint-{state.global_step} and the script ends; the "
                          "restart resumes there")

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        if logs:
            self.session.log(dict(logs), state.global_step)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step = state.global_step
        folder = os.path.join(args.output_dir, f"checkpoint-{step}")
        if step in self._staged:
            return
        if not os.path.isdir(folder) and self.rank == 0:  # a hyperparameter search's run-<n>/checkpoint-<n>
            self.say_once(f"Trainer saved step {step}, but not into {folder}: its checkpoints are not committed "
                          "(a hyperparameter search's trials save elsewhere)")
            return
        self.wait()  # one in flight: the previous part staged (or its failure raised) first
        self._staged.add(step)
        files = sorted(os.path.relpath(os.path.join(root, n), folder)
                       for root, _, names in os.walk(folder) for n in names) if os.path.isdir(folder) else []
        # (a rank with nothing of its own, save_only_model's, still reports: the commit waits for every rank)
        mine = [f for f in files if owner(f) == self.rank]
        links = os.path.join(args.output_dir, f"{_LINKS.format(rank=self.rank)}{step}")
        shutil.rmtree(links, ignore_errors=True)
        os.makedirs(links)
        _linked(mine, folder, links)
        uri = join_uri(self.session.payload.staging_uri, checkpoint_name(step))
        if self.rank == 0:  # the resume folder's name on the nodes: checkpoint-<n>, as Trainer names it
            fs, base = open_uri(uri)
            fs.create_dir(base, recursive=True)
            with fs.open_output_stream(f"{base}/{SCRIPT_FOLDER}") as out:
                out.write(json.dumps({"folder": os.path.basename(folder)}).encode())
        requested, began = time.time(), time.perf_counter()

        def report(described: dict) -> None:
            self.session.trainer_saved(step, uri, described, requested, time.perf_counter() - began, folder)

        self._copy = _Copy(mine, links, uri, report)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.wait()
        if self._stopping:  # the code ends here: the rest of it (evaluation, a final save) is the restart's
            raise TrainerStopped()
        self.session.stops_cooperatively(False)  # after training, a SIGTERM ends the rank again

    def wait(self) -> None:
        copy, self._copy = self._copy, None
        if copy is not None:
            copy.wait()


def trainer_accumulation(trainer: Any, call: "ScriptCall", world: int, say_once: Callable[[str], None]) -> None:
    """A script's Trainer is making its Accelerator: Trainer's own accumulation (``args.gradient_accumulation_steps``)
    scaled as an elastic run scales the launch's (by 1 at full size), so the global batch is kept; the launch's
    accumulation itself is Trainer's to take from the script's arguments, as under ``accelerate launch``.

    >>> from types import SimpleNamespace as N
    >>> from cluster.protocol import ScriptCall
    >>> class T:
    ...     args = N(gradient_accumulation_steps=2)
    >>> t = T()
    >>> trainer_accumulation(t, ScriptCall("t.py", accumulation=2, full_accumulation=1), 2, print)
    elastic: Trainer's gradient_accumulation_steps=2 is 4 at this world size (2), which keeps the global batch
    >>> t.args.gradient_accumulation_steps
    4
    """
    args = trainer.args
    if trainer in _SCALED:  # a second Accelerator of the same Trainer (a hyperparameter search's trial)
        return
    _SCALED.add(trainer)
    runner, full = call.accumulation, max(1, call.full_accumulation)
    if full != 1:
        say_once(f"the launch's gradient_accumulation_steps={full} is not applied to transformers' Trainer, which "
                 "accumulates itself (as under accelerate launch): give the script --gradient_accumulation_steps "
                 f"{full} instead")
    if runner == full:
        return
    own = int(args.gradient_accumulation_steps)
    scaled = own * runner / full
    chosen = max(1, round(scaled))
    kept = "keeps" if scaled == chosen else "changes (not a whole number of micro-batches)"
    args.gradient_accumulation_steps = chosen
    say_once(f"elastic: Trainer's gradient_accumulation_steps={own} is {chosen} at this world size ({world}), which "
             f"{kept} the global batch")
