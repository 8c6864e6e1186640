"""Finding the user's training function: checked without running it (driver, CLI, submit), imported in each rank."""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from cluster.errors import RaylaunchError

__all__ = ["ScriptCheck", "TrainFnAttributeError", "TrainFnImportError", "check_entry", "check_script", "check_train_fn",
           "resolve_train_fn"]


class TrainFnImportError(RaylaunchError, ImportError):
    """The spec's ``train_fn`` names a module that cannot be found or read."""

    exit_code = 2
    hint = ". Fix `train_fn` in the spec (module:function)."


class TrainFnAttributeError(RaylaunchError, AttributeError):
    """The spec's ``train_fn`` names a function its module does not define."""

    exit_code = 2
    hint = TrainFnImportError.hint


class ScriptError(RaylaunchError, ImportError):
    """The spec's ``script`` cannot be found or read in the working directory, or does not parse."""

    exit_code = 2
    hint = ". Fix `script` in the spec (or the script path of `raylaunch launch`), and run from the project folder."


@dataclass(frozen=True)
class ScriptCheck:
    """What ``check_script`` found: where the script is and whether it reads the resume flag."""

    path: str  # as found, under the working directory
    resume_arg: str | None
    reads_resume_arg: bool  # an argparse option of that name is in the source, or TrainingArguments' own

    def describe(self) -> str:
        """What happens on a restart, in one line."""
        if self.resume_arg is None:
            return ("resume: resume_arg is null, so after a restart the script runs again from the beginning "
                    "(committed checkpoints are still written)")
        if self.reads_resume_arg:
            return (f"resume: after a restart the script gets {self.resume_arg} <folder of the latest committed "
                    f"checkpoint> (it reads that option: argparse, or TrainingArguments through HfArgumentParser)")
        return (f"resume: after a restart the script gets {self.resume_arg} <folder>, but no argparse option "
                f"{self.resume_arg} was found in {self.path}: if it does not read it, it fails on the unknown "
                "argument or starts from the beginning; set resume_arg to the flag it reads (or null)")


def check_script(script: str, resume_arg: str | None, base: str | os.PathLike = ".") -> ScriptCheck:
    """Check that ``script`` is a Python file of the working directory that parses, without running it."""
    import ast

    where = Path(base) / script
    if not where.is_file():
        raise ScriptError(f"script {script!r}: no such file in the working directory ({Path(base).resolve()})")
    try:
        source = where.read_bytes()
    except OSError as exc:
        raise ScriptError(f"script {script!r}: cannot read it: {exc.strerror or exc}") from None
    try:
        tree = ast.parse(source, str(where))
    except SyntaxError as exc:
        raise ScriptError(f"script {script!r}: line {exc.lineno}: SyntaxError: {exc.msg}") from None
    except ValueError as exc:  # null bytes
        raise ScriptError(f"script {script!r}: not Python source: {exc}") from None
    found = False
    if resume_arg is not None:
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument"
                    and any(isinstance(a, ast.Constant) and a.value == resume_arg for a in node.args)):
                found = True
                break
            # transformers' HfArgumentParser reads TrainingArguments' fields as options: --resume_from_checkpoint
            # is one (the examples pass it to trainer.train)
            if (resume_arg.lstrip("-").replace("-", "_") == "resume_from_checkpoint"
                    and isinstance(node, (ast.Name, ast.Attribute))
                    and (getattr(node, "id", None) or getattr(node, "attr", None)) == "HfArgumentParser"):
                found = True
                break
    return ScriptCheck(script, resume_arg, found)


def check_entry(spec: Any, base: str | os.PathLike = ".") -> ScriptCheck | None:
    """Check the spec's ``train_fn`` or ``script`` (a ``jobs.spec.JobSpec``); a script's check, or None."""
    if spec.script is not None:
        return check_script(spec.script, spec.resume_arg, base)
    check_train_fn(spec.train_fn)
    return None


def check_train_fn(path: str) -> None:
    """Check that ``"module:function"`` exists without running any of the user's code.

    The driver calls this before it reserves anything. The module is found on
    ``sys.path`` one package at a time (no package's ``__init__`` runs) and its
    top-level definitions are read from the source; a module without source (an
    extension) is the one case that is imported.
    """
    import ast

    module_name, _, fn_name = path.partition(":")
    spec = _find_source(module_name)
    if spec is None:
        raise _no_module(path, module_name, TrainFnImportError)
    if not spec.origin or not spec.origin.endswith(".py"):
        _resolve(path, TrainFnImportError, TrainFnAttributeError)  # no source to read: import it
        return
    try:
        with open(spec.origin, "rb") as f:
            tree = ast.parse(f.read(), spec.origin)
    except SyntaxError as exc:
        raise TrainFnImportError(
            f"train_fn {path!r}: {spec.origin} line {exc.lineno}: {type(exc).__name__}: {exc.msg}"
        ) from None
    except (OSError, ValueError) as exc:
        raise TrainFnImportError(f"train_fn {path!r}: cannot read {spec.origin}: {exc}") from None
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    if fn_name not in names:
        defs = sorted(n.name for n in tree.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_"))
        raise TrainFnAttributeError(
            f"train_fn {path!r}: module {module_name!r} ({spec.origin}) has no function {fn_name!r}"
            + (f"; it defines: {', '.join(defs)}" if defs else "")
        )


def _find_source(module_name: str):
    """The module's spec, found like an import would without executing any package.

    A package already imported (the runner's own) is searched where it was loaded from.
    """
    import importlib.machinery
    import sys

    if not module_name or module_name.startswith("."):
        return None
    parts = module_name.split(".")
    search = None  # sys.path
    spec = None
    for i, part in enumerate(parts):
        name = ".".join(parts[: i + 1])
        loaded = sys.modules.get(name)
        if loaded is not None and getattr(loaded, "__spec__", None) is not None:
            spec = loaded.__spec__
        elif i == 0:  # a top-level name: finding it runs nothing (an editable install's finder too)
            import importlib.util

            try:
                spec = importlib.util.find_spec(name)
            except (ImportError, ValueError):
                spec = None
        else:
            try:
                spec = importlib.machinery.PathFinder.find_spec(name, search)
            except (ImportError, ValueError):
                spec = None
        if spec is None:
            return None
        if i < len(parts) - 1:
            search = list(spec.submodule_search_locations or [])
            if not search:
                return None
    return spec


def _no_module(path: str, module_name: str, error: type[ImportError] = ImportError) -> ImportError:
    return error(
        f"train_fn {path!r}: no module named {module_name!r} in the working directory "
        f"({os.getcwd()}) or the installed packages; check the spelling, and run raylaunch from "
        "the folder that holds the module (that folder is what every node gets)"
    )


def resolve_train_fn(path: str) -> Callable[[dict], Any]:
    """Import ``"module:function"``; errors say which part is missing and what to check.

    In a rank they are the plain ``ImportError`` and ``AttributeError`` that its failure reports.
    """
    return _resolve(path, ImportError, AttributeError)


def _resolve(path: str, import_error: type[ImportError], attribute_error: type[AttributeError]) -> Callable[[dict], Any]:
    module_name, _, fn_name = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name or module_name.startswith(f"{exc.name}."):
            raise _no_module(path, module_name, import_error) from None
        raise
    fn = getattr(module, fn_name, None)
    if fn is None or not callable(fn):
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                        and getattr(v, "__module__", None) == module.__name__)
        raise attribute_error(
            f"train_fn {path!r}: module {module_name!r} has no function {fn_name!r}"
            + (f"; it defines: {', '.join(public)}" if public else "")
        )
    return fn
