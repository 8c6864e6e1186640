"""A script in a rank, run as ``python SCRIPT args`` runs it, its Accelerate calls reaching the runner.

``raylaunch launch train.py --lr 3e-4`` (or a spec's ``script:``) runs an unchanged
``accelerate launch`` script. In each rank :func:`run_script` gives it what a plain
``python`` start would (``__name__ == "__main__"``, ``sys.argv``, ``__file__``, its folder first
on ``sys.path``, the job's working directory as the current one), and :class:`ScriptHooks`
connects four of Accelerate's calls to the runner, on the ``Accelerator`` class, so the
script needs no line of raylaunch:

- ``accelerator.log(values, step=...)``: the metrics of every rank that logs (Accelerate's own
  trackers still get what they would, on the main process);
- ``accelerator.save_state(dir)``: a committed checkpoint of the run (the same staging, commit and
  manifest as ``session.save``), and the folder the script asked for gets the same files;
- ``accelerator.load_state(dir)`` of the folder the runner handed over as ``--resume_from_checkpoint``:
  restored as ``session.restore`` restores (FSDP1 optimizer state, stream positions, RNGs of ranks the
  checkpoint has none for, accumulation at a new world size);
- ``Accelerator(...)``: the accumulation an elastic run needs to keep the global batch, scaled from
  the script's own.

Imports nothing from Ray.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import runpy
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from cluster import patches
from cluster.errors import RaylaunchError
from cluster.protocol import ScriptCall

if TYPE_CHECKING:
    from cluster.rank.session import Session

__all__ = ["ScriptExit", "ScriptHooks", "ScriptSaveError", "checkpoint_step_of", "run_script", "script_argv"]

# The folder names whose number is the step: the *_no_trainer examples' step_<n>, transformers'
# checkpoint-<n>, Accelerate's automatic checkpoint_<n>.
_STEP_NAME = re.compile(r"^(?:step|global_step|checkpoint|ckpt|iter|iteration)[_-]?(\d+)$")


# How long the ranks may take to all reach one save_state before it counts as called on some ranks only.
SAVE_MEET_S = 60.0


class ScriptSaveError(RaylaunchError, RuntimeError):
    """A script's save_state reached by some ranks only."""


class ScriptExit(RaylaunchError, RuntimeError):
    """The script called ``sys.exit`` with a code that is not 0: the rank failed with it."""

    def __init__(self, script: str, code: Any) -> None:
        self.script, self.code = script, code
        shown = code if isinstance(code, int) else 1
        why = "" if isinstance(code, int) else f": {code}"
        super().__init__(f"{script} exited with code {shown} (sys.exit({code!r})){why}")

    def __reduce__(self):
        return (ScriptExit, (self.script, self.code))


def checkpoint_step_of(folder: str) -> int | None:
    """The step a checkpoint folder's name gives, or None.

    >>> checkpoint_step_of("out/step_1200"), checkpoint_step_of("checkpoint-500"), checkpoint_step_of("epoch_3")
    (1200, 500, None)
    """
    m = _STEP_NAME.match(Path(str(folder).rstrip("/")).name)
    return int(m.group(1)) if m else None


def script_argv(call: ScriptCall, resume_folder: str | None) -> list[str]:
    """The script's arguments: its own, and on a resume ``<resume_arg> <folder>`` in place of any it had.

    >>> script_argv(ScriptCall("t.py", ("--lr", "3", "--resume_from_checkpoint", "old")), "/n/step_4")
    ['--lr', '3', '--resume_from_checkpoint', '/n/step_4']
    >>> script_argv(ScriptCall("t.py", ("--resume_from_checkpoint=old",)), None)
    ['--resume_from_checkpoint=old']
    >>> script_argv(ScriptCall("t.py", ("--lr", "3", "--", "data.txt")), "/n/step_4")
    ['--lr', '3', '--resume_from_checkpoint', '/n/step_4', '--', 'data.txt']
    """
    args = list(call.args)
    flag = call.resume_arg
    if resume_folder is None or flag is None:
        return args
    out: list[str] = []
    skip = False
    for i, arg in enumerate(args):
        if skip:
            skip = False
            continue
        if arg == flag:
            skip = i + 1 < len(args) and not args[i + 1].startswith("-")
            continue
        if arg.startswith(flag + "="):
            continue
        out.append(arg)
    if "--" in out:  # after "--" argparse reads only positionals: the flag goes before it
        i = out.index("--")
        return out[:i] + [flag, resume_folder] + out[i:]
    return out + [flag, resume_folder]


def run_script(call: ScriptCall, argv: list[str]) -> None:
    """Run the script in this process as ``python <path> <argv>`` would; a non-zero exit raises ``ScriptExit``."""
    workdir = os.path.abspath(call.workdir or os.getcwd())
    path = os.path.join(workdir, call.path)
    os.chdir(workdir)
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(path))
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        if exc.code is None or exc.code == 0:
            return
        if not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr, flush=True)  # what Python prints for sys.exit("text")
        raise ScriptExit(call.path, exc.code) from None


_CURRENT: list["ScriptHooks | None"] = [None]  # the hooks of the script this process runs now


class _Current:
    """What the replacements of Accelerate's methods read: the current ``ScriptHooks`` (they are installed once a
    process; a rank runs one script, but a process that runs a second, a test's, serves it with its own hooks, not
    the first's)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(_CURRENT[0], name)


class ScriptHooks:
    """Accelerate's ``log``, ``save_state``, ``load_state`` and accumulation, bound to this rank's session."""

    def __init__(self, session: "Session", call: ScriptCall, rank: int) -> None:
        self.session, self.call, self.rank = session, call, rank
        self.resume_folder: str | None = None  # the folder handed to the script on a resume
        self.resume_manifest: dict | None = None
        self.optimizer_steps = 0  # synchronised optimizer steps so far: a checkpoint's step without one in its name
        self._start = 0  # the resumed checkpoint's step
        self._counts: dict[int, int] = {}
        self._inside = False  # our own save_state call, made inside the script's
        self._group: Any = None  # a gloo group for the check that every rank saves
        self._said: set[str] = set()

    def say_once(self, text: str) -> None:
        if self.rank == 0 and text not in self._said:
            self._said.add(text)
            print(f"raylaunch: {text}", file=sys.stderr, flush=True)

    def resumed_from(self, folder: str, manifest: dict) -> None:
        self.resume_folder, self.resume_manifest = folder, manifest
        self.optimizer_steps = self._start = int(manifest["step"])

    def install(self) -> None:
        """Patch Accelerate's classes (``cluster.patches`` says why each); a collective (every rank calls it, after
        the process group exists)."""
        import torch.distributed as dist
        from accelerate import Accelerator
        from accelerate.optimizer import AcceleratedOptimizer

        if dist.is_initialized() and dist.get_world_size() > 1:
            # Its own gloo group: a save_state only some ranks reach is told apart from a slow one there.
            self._group = dist.new_group(backend="gloo")

        _CURRENT[0] = self  # the wrappers below are installed once a process; they serve the latest hooks
        hooks = _Current()

        def init(original: Callable[..., None]) -> Callable[..., None]:
            @functools.wraps(original)
            def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
                hooks._accumulation(kwargs)
                original(self, *args, **kwargs)

            return __init__

        def log(original: Callable[..., None]) -> Callable[..., None]:
            @functools.wraps(original)
            def log_all_ranks(self: Any, values: dict, step: int | None = None,
                              log_kwargs: dict | None = None) -> None:
                hooks.session.log(values, step)  # every rank; Accelerate's own trackers log on the main process
                original(self, values, step=step, log_kwargs=log_kwargs or {})

            return log_all_ranks

        def save_state(original: Callable[..., str]) -> Callable[..., str]:
            @functools.wraps(original)
            def save_committed(self: Any, output_dir: str | None = None, safe_serialization: bool = True,
                               **kwargs: Any) -> str:
                if hooks._inside:
                    return original(self, output_dir, safe_serialization=safe_serialization, **kwargs)
                return hooks._save(self, original, output_dir, safe_serialization, kwargs)

            return save_committed

        def load_state(original: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(original)
            def load_checked(self: Any, input_dir: str | None = None, **kwargs: Any) -> Any:
                ours = hooks._is_resume_folder(input_dir)
                began = time.monotonic()
                if ours:
                    from cluster.checkpoint.resume import init_optimizers_for_load

                    init_optimizers_for_load(self)
                out = original(self, input_dir, **kwargs)
                if ours:
                    hooks._after_resume(self, input_dir)
                    hooks.session.restored(int((hooks.resume_manifest or {}).get("step", 0)),
                                           time.monotonic() - began)
                return out

            return load_checked

        def step(original: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(original)
            def counted_step(self: Any, *args: Any, **kwargs: Any) -> Any:
                out = original(self, *args, **kwargs)
                if self.gradient_state.sync_gradients:
                    hooks._counted(self)
                return out

            return counted_step

        patches.replace_all([(Accelerator, "__init__", init, "accelerate.Accelerator.__init__"),
                             (Accelerator, "log", log, "accelerate.Accelerator.log"),
                             (Accelerator, "save_state", save_state, "accelerate.Accelerator.save_state"),
                             (Accelerator, "load_state", load_state, "accelerate.Accelerator.load_state"),
                             (AcceleratedOptimizer, "step", step, "accelerate.optimizer.AcceleratedOptimizer.step")])

    # --- what the hooks do ---------------------------------------------------------

    def _accumulation(self, kwargs: dict) -> None:
        """The accumulation this Accelerator gets: the script's own (in code) or the runner's, scaled as an
        elastic run scales the runner's at this world size (by 1 at full size), so the global batch is kept."""
        env = "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"
        from cluster.rank.trainer import made_by_trainer, trainer_accumulation

        if (trainer := made_by_trainer()) is not None:  # Trainer accumulates itself, with 1 here on purpose
            trainer_accumulation(trainer, self.call, self.session.payload.context.world_size, self.say_once)
            return
        runner, full = self.call.accumulation, max(1, self.call.full_accumulation)
        plugin = kwargs.get("gradient_accumulation_plugin")
        in_code = plugin.num_steps if plugin is not None else kwargs.get("gradient_accumulation_steps")
        chosen = runner
        if in_code is not None and int(in_code) != 1:
            if full not in (1, int(in_code)):
                self.say_once(f"the script sets gradient_accumulation_steps={in_code} in its code; it is used instead "
                              f"of the launch's {full}")
            scaled = int(in_code) * runner / full
            chosen = max(1, round(scaled))
            if runner != full:
                kept = "keeps" if scaled == chosen else "changes (not a whole number of micro-batches)"
                self.say_once(f"elastic: the script's gradient_accumulation_steps={in_code} is {chosen} at this world "
                              f"size, which {kept} the global batch")
        os.environ[env] = str(chosen)  # Accelerate reads it over its argument
        if plugin is not None:
            plugin.num_steps = chosen

    def _counted(self, optimizer: Any) -> None:
        """One more step of this optimizer; with several (a GAN's two), the most any of them took."""
        key = id(optimizer)
        self._counts[key] = self._counts.get(key, self._start) + 1
        self.optimizer_steps = max(self._counts.values())

    def _every_rank_saves(self) -> None:
        """A checkpoint needs every rank's part: a save_state reached by some ranks only fails, naming them."""
        if self._group is None:
            return
        from datetime import timedelta

        import torch.distributed as dist

        try:
            dist.monitored_barrier(group=self._group, timeout=timedelta(seconds=SAVE_MEET_S), wait_all_ranks=True)
        except RuntimeError as exc:
            raise ScriptSaveError(
                f"save_state was called on rank {self.rank}, but not on every rank within {SAVE_MEET_S:g} s "
                f"({str(exc).splitlines()[0][:300]}). A checkpoint needs every rank's part: call "
                "accelerator.save_state on every process (not inside `if accelerator.is_main_process`); "
                "Accelerate itself decides which process writes which file") from None

    @contextlib.contextmanager
    def inside(self) -> Iterator[None]:
        """Within: ``save_state`` is Accelerate's own (raylaunch's saves and snapshots of the script's state), not a
        save of the script's to commit."""
        was, self._inside = self._inside, True
        try:
            yield
        finally:
            self._inside = was

    def _save(self, accelerator: Any, save_state: Any, output_dir: str | None, safe: bool, kwargs: dict) -> str:
        self._every_rank_saves()
        step = None if output_dir is None else checkpoint_step_of(output_dir)
        step = self.optimizer_steps if step is None else step
        with self.inside():
            if output_dir is None:
                # Accelerate names, numbers and prunes the folder itself (automatic_checkpoint_naming): the
                # script's folder is written as it would be, and the committed checkpoint apart from it.
                output_dir = save_state(accelerator, None, safe_serialization=safe, **kwargs)
                self.session.save_script_state(accelerator, step, None, Path(output_dir).name, safe, kwargs)
                return output_dir
            self.session.save_script_state(accelerator, step, str(output_dir), Path(output_dir).name, safe, kwargs)
            return str(output_dir)

    def _is_resume_folder(self, input_dir: str | None) -> bool:
        if self.resume_folder is None or input_dir is None:
            return False
        try:
            return os.path.samefile(input_dir, self.resume_folder)
        except OSError:
            return False

    def _after_resume(self, accelerator: Any, folder: str) -> None:
        from cluster.checkpoint.resume import (keep_random_states_for_the_first_batch, load_loader_states,
                                              seed_missing_rng)
        from cluster.checkpoint.staged import align_accumulation

        manifest = self.resume_manifest or {}
        load_loader_states(accelerator, folder)
        seed_missing_rng(manifest.get("files", {}), accelerator.process_index, int(manifest.get("step", 0)))
        keep_random_states_for_the_first_batch()
        align_accumulation(accelerator)
