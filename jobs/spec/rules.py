"""The spec's cross-field rules: what a spec whose every field has the right type may still get wrong.

Each problem names its key and says how to fix it. Pure: nothing here reads a file
(``jobs.spec.load`` checks that ``env.pip``'s requirements file exists).
"""

from __future__ import annotations

import re
from pathlib import Path

from cluster.storage_io import storage_credentials
from jobs.spec.check import kind, short
from jobs.spec.schema import RUNNER_VARS, EnvSpec, JobSpec, parse_port_range

__all__ = ["cross_checks", "run_name_problem"]

_VAR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def run_name_problem(name: str) -> str | None:
    """What is wrong with a run name (it names a folder under the storage), or None.

    >>> run_name_problem("../etc")
    "'../etc' must start with a letter or digit, then letters, digits, '.', '_' or '-', at most 200 (it names the run directory)"
    """
    if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}", name):
        return None
    return (f"{short(name)} must start with a letter or digit, then letters, digits, '.', '_' or '-', "
            "at most 200 (it names the run directory)")


def _entry_checks(spec: JobSpec) -> list[str]:
    """Exactly one of ``train_fn`` and ``script``, each well formed."""
    if (spec.train_fn is None) == (spec.script is None):
        return ["train_fn, script: give exactly one: train_fn: module:function (a function called with config), or "
                "script: train.py (a script run as `python train.py *args`, as accelerate launch runs it)"]
    if spec.script is not None:
        return _script_checks(spec)
    out = []
    if spec.args:
        out.append("args: are a script's arguments; a train_fn gets config instead (or name a script:)")
    module, sep, fn = spec.train_fn.partition(":")
    if not sep or not module or not fn:
        out.append(
            f"train_fn: {short(spec.train_fn)} must be 'module:function', "
            "e.g. train_fn.digits:train"
        )
    elif not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", module) \
            or not fn.isidentifier():
        out.append(
            f"train_fn: {short(spec.train_fn)} must be an absolute module path and a function name, "
            "e.g. mypkg.train:main (no leading '.', no file path)"
        )
    return out


def _script_checks(spec: JobSpec) -> list[str]:
    out = []
    script = spec.script
    if not script.endswith(".py"):
        out.append(f"script: {short(script)} must be a Python file ending in .py, e.g. train.py")
    elif Path(script).is_absolute() or ".." in Path(script).parts:
        out.append(f"script: {short(script)} must be a path inside the working directory (relative, no '..'): "
                   "it travels to every node with that folder")
    if spec.config:
        out.append("config: is handed to a train_fn; a script reads its own arguments (args:)")
    if spec.resume_arg is not None and not re.fullmatch(r"--?[A-Za-z0-9][A-Za-z0-9_-]*", spec.resume_arg):
        out.append(f"resume_arg: {short(spec.resume_arg)} must be an option such as --resume_from_checkpoint, "
                   "or null (a restart then runs the script from the beginning)")
    return out


def cross_checks(spec: JobSpec) -> list[str]:
    """What is wrong between fields of a spec whose fields each passed the type checker."""
    out = _entry_checks(spec)
    wrong = run_name_problem(spec.name)
    if wrong:
        out.append(f"name: {wrong}")
    s = spec.scaling
    if s.min_nodes is not None and isinstance(s.num_nodes, int) and s.min_nodes > s.num_nodes:
        out.append(f"scaling.min_nodes: {s.min_nodes} is more than scaling.num_nodes ({s.num_nodes}); "
                   f"set it to at most {s.num_nodes} (--set scaling.min_nodes={s.num_nodes})")
    if s.use_gpu is False and spec.accelerate.mixed_precision == "fp16":
        out.append("accelerate.mixed_precision: fp16 needs GPUs; use bf16 or 'no' with scaling.use_gpu: false")
    fsdp = spec.accelerate.fsdp
    if fsdp is not None and fsdp.transformer_layer_cls_to_wrap and fsdp.min_num_params:
        out.append("accelerate.fsdp: transformer_layer_cls_to_wrap and min_num_params are two ways to wrap; "
                   "keep one of them")
    if fsdp is not None and fsdp.cpu_ram_efficient_loading and s.use_gpu is False:
        out.append("accelerate.fsdp.cpu_ram_efficient_loading: needs GPUs (rank 0's weights are broadcast from "
                   "its device); leave it false with scaling.use_gpu: false")
    if not spec.storage.strip():
        out.append("storage: must be a path or a URI such as s3://bucket/runs")
    secret = storage_credentials(spec.storage)
    if secret:  # never echo the value: it holds the secret
        out.append(f"storage: the URI holds credentials ({secret}); remove them. Each node uses its own "
                   "credential chain (instance profile, AWS_* or GOOGLE_APPLICATION_CREDENTIALS variables "
                   "in its environment); the URI carries only the bucket, prefix and options")
    try:
        parse_port_range(spec.rendezvous.ports)
    except ValueError as exc:
        out.append(f"rendezvous.ports: {exc}")
    if not spec.rendezvous.socket_ifname.strip():
        out.append("rendezvous.socket_ifname: must be 'auto' or an interface name such as eth1")
    out.extend(_env_checks(spec.env))
    return out


def _env_checks(env: EnvSpec) -> list[str]:
    out = []
    for where, names in (("env.vars", list(env.vars)), ("env.secrets", env.secrets)):
        for name in names:
            if not isinstance(name, str) or not _VAR_NAME.fullmatch(name):
                out.append(f"{where}: {str(name)[:60]!r} is not a variable name (letters, digits, '_')")
            elif name in RUNNER_VARS:
                why = ("set it with scaling.cpus_per_worker" if name == "OMP_NUM_THREADS" else
                       "Ray assigns each rank its devices" if name == "CUDA_VISIBLE_DEVICES" else
                       "it makes the ranks meet and know their place in the world")
                out.append(f"{where}: {name} is set by raylaunch for every rank and cannot be overridden ({why})")
    for name, value in env.vars.items():
        if not isinstance(value, (str, int, float, bool)):
            out.append(f"env.vars.{str(name)[:60]}: expected a string or a number, got {kind(value)}")
    both = sorted(set(env.vars) & set(env.secrets))
    if both:
        out.append(f"env: {', '.join(map(str, both))} named in both env.vars and env.secrets; a secret's value "
                   "comes only from where the job is launched")
    if isinstance(env.pip, list) and any(not r.strip() for r in env.pip):
        out.append("env.pip: empty requirement; write each as it goes to pip, e.g. 'humanize==4.9.0'")
    return out
