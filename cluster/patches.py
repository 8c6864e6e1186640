"""What raylaunch changes inside the libraries it runs on, and the private parts of them it reads: the one list.

Every callable of Accelerate, torch, Ray or multiprocessing that raylaunch replaces, every private field of theirs it
writes and every private API it reads is a ``Patch`` in ``PATCHES``: where it is done, why, the public way that was
considered and why it does not do, and what the replacement relies on. The modules named there make the change only
through this one: ``replace`` (for the process's life, once however often asked), ``scoped`` (for one call, put back
after it) and ``write`` (a private field). Each says once, on a version of its library outside the ones these
changes were checked against (``CHECKED``), which of them run unchecked there; and refuses, before anything is
changed, where the original no longer takes the parameters the replacement relies on (a wrong result without a word
would follow). tests/test_patches.py checks every entry against the installed libraries and that nothing in
``cluster`` replaces a library's callable or field but through here.

A replacement "for the process's life" (``Kind.REPLACED``) is made in a rank process only, which runs one training
function or script and ends: it never outlives the job, and the warm host or fork server the rank was forked from
is never changed (they import the libraries, nothing more). The training code may call what is replaced at any
moment of that one call, so the process is the narrowest scope that covers it.

Imports none of those libraries itself: the callers hand over what they change.
"""

from __future__ import annotations

import inspect
import os
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from importlib import metadata
from typing import Any

from cluster.errors import RaylaunchError

__all__ = ["CHECKED", "PATCHES", "Kind", "Patch", "PatchShapeError", "installed", "replace", "replace_all", "scoped",
           "shape_problems", "write"]


class Kind(StrEnum):
    REPLACED = "replaced"  # a callable replaced for the rest of the process
    SCOPED = "scoped"  # a callable replaced during one call, then put back
    FIELD = "field"  # a private field written
    READ = "read"  # a private API read or called, nothing changed


# The versions every change below was run against: the suite's (CPU) and the GPU check's (shared/gpu, an H200,
# 2026-12-04). A version outside is said once, by library; nothing is refused for it.
CHECKED = {"accelerate": ("1.15", "1.16"), "torch": ("2.11", "2.13"), "ray": ("2.60", "2.60"),
           "python": ("3.11", "3.12"), "transformers": ("5.25", "5.25")}


@dataclass(frozen=True)
class Patch:
    """One change to (or private read of) another library."""

    target: str  # the dotted path of what is replaced, written or read
    library: str  # a CHECKED key
    kind: Kind
    where: str  # the module that does it
    why: str
    public: str  # the public way considered, and why it does not do
    params: tuple[str, ...] = ()  # parameters of the original the replacement relies on (checked before replacing)
    also: tuple[str, ...] = ()  # further targets replaced the same way (one patch: three classes' ``__iter__``)

    @property
    def counted(self) -> bool:
        """A change (what the count of #45 counts), not a read."""
        return self.kind is not Kind.READ


_A, _T, _R, _P = "accelerate", "torch", "ray", "python"
PATCHES: tuple[Patch, ...] = (
    # --- the rank side: scripts run as functions (cluster.rank.script), installed for `raylaunch launch`/script specs
    Patch("accelerate.Accelerator.__init__", _A, Kind.REPLACED, "cluster.rank.script",
          "a script's in-code gradient_accumulation_steps scaled as an elastic run scales the launch's",
          "ACCELERATE_GRADIENT_ACCUMULATION_STEPS alone: Accelerate reads it over the script's own value; the public "
          "gradient_accumulation_steps setter at the first prepare (tried in #45): a second Accelerator() resets the "
          "shared GradientState, prepare_model/prepare_optimizer alone never reach it, and the value read before "
          "prepare is not the launch's",
          ("gradient_accumulation_steps", "gradient_accumulation_plugin")),
    Patch("accelerate.Accelerator.log", _A, Kind.REPLACED, "cluster.rank.script",
          "every rank's `accelerator.log` reaches the run's metrics, with no init_trackers needed",
          "a GeneralTracker: Accelerate logs on the main process only, and only after init_trackers"),
    Patch("accelerate.Accelerator.save_state", _A, Kind.REPLACED, "cluster.rank.script",
          "a script's save_state becomes a committed checkpoint (staged, every rank's part, the manifest)",
          "register_save_state_pre_hook: runs before the save, cannot redirect it or commit after it",
          ("output_dir", "safe_serialization")),
    Patch("accelerate.Accelerator.load_state", _A, Kind.REPLACED, "cluster.rank.script",
          "a resume folder's load checked, its loaders' positions and RNG put back, FSDP1 optimizer state made",
          "register_load_state_pre_hook: runs before the load only", ("input_dir",)),
    Patch("accelerate.optimizer.AcceleratedOptimizer.step", _A, Kind.REPLACED, "cluster.rank.script",
          "optimizer steps counted (a checkpoint's step), as Accelerate takes them under accumulation",
          "torch's register_step_post_hook on each prepared optimizer (tried in #45): an optimizer given to "
          "prepare_optimizer alone is missed, one prepared again after free_memory() counted twice, a subclass "
          "calling super().step() fires the hooks twice, a step the fp16 scaler skipped is not one",
          ("closure",)),
    # --- the rank side: strategy (cluster.rank.sharding)
    Patch("accelerate.state.AcceleratorState.__init__", _A, Kind.REPLACED, "cluster.rank.sharding",
          "on CPU nodes, the FSDP path Accelerate takes only for GPU-like devices (it trains plain DDP otherwise)",
          "none: Accelerate has no setting for FSDP on CPU", ("mixed_precision", "fsdp_plugin")),
    Patch("accelerate.state.PartialState._shared_state", _A, Kind.FIELD, "cluster.rank.sharding",
          "the same two fields (distributed type, device) in the state PartialState() reads",
          "none: PartialState is a shared-state singleton filled before the plugin is known"),
    Patch("torch.distributed.fsdp.FullyShardedDataParallel.set_state_dict_type", _T, Kind.REPLACED,
          "cluster.rank.sharding",
          "FSDP1 full state dicts on CPU nodes without offload_to_cpu (torch 2.13 crashes copying CPU to CPU); "
          "for the process's life: Accelerate asks for it in get_state_dict and in every full save",
          "Accelerate's fsdp_plugin state_dict_config: it sets offload_to_cpu=True itself for full state dicts",
          ("module", "state_dict_type", "state_dict_config", "optim_state_dict_config")),
    # --- the rank side: what every prepare does (cluster.rank.sharding reports shards; cluster.rank.pace hooks)
    Patch("accelerate.Accelerator.prepare", _A, Kind.REPLACED, "cluster.rank.prepared",
          "after every prepare: how much of each new model this rank holds (and a refusal if FSDP sharded "
          "nothing), and the gradient hooks that time sync_wait on each new model (to the backward's end: a READ "
          "below)",
          "none: Accelerate has no hook after prepare; prepare_model is bypassed by its FSDP2 path"),
    Patch("accelerate.data_loader.DataLoaderShard.__iter__", _A, Kind.REPLACED, "cluster.rank.pace",
          "each batch's wait timed (data_wait), and a resume's random states put back before its first batch",
          "DataLoaderConfiguration: no hook; wrapping the prepared loaders misses skip_first_batches' new one",
          also=("accelerate.data_loader.DataLoaderDispatcher.__iter__", "accelerate.data_loader.SkipDataLoader.__iter__")),
    # --- the rank side: a restart's DDP models (cluster.rank.restart_sync), during prepare only
    Patch("torch.distributed.utils._verify_param_shape_across_processes", _T, Kind.READ, "cluster.rank.restart_sync",
          "a resuming attempt's DDP models are wrapped with init_sync=False (every rank loads the same state right "
          "after: DDP's first broadcast of rank 0's parameters was 0.2-0.9 s of a restart; the argument goes through "
          "the Accelerator's DistributedDataParallelKwargs for the one prepare): the check init_sync makes first "
          "(the same shapes on every rank) is made here",
          "none: DDP makes it only inside init_sync"),
    Patch("torch.distributed.utils._sync_module_states", _T, Kind.READ, "cluster.rank.restart_sync",
          "the broadcast DDP's init_sync makes, made once a restart's code has restored (or at the model's first "
          "forward) where the ranks' values differ",
          "dist.broadcast a tensor at a time: DDP's own coalesces them into buckets"),
    # --- the rank side: a save held in memory (cluster.checkpoint.snapshot), during save_state only
    Patch("torch.save", _T, Kind.SCOPED, "cluster.checkpoint.snapshot",
          "save_state's files kept in host memory, written in the background", "save_state has no writer to "
          "give; torch.save to a buffer would still copy in the training thread", ("obj", "f")),
    Patch("accelerate.utils.other.safe_save_file", _A, Kind.SCOPED, "cluster.checkpoint.snapshot",
          "the same for safetensors files (and transformers' save_pretrained's, a Trainer's snapshot's, through "
          "the names it imported)", "as torch.save", ("tensors", "filename", "metadata"),
          also=("safetensors.torch.save_file", "transformers.modeling_utils.safe_save_file")),
    Patch("torch.distributed.checkpoint.save", _T, Kind.SCOPED, "cluster.checkpoint.snapshot",
          "the same for FSDP's sharded state (DCP): the collectives run now, the files are kept",
          "a storage_writer of our own alone: Accelerate builds its FileSystemWriter inside save_state (so the "
          "replacement hands DCP ours, a FileSystemWriter subclass writing to memory, built with the path and "
          "options of Accelerate's; was two private fields written on Accelerate's)",
          ("state_dict", "storage_writer")),
    # --- the node side: an embedded cluster (cluster.nodes.connect), while its nodes start
    Patch("ray._private.node.Node.start_api_server", _R, Kind.SCOPED, "cluster.nodes.connect",
          "an embedded head without Ray's API server: 1.5 s of a cold start and an idle process, used by nothing",
          "include_dashboard=False: Ray starts the API server anyway (usage statistics)", ("include_dashboard",)),
    Patch("ray._private.utils.get_dashboard_dependency_error", _R, Kind.SCOPED, "cluster.nodes.connect",
          "embedded nodes' agents load only their minimal modules: 2.2 s of a core at each node's start",
          "none: Ray decides by whether the dashboard's packages import"),
    Patch("ray._private.utils.set_sigterm_handler", _R, Kind.SCOPED, "cluster.nodes.connect",
          "nodes added from a thread leave out the SIGTERM handler only the main thread may set",
          "adding nodes from the main thread: one after another, each start waited for", ("sigterm_handler",)),
    # --- the node side: ranks forked from a fork server or a warm host (cluster.hosting.forkserver)
    Patch("multiprocessing.spawn.get_preparation_data", _P, Kind.SCOPED, "cluster.hosting.forkserver",
          "a rank does not run its actor's __main__ (Ray's worker: 0.3 s of a core a rank) again",
          "a start method without __main__: forkserver is the only one that keeps torch imported", ("name",)),
    Patch("multiprocessing.forkserver._forkserver.ensure_running", _P, Kind.FIELD, "cluster.hosting.forkserver",
          "multiprocessing's fork-server client aimed at a warm host it did not start (its address, alive "
          "descriptor, pid; ensure_running left to the host); put back when the job ends",
          "none: multiprocessing has no API to use a fork server another process started",
          also=("multiprocessing.forkserver._forkserver._forkserver_address",
                "multiprocessing.forkserver._forkserver._forkserver_alive_fd",
                "multiprocessing.forkserver._forkserver._forkserver_pid")),
    Patch("multiprocessing.process._config", _P, Kind.FIELD, "cluster.hosting.forkserver",
          "the fork server's socket folder, one of raylaunch's per process (removed when the process is gone)",
          "TMPDIR for the whole process: it would move every other temporary file too"),
    # --- private reads: nothing changed; each checked by tests/test_patches.py
    Patch("ray._private.state.available_resources_per_node", _R, Kind.READ, "cluster.nodes.placement",
          "what each node has free, to say which nodes could hold a bundle", "ray.available_resources(): the sum"),
    Patch("ray._private.state.state.get_cluster_config", _R, Kind.READ, "cluster.nodes.autoscaler",
          "the node types an autoscaler reported to the GCS (a later Ray's v2 autoscaler reports them; Ray 2.60's "
          "do not), for use_gpu/workers_per_node auto on a cluster that autoscales",
          "none public: ray.autoscaler.sdk only requests resources; the v2 sdk's get_cluster_status names node "
          "types once launched, never what they hold"),
    Patch("ray._private.state.state.get_draining_nodes", _R, Kind.READ, "jobs.driver.attempt, jobs.driver.driver",
          "the nodes Ray is draining (the autoscaler's or a cloud's preemption) and their deadlines, as Ray Train's "
          "get_preemption_info reads them: their ranks get a stop notice and the restart avoids them",
          "none public: ray.train.get_preemption_info reads this inside Ray Train's workers only"),
    Patch("ray._private.services.start_monitor", _R, Kind.READ, "cluster.nodes.autoscaler",
          "the config file the head's autoscaler process was started with (the --autoscaling-config of the command "
          "start_monitor writes), read from /proc on the head: the node types it may start, as it sees them",
          "get_cluster_config (above): empty under Ray 2.60's v1 and v2 autoscalers; the status `ray status` "
          "prints (DEBUG_AUTOSCALING_STATUS, get_cluster_status) holds no node type's resources",
          ("autoscaling_config",)),
    Patch("ray._private.runtime_env.packaging._zip_files", _R, Kind.READ, "cluster.nodes.upload",
          "the upload zipped as Ray would, to measure it first", "none public"),
    Patch("ray._private.runtime_env.packaging._dir_travel", _R, Kind.READ, "cluster.nodes.upload",
          "the upload's files walked as Ray walks them", "none public"),
    Patch("ray._private.runtime_env.packaging._get_excludes", _R, Kind.READ, "cluster.nodes.upload",
          "excludes matched as Ray matches them", "none public"),
    Patch("ray._private.ray_constants.DASHBOARD_CLIENT_MAX_SIZE", _R, Kind.READ, "cluster.nodes.upload",
          "the upload's size limit, said before Ray refuses", "none public"),
    Patch("transformers.Trainer._save_optimizer_and_scheduler", "transformers", Kind.READ, "cluster.rank.trainer",
          "a Trainer's snapshot in memory writes what Trainer's _save_checkpoint writes, with Trainer's own methods, "
          "minus its collectives (store_flos's gather, the best model's barrier: one rank skipping a snapshot would "
          "leave the others waiting) and its rotation and upload",
          "_save_checkpoint itself: collective (above), and it prunes and uploads the user's output_dir",
          also=("transformers.Trainer._save_scaler", "transformers.Trainer._save_rng_state")),
    Patch("torch.distributed.checkpoint.state_dict._init_optim_state", _T, Kind.READ, "cluster.checkpoint.resume",
          "an FSDP1 optimizer state to load into before load_state", "none public"),
    Patch("torch.autograd.Variable._execution_engine", _T, Kind.READ, "cluster.rank.pace",
          "a backward's end, for sync_wait: queue_callback, as DDP and FSDP use it to wait for their reductions "
          "(was a replaced Accelerator.backward; a plain loss.backward() is measured too); and the backward's graph "
          "task, which tells one backward's gradient hooks from the next's (a forward pre-hook did: 3.6 us a step)",
          "none public: a hook on the loss's graph runs first, not last; an optimizer step pre-hook would count the "
          "user's code between backward and step", also=("torch._C._current_graph_task_id",)),
    Patch("torch.distributed.fsdp.FullyShardedDataParallel._flat_param", _T, Kind.READ, "cluster.rank.sharding",
          "how much of an FSDP1 model a rank holds (its flat parameter's unsharded size)", "none public"),
    Patch("accelerate.Accelerator._models", _A, Kind.READ, "cluster.rank.prepared, cluster.checkpoint.resume",
          "the models, optimizers and dataloaders an Accelerator prepared", "none public",
          also=("accelerate.Accelerator._optimizers", "accelerate.Accelerator._dataloaders")),
    Patch("multiprocessing.forkserver.ForkServer._stop", _P, Kind.READ, "cluster.hosting.forkserver",
          "this process's own fork server stopped (killed first: it would unload torch) when its job ends",
          "none public"),
    Patch("argparse.ArgumentParser._actions", _P, Kind.READ, "jobs.spec.launch",
          "accelerate launch's own options, read from its parser", "none public"),
    Patch("atexit._run_exitfuncs", _P, Kind.READ, "cluster.rank.exiting",
          "a rank ends with os._exit, where Python's end would call the training code's atexit handlers: they are "
          "called when it returns (_clear first: those of the process the rank was forked from are not its own)",
          "none public: atexit lists nothing and calls only at the interpreter's end, the finalization a rank "
          "leaves out (gloo's threads abort a process there now and then)", also=("atexit._clear",)),
    Patch("threading._shutdown", _P, Kind.READ, "cluster.rank.exiting",
          "a rank's non-daemon threads waited for (executors shut down first) before what they wrote is flushed and "
          "the rank ends with os._exit: what multiprocessing calls next itself, once",
          "Thread.join over threading.enumerate(): an executor's idle workers never end unless shut down first"),
)

_BY_TARGET = {t: p for p in PATCHES for t in (p.target, *p.also)}
_INSTALLED: dict[tuple[int, str], tuple[Any, Any]] = {}  # (id(holder), name) -> (holder, its original)
_FOUND_GOOD: dict[str, Any] = {}  # target -> the callable last found to take its parameters (held: its id stays its)
_SAID: set[str] = set()


class PatchShapeError(RaylaunchError):
    """A library's callable no longer takes what raylaunch's replacement of it relies on."""

    exit_code = 2


def _version(library: str) -> str:
    if library == _P:
        return "%d.%d.%d" % sys.version_info[:3]
    try:
        return metadata.version(library)
    except metadata.PackageNotFoundError:
        return "?"


def _minor(version: str) -> tuple[int, ...]:
    """``(major, minor)`` of a version: ``"2.6rc1"`` is ``(2, 6)``, ``"2.13.0+cpu"`` ``(2, 13)``."""
    return tuple(int(m.group()) if (m := re.match(r"\d+", piece)) else 0 for piece in (version.split(".") + ["0"])[:2])


def _say_version(library: str) -> None:
    """Once per process and library, and only in rank 0 (or outside a run): a version outside ``CHECKED``."""
    if library in _SAID:
        return
    _SAID.add(library)
    low, high = CHECKED[library]
    have = _version(library)
    if have == "?" or _minor(low) <= _minor(have) <= _minor(high) or os.environ.get("RANK", "0") != "0":
        return
    changed = sorted(p.target for p in PATCHES if p.library == library and p.counted)
    print(f"raylaunch: {library} {have} is outside the versions raylaunch's changes to it were checked against "
          f"({low} to {high}): {', '.join(changed)} (cluster/patches.py says why each is there); if a run goes "
          "wrong, report it with `pip show accelerate torch ray`", file=sys.stderr, flush=True)


def shape_problems(patch: Patch, original: Any) -> list[str]:
    """What of ``patch.params`` the original no longer takes, by name (empty when it takes them all)."""
    if not patch.params:
        return []
    try:
        params = inspect.signature(original).parameters
    except (TypeError, ValueError):
        return [f"{patch.target}: its parameters cannot be read"]
    missing = [p for p in patch.params if p not in params]
    return [f"{patch.target} no longer takes {', '.join(missing)}"] if missing else []


def _entry(target: str, kind: Kind) -> Patch:
    patch = _BY_TARGET.get(target)
    if patch is None or patch.kind is not kind:
        raise KeyError(f"{target} is not a {kind} patch of cluster/patches.py's PATCHES: add it there, with why")
    return patch


def _check(patch: Patch, original: Any) -> None:
    if _FOUND_GOOD.get(patch.target) is original:  # (read once: a scoped change is made at every snapshot)
        return
    _say_version(patch.library)
    problems = shape_problems(patch, original)
    if not problems:
        _FOUND_GOOD[patch.target] = original
        return
    good = CHECKED[patch.library][1]
    use = (f"Python {good}" if patch.library == _P else
           f"{patch.library} {good} (`pip install '{patch.library}=={good}.*'`)")
    raise PatchShapeError(f"raylaunch cannot run with {patch.library} {_version(patch.library)}: "
                          f"{'; '.join(problems)}, which raylaunch's replacement of it ({patch.why}) relies on. "
                          f"Use {use}, or report it")


def installed(holder: Any, name: str) -> bool:
    """Whether ``replace`` has replaced ``holder.name`` in this process."""
    found = _INSTALLED.get((id(holder), name))
    return found is not None and found[0] is holder


def replace(holder: Any, name: str, make: Callable[[Any], Any], target: str) -> None:
    """Replace ``holder.name`` by ``make(original)`` for the rest of the process; a second call does nothing.
    ``target`` names the ``PATCHES`` entry (one of its targets)."""
    replace_all([(holder, name, make, target)])


def replace_all(changes: list[tuple[Any, str, Callable[[Any], Any], str]]) -> None:
    """``replace`` for several ``(holder, name, make, target)``: every one checked before any is replaced."""
    todo = [c for c in changes if not installed(c[0], c[1])]
    for holder, name, _, target in todo:
        _check(_entry(target, Kind.REPLACED), getattr(holder, name))
    for holder, name, make, _ in todo:
        original = inspect.getattr_static(holder, name)
        new = make(getattr(holder, name))
        _INSTALLED[(id(holder), name)] = (holder, original)  # the holder kept: its id is never another's
        setattr(holder, name, staticmethod(new) if isinstance(original, staticmethod) else new)


@contextmanager
def scoped(holder: Any, name: str, new: Any, target: str) -> Iterator[Any]:
    """``holder.name`` replaced by ``new`` within the block and put back after it as it was (a staticmethod as
    one; one the holder only inherited, by removing the replacement); yields the original."""
    patch = _entry(target, Kind.SCOPED)
    original = getattr(holder, name)
    _check(patch, original)
    own = name in getattr(holder, "__dict__", {})
    static = inspect.getattr_static(holder, name)
    setattr(holder, name, new)
    try:
        yield original
    finally:
        if own:
            setattr(holder, name, static)
        else:
            delattr(holder, name)


def write(holder: Any, name: str, value: Any, target: str) -> None:
    """A private field of another library written (``holder`` an object, or a mapping: ``holder[name]``)."""
    _say_version(_entry(target, Kind.FIELD).library)
    if isinstance(holder, dict):
        holder[name] = value
    else:
        setattr(holder, name, value)
