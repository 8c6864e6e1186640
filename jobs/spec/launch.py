"""``raylaunch launch``: an ``accelerate launch`` command line, read as a job spec.

``raylaunch launch [raylaunch options] [accelerate launch options] SCRIPT.py [script args]``
is ``accelerate launch`` with one word changed. Accelerate's own parser reads the command
(``accelerate.commands.launch.launch_command_parser``: every option, spelled with ``_`` or
``-``), and :func:`parse` turns the options that mean something on a Ray cluster into the keys of
the spec that a ``script:`` job runs with; ``--spec FILE`` gives the rest. ``launch``, ``submit``
and ``validate`` with a script build that one spec, then run the same code as a spec file does.

    >>> cmd = parse("launch", ["--num_processes", "2", "--mixed_precision", "bf16", "train.py", "--lr", "3e-4"])
    >>> cmd.raw["script"], cmd.raw["args"], cmd.raw["scaling"], cmd.raw["accelerate"]
    ('train.py', ['--lr', '3e-4'], {'workers_per_node': 2}, {'mixed_precision': 'bf16'})
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from jobs.spec import JobSpec, SpecError, apply_overrides, read_spec_dict, spec_from_dict

__all__ = ["LaunchCommand", "NOT_NEEDED", "SUPPORTED", "is_script_command", "parse", "verb_args"]

_SOURCE = "the launch command"

# accelerate launch's options that keep their name and meaning, by what they set.
SUPPORTED = (
    "config_file", "num_processes", "num_machines", "mixed_precision", "gradient_accumulation_steps", "cpu",
    "multi_gpu", "use_fsdp", "fsdp_version", "fsdp_reshard_after_forward", "fsdp_state_dict_type",
    "fsdp_auto_wrap_policy", "fsdp_transformer_layer_cls_to_wrap", "fsdp_min_num_params",
    "fsdp_activation_checkpointing", "fsdp_cpu_ram_efficient_loading", "fsdp_offload_params",
    "dynamo_backend", "dynamo_mode", "dynamo_use_fullgraph", "dynamo_use_dynamic", "dynamo_use_regional_compilation",
    "max_restarts",
)
# Options a single raylaunch command makes unnecessary: accepted, and said once.
NOT_NEEDED = ("machine_rank", "main_process_ip", "main_process_port", "rdzv_backend", "same_network")

_CONFIG_FILE = "accelerate.config_file (a file written by `accelerate config`)"
# Every other option: what to use instead.
_INSTEAD = {
    "num_cpu_threads_per_process": "scaling.cpus_per_worker (each rank's threads are the CPUs it reserves)",
    "monitor_interval": "nothing: the runner watches every rank itself (timeouts.heartbeat_s bounds a silent one)",
    "gpu_ids": "scaling.use_gpu (Ray gives each rank its own GPU)",
    "main_training_function": "train_fn: module:function in a spec",
    "module": "a script path (SCRIPT.py), or train_fn: module:function in a spec",
    "no_python": "a Python script path",
    "tee": "nothing: every rank's output is in the run's logs, prefixed with its rank",
    "log_dir": "nothing: every rank's output is in the run's logs (raylaunch show RUN)",
    "role": "nothing: ranks are named by the runner", "rdzv_conf": "rendezvous.ports",
    "env": "env.vars", "debug": "env.vars: {ACCELERATE_DEBUG_MODE: 'true'}",
    "fsdp_sharding_strategy": "fsdp_reshard_after_forward (true: FULL_SHARD, false: SHARD_GRAD_OP), or "
                              + _CONFIG_FILE,
}
_ALSO_CONFIG_FILE = re.compile(r"^(fsdp_|use_deepspeed|deepspeed_|zero_stage|zero3_|offload_|gradient_clipping|"
                               r"use_megatron_lm|megatron_lm_|fp8_|use_parallelism_config|parallelism_config_|"
                               r"downcast_bf16)")


@dataclass(frozen=True)
class LaunchCommand:
    """A parsed launch command: raylaunch's own options, and the spec mapping the rest make."""

    verb: str  # launch, submit or validate
    options: argparse.Namespace  # raylaunch's own: address, local_nodes, storage, name, set, fresh, quiet, ...
    raw: dict  # the spec's keys that the script and Accelerate's options give, over --spec's
    notes: tuple[str, ...]  # said once before the job starts
    implicit_config: str | None = None  # the config file `accelerate config` saved, read without --config_file

    def spec(self) -> JobSpec:
        """The job spec: ``--spec`` and the command's keys, then ``--set``, then ``--name``/``--storage``."""
        literals = {k: v for k in ("storage", "name") if (v := getattr(self.options, k, None)) is not None}
        raw = apply_overrides(self.raw, list(self.options.set or []), "--set", literals)
        return spec_from_dict(raw, self.options.spec or _SOURCE)


def is_script_command(argv: list[str]) -> bool:
    """Whether ``submit``/``validate`` arguments name a script (``*.py``) rather than a spec file."""
    return any(a.endswith(".py") and not a.startswith("-") and "=" not in a for a in argv)


def _raylaunch_options(p: argparse.ArgumentParser, verb: str) -> None:
    g = p.add_argument_group("raylaunch (before the script)")
    g.add_argument("--spec", metavar="FILE", help="a job spec for everything else (storage, failure, env, ...); "
                                                  "the command's options win over it")
    g.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a spec value (repeatable)")
    g.add_argument("--storage", help="the run storage path or URI")
    g.add_argument("--name", help="the run name (default: the spec's, else the script's name)")
    g.add_argument("-q", "--quiet", action="store_true", help="no progress bar or progress lines")
    if verb in ("launch", "submit"):
        g.add_argument("--address", help="a Ray cluster (launch: ray://host:10001 or auto, default an embedded "
                                         "cluster; submit: the dashboard, e.g. http://127.0.0.1:8265)")
    if verb == "launch":
        g.add_argument("--local-nodes", type=int, metavar="N", dest="local_nodes",
                       help="the embedded cluster's real Ray nodes on this machine (default: --num_machines)")
        g.add_argument("--keep-temp", action="store_true", dest="keep_temp",
                       help="keep the embedded cluster's Ray session folder when the command ends")
    if verb in ("launch", "submit"):
        g.add_argument("--fresh", action="store_true", help="start over in a new run directory instead of resuming")
    if verb == "submit":
        g.add_argument("--follow", action="store_true", help="show live progress and logs; exit with the job's status")
        g.add_argument("--dry-run", action="store_true", dest="dry_run", help="print the request and send nothing")


def _parser(verb: str, suppress: bool) -> argparse.ArgumentParser:
    from accelerate.commands.launch import launch_command_parser

    p = argparse.ArgumentParser(prog=f"raylaunch {verb}", parents=[launch_command_parser()], add_help=True,
                                conflict_handler="resolve", allow_abbrev=False,
                                usage=f"raylaunch {verb} [raylaunch options] [accelerate launch options] SCRIPT.py "
                                      "[script arguments ...]")
    _raylaunch_options(p, verb)
    if suppress:  # only what the command line gave
        for action in p._actions:
            if action.option_strings and action.dest != "help":
                action.default = argparse.SUPPRESS
    return p


def parse(verb: str, argv: list[str]) -> LaunchCommand:
    """Read ``argv`` (after the verb) as ``accelerate launch`` does; a spec-level problem is a ``SpecError``."""
    args, extra = _parser(verb, suppress=False).parse_known_args(argv)
    if extra:
        raise SpecError([f"{' '.join(extra)}: not an option of `raylaunch {verb}` or `accelerate launch`; raylaunch's "
                         "own options and accelerate launch's come before the script"], _SOURCE)
    given = vars(_parser(verb, suppress=True).parse_known_args(argv)[0])
    ours = {a.dest for a in _parser_actions(verb)}
    options = argparse.Namespace(**{k: getattr(args, k) for k in ours})
    accel = {k: v for k, v in given.items()
             if k not in ours and k not in ("training_script", "training_script_args", "nondefault")}
    notes: list[str] = []
    problems = [_instead(k) for k in sorted(accel) if k not in SUPPORTED and k not in NOT_NEEDED]
    unneeded = [k for k in NOT_NEEDED if k in accel]
    if unneeded:
        notes.append(f"{', '.join('--' + k for k in unneeded)}: not needed (raylaunch places every node and sets up "
                     "the rendezvous itself); ignored")
    if problems:
        raise SpecError(problems, _SOURCE)
    if not args.training_script:
        raise SpecError(["no script: give SCRIPT.py after the options, e.g. raylaunch launch --num_processes 2 "
                         "train.py --lr 3e-4"], _SOURCE)
    raw = read_spec_dict(options.spec) if options.spec else {}
    raw = copy.deepcopy(raw)
    raw["script"] = args.training_script
    raw["args"] = list(args.training_script_args)
    if "name" not in raw:
        raw["name"] = default_name(args.training_script, raw["args"])
    implicit = _from_accelerate(accel, raw, notes)
    return LaunchCommand(verb, options, raw, tuple(notes), implicit)


# Where a launch command's raylaunch options go: the fields each verb reads from its arguments.
_VERB_DEFAULTS = {"spec": None, "set": None, "storage": None, "name": None, "address": None, "local_nodes": None,
                  "fresh": False, "quiet": False, "follow": False, "dry_run": False, "spec_json": None,
                  "event_lines": False}


def verb_args(verb: str, argv: list[str], funcs: dict[str, Any]) -> argparse.Namespace:
    """``raylaunch launch ...`` (and ``submit``/``validate`` of a script) as the verb's arguments, said once;
    ``funcs``: the CLI's function for each verb."""
    cmd = parse(verb, argv)
    say(cmd)
    return argparse.Namespace(**{**_VERB_DEFAULTS, **vars(cmd.options)}, launch=cmd, command=verb, func=funcs[verb])


def default_name(script: str, args: list[str]) -> str:
    """The run's name when neither ``--name`` nor the spec gives one: the script's and a hash of its arguments,
    so the same command resumes its run and other arguments start another.

    >>> default_name("src/train.py", ["--lr", "3e-4"]) == default_name("src/train.py", ["--lr", "3e-4"])
    True
    >>> default_name("src/train.py", []).startswith("train-")
    True
    """
    import hashlib
    import json

    stem = re.sub(r"[^A-Za-z0-9._-]", "-", Path(script).stem).lstrip("._-") or "script"
    digest = hashlib.sha256(json.dumps([script, list(args)]).encode()).hexdigest()[:6]
    return f"{stem[:190]}-{digest}"


def _parser_actions(verb: str) -> list[argparse.Action]:
    p = argparse.ArgumentParser(add_help=False)
    _raylaunch_options(p, verb)
    return [a for a in p._actions]


def _instead(option: str) -> str:
    flag = "--" + option
    if option in _INSTEAD:
        instead = _INSTEAD[option]
        if instead.startswith("nothing: "):
            return f"{flag}: not an option of raylaunch launch, and not needed: {instead[len('nothing: '):]}"
        return f"{flag}: not an option of raylaunch launch; use {instead}"
    if _ALSO_CONFIG_FILE.match(option):
        return f"{flag}: not an option of raylaunch launch; put it in {_CONFIG_FILE} and pass --config_file"
    return f"{flag}: not available on a Ray cluster (it configures a launcher raylaunch replaces); leave it out"


def _section(raw: dict, key: str) -> dict:
    value = raw.get(key)
    if not isinstance(value, dict):
        value = raw[key] = {}
    return value


def _truth(option: str, value: Any) -> bool:
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise SpecError([f"--{option}: expected true or false, got {value!r}"], _SOURCE)


def _config_file(accel: dict, notes: list[str]) -> tuple[str | None, dict]:
    """The config file ``accelerate launch`` would read (``--config_file``, else the one ``accelerate config``
    saved, unless ``--cpu``), and its mapping."""
    path = accel.get("config_file")
    if path is None and not accel.get("cpu"):
        from accelerate.commands.config import default_config_file

        if os.path.isfile(default_config_file):
            path = default_config_file
            notes.append(f"reading the accelerate config file {default_config_file} (saved by `accelerate config`), "
                         "as accelerate launch does without --config_file")
    if path is None:
        return None, {}
    try:
        data = yaml.safe_load(Path(path).expanduser().read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise SpecError([f"--config_file: cannot read {path}: {getattr(exc, 'strerror', None) or exc}"], _SOURCE) from None
    if not isinstance(data, dict):
        raise SpecError([f"--config_file: {path} is not an accelerate config file (a mapping, as `accelerate config` "
                         "writes)"], _SOURCE)
    return path, data


def _from_accelerate(accel: dict, raw: dict, notes: list[str]) -> str | None:
    """The spec keys Accelerate's options stand for, written into ``raw``; the config file read without
    ``--config_file`` (the one `accelerate config` saved), if any."""
    path, file_cfg = _config_file(accel, notes)
    acc = _section(raw, "accelerate") if (path or any(k in accel for k in SUPPORTED[3:-1])) else {}
    if path is not None:
        acc["config_file"] = path
    spec_scaling = raw.get("scaling") if isinstance(raw.get("scaling"), dict) else {}
    machines, processes = accel.get("num_machines"), accel.get("num_processes")
    source = {"num_machines": "--num_machines", "num_processes": "--num_processes"}
    for key, spec_key in (("num_machines", "num_nodes"), ("num_processes", "workers_per_node")):
        # the config file's topology only where neither the command nor --spec gives one
        if accel.get(key) is None and spec_key not in spec_scaling and file_cfg.get(key) is not None:
            if key == "num_machines":
                machines = file_cfg[key]
            else:
                processes = file_cfg[key]
            source[key] = f"{key}: {file_cfg[key]} in {path}"
            notes.append(f"{key} {file_cfg[key]}: from {path}")
    scaling = _section(raw, "scaling") if machines is not None or processes is not None else None
    if machines is not None:
        scaling["num_nodes"] = _count("num_machines", machines)
    if processes is not None:
        processes = _count("num_processes", processes)
        nodes = int(scaling.get("num_nodes", 1))
        if processes % nodes:
            raise SpecError([f"{source['num_processes']} over {nodes} machines ({source['num_machines']}): raylaunch "
                             f"starts the same number of processes on every node; give a multiple of {nodes}"],
                            _SOURCE)
        scaling["workers_per_node"] = processes // nodes
    elif "workers_per_node" not in spec_scaling:
        notes.append("--num_processes not given: one process per node (accelerate launch would start one per GPU); "
                     "give --num_processes for more")
    if accel.get("cpu") or file_cfg.get("use_cpu") or str(file_cfg.get("distributed_type", "")).upper() == "MULTI_CPU":
        _section(raw, "scaling")["use_gpu"] = False
        if accel.get("cpu") and processes is not None and processes > 1:
            per_node = scaling["workers_per_node"]
            notes.append(f"--cpu with {source['num_processes']} {processes}: accelerate launch would start a single "
                         "process, not a world of several (its --cpu launcher is the single-process one, and --cpu "
                         "with --multi_gpu is refused; ACCELERATE_USE_CPU=true with --multi_gpu gives several); "
                         f"raylaunch starts {processes} ranks on CPUs, {per_node} per node, as --num_processes says")
    if "mixed_precision" in accel:
        acc["mixed_precision"] = accel["mixed_precision"]
    if "gradient_accumulation_steps" in accel:
        acc["gradient_accumulation_steps"] = _count("gradient_accumulation_steps", accel["gradient_accumulation_steps"])
    fsdp = _fsdp(accel, file_fsdp=str(file_cfg.get("distributed_type", "")).upper() == "FSDP")
    if fsdp is not None:
        acc["fsdp"] = {**(acc.get("fsdp") or {}), **fsdp}
    if acc and "accelerate" not in raw:
        raw["accelerate"] = acc
    if "max_restarts" in accel:  # restarts after any failure, as accelerate launch's (torchrun's) own
        _section(raw, "failure")["max_restarts"] = int(accel["max_restarts"])
    dynamo = _dynamo(accel)
    if dynamo:
        _section(_section(raw, "env"), "vars").update(dynamo)
    return path if path is not None and "config_file" not in accel else None


def _count(option: str, value: Any) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if n < 1:
        raise SpecError([f"--{option}: expected a whole number of at least 1, got {value!r}"], _SOURCE)
    return n


_STATE_DICT = {"SHARDED_STATE_DICT": "sharded", "FULL_STATE_DICT": "full"}


def _fsdp(accel: dict, *, file_fsdp: bool) -> dict | None:
    """``accelerate.fsdp`` from ``--use_fsdp`` and the ``--fsdp_*`` options; None when FSDP is not asked for."""
    options = {k: v for k, v in accel.items() if k.startswith("fsdp_")}
    if not accel.get("use_fsdp") and not options:
        return None
    if not accel.get("use_fsdp") and not file_fsdp:
        raise SpecError([f"{', '.join('--' + k for k in sorted(options))}: FSDP options, but FSDP is not asked for; "
                         "add --use_fsdp (or a --config_file with distributed_type: FSDP)"], _SOURCE)
    out: dict[str, Any] = {}
    if accel.get("use_fsdp") and not file_fsdp:
        out["version"] = 1  # accelerate launch's default
    if "fsdp_version" in options:
        out["version"] = int(options["fsdp_version"])
    for option, key in (("fsdp_offload_params", "offload_params"), ("fsdp_activation_checkpointing",
                        "activation_checkpointing"), ("fsdp_cpu_ram_efficient_loading", "cpu_ram_efficient_loading")):
        if option in options:
            out[key] = _truth(option, options[option])
    if "fsdp_reshard_after_forward" in options:
        value = str(options["fsdp_reshard_after_forward"]).upper()
        out["reshard_after_forward"] = {"FULL_SHARD": True, "SHARD_GRAD_OP": False}.get(value) \
            if value in ("FULL_SHARD", "SHARD_GRAD_OP") else _truth("fsdp_reshard_after_forward", value)
    if "fsdp_state_dict_type" in options:
        kind = str(options["fsdp_state_dict_type"]).upper()
        if kind not in _STATE_DICT:
            raise SpecError([f"--fsdp_state_dict_type: {kind} is not one raylaunch commits; use SHARDED_STATE_DICT "
                             "or FULL_STATE_DICT"], _SOURCE)
        out["state_dict_type"] = _STATE_DICT[kind]
    elif "version" in out:  # Accelerate's default for the version
        out["state_dict_type"] = "full" if out["version"] == 1 else "sharded"
    policy = str(options.get("fsdp_auto_wrap_policy", "")).upper()
    classes = options.get("fsdp_transformer_layer_cls_to_wrap")
    if classes or policy == "TRANSFORMER_BASED_WRAP":
        if not classes:
            raise SpecError(["--fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP: name the layer classes with "
                             "--fsdp_transformer_layer_cls_to_wrap, e.g. BertLayer"], _SOURCE)
        out["transformer_layer_cls_to_wrap"] = [c.strip() for c in str(classes).split(",") if c.strip()]
    elif policy == "SIZE_BASED_WRAP":
        out["min_num_params"] = int(options.get("fsdp_min_num_params", 100_000_000))
    elif policy not in ("", "NO_WRAP"):
        raise SpecError([f"--fsdp_auto_wrap_policy: {policy} is not TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP or "
                         "NO_WRAP"], _SOURCE)
    return out


def _dynamo(accel: dict) -> dict[str, str]:
    """``ACCELERATE_DYNAMO_*`` as ``accelerate launch`` exports them, when a ``--dynamo_*`` option is given."""
    if not any(k.startswith("dynamo_") for k in accel):
        return {}
    from accelerate.utils import DynamoBackend

    backend = str(accel.get("dynamo_backend", "no")).upper()
    try:
        backend = DynamoBackend(backend).value
    except ValueError:
        raise SpecError([f"--dynamo_backend: {backend} is not one of {', '.join(DynamoBackend.list())}"], _SOURCE) from None
    return {
        "ACCELERATE_DYNAMO_BACKEND": backend,
        "ACCELERATE_DYNAMO_MODE": str(accel.get("dynamo_mode", "default")),
        "ACCELERATE_DYNAMO_USE_FULLGRAPH": str(bool(accel.get("dynamo_use_fullgraph", False))),
        "ACCELERATE_DYNAMO_USE_DYNAMIC": str(bool(accel.get("dynamo_use_dynamic", False))),
        "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": str(bool(accel.get("dynamo_use_regional_compilation", False))),
    }


def say(cmd: LaunchCommand) -> None:
    """The command's notes, once each, before anything starts."""
    for note in cmd.notes:
        print(f"raylaunch: {note}", file=sys.stderr, flush=True)
