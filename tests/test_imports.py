"""Which layer imports what: the driver side needs neither torch nor Accelerate, the training
side nothing from Ray (docs/architecture.md, docs/training-function.md, CONTRIBUTING.md's conventions)."""

from __future__ import annotations

import json
from pathlib import Path
import subprocess
import sys

from conftest import ROOT, cli_env


def imported_after(statement: str, packages: list[str]) -> list[str]:
    """The ``packages`` that a fresh interpreter has loaded once it ran ``statement``."""
    probe = (f"import sys, json\n{statement}\n"
             f"print(json.dumps(sorted(p for p in {packages!r} if p in sys.modules)))")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=cli_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_the_driver_and_the_cli_import_neither_torch_nor_accelerate():
    # and checking a train_fn (as `run` and `validate` do first) does not import its module
    assert imported_after("import jobs.cli, jobs.driver.driver, jobs.submit, jobs.runs, jobs.progress, jobs.run.board\n"
                          "from cluster.train_function import check_train_fn\n"
                          "check_train_fn('train_fn.digits:train')",
                          ["torch", "accelerate", "transformers"]) == []


def test_the_runtime_and_the_training_functions_import_nothing_from_ray():
    assert imported_after("import cluster.runtime, train_fn.digits", ["ray"]) == []


# Which folder may import what (docs/architecture.md's picture, CONTRIBUTING.md's "Where a module goes"): each
# folder's modules never import these, at the top, inside a function or under TYPE_CHECKING. ``cluster``'s own
# modules (runtime.py aside, the public face over cluster.rank) are the shared leaves every folder uses.
_RULES = [
    ("cluster", ["jobs"], "jobs (spec, driver, run directory) uses cluster, never the reverse"),
    ("cluster/*", ["ray", "torch", "cluster.nodes", "cluster.hosting", "cluster.rank", "cluster.checkpoint"],
     "the shared leaves import no folder of cluster and neither Ray nor torch"),
    ("cluster/nodes", ["torch", "accelerate", "transformers", "cluster.rank", "cluster.checkpoint", "cluster.runtime"],
     "Ray's side: node actors and placement never load the training stack"),
    ("cluster/hosting", ["ray", "cluster.nodes"], "warm hosts and fork servers run outside Ray too"),
    ("cluster/rank", ["ray", "cluster.nodes", "cluster.hosting"], "a rank never imports Ray"),
    ("cluster/checkpoint", ["ray", "cluster.nodes", "cluster.hosting", "cluster.rank", "cluster.runtime"],
     "the rank side uses checkpoints, not the other way round"),
    ("jobs", ["torch", "transformers", "accelerate", "cluster.rank", "cluster.checkpoint", "cluster.runtime"],
     "the driver and the commands never import the training stack"),
    ("jobs/run", ["jobs.driver", "jobs.spec", "jobs.cli", "jobs.submit", "jobs.runs", "jobs.progress"],
     "the run directory is read and written through jobs.run, which knows no driver, spec or command"),
    ("jobs/spec", ["ray", "jobs.driver", "jobs.run", "jobs.cli", "jobs.submit", "jobs.runs", "jobs.progress",
                   "cluster.nodes", "cluster.hosting"], "a spec is read and checked without a cluster or a run"),
    ("jobs/driver", ["jobs.cli", "jobs.submit", "jobs.runs", "jobs.progress"], "the commands use the driver"),
]
# The one exception, by name: `raylaunch launch` reads an `accelerate launch` command line with Accelerate's own
# parser, inside the functions that read it (the driver never calls them).
_ALLOWED = {("jobs/spec/launch.py", "accelerate")}


def _imports(path: Path, import_time_only: bool = False) -> list[tuple[int, str]]:
    """``(line, module)`` of every absolute import in a file; ``from a import b`` gives ``a`` and ``a.b``.
    ``import_time_only``: those run when the module is imported (not in a function, not under TYPE_CHECKING)."""
    import ast

    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if import_time_only and (isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) or (
                    isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test))):
                continue
            if isinstance(child, ast.Import):
                found.extend((child.lineno, a.name) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and not child.level and child.module:
                found.append((child.lineno, child.module))
                found.extend((child.lineno, f"{child.module}.{a.name}") for a in child.names)
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def _broken_rules(root: Path) -> list[str]:
    broken = []
    for folder, never, why in _RULES:
        leaves = folder.endswith("/*")
        files = (sorted(p for p in (root / folder[:-2]).glob("*.py") if p.name != "runtime.py") if leaves
                 else sorted((root / folder).rglob("*.py")))
        assert files, f"{folder}: no modules (a folder was renamed; mend _RULES)"
        for path in files:
            rel = str(path.relative_to(root))
            for line, module in _imports(path):
                top = module.split(".")[0]
                if (rel, top) not in _ALLOWED and any(module == n or module.startswith(n + ".") for n in never):
                    broken.append(f"{rel}:{line} imports {module}: {why}")
    return broken


def test_each_folder_imports_only_what_its_rule_allows():
    assert _broken_rules(ROOT) == []


def test_a_module_that_breaks_a_folder_rule_is_named(tmp_path):
    """The rules read what they should: a copy of the tree with a rank module that imports Ray, and a driver
    module that imports a command inside a function, is caught at both."""
    import shutil

    for part in ("cluster", "jobs"):
        shutil.copytree(ROOT / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "cluster" / "rank" / "probe.py").write_text("import ray.util\n")
    (tmp_path / "jobs" / "driver" / "probe.py").write_text("def f():\n    from jobs import submit\n")
    assert _broken_rules(tmp_path) == [
        "cluster/rank/probe.py:1 imports ray.util: a rank never imports Ray",
        "jobs/driver/probe.py:2 imports jobs.submit: the commands use the driver"]


def test_no_two_modules_import_each_other():
    """No circle among the modules of cluster/ and jobs/ through the imports that run when a module is imported
    (jobs/spec_*.py were one, #45)."""
    modules = {}
    for path in [*(ROOT / "cluster").rglob("*.py"), *(ROOT / "jobs").rglob("*.py")]:
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    graph = {m: {i for _, i in _imports(p, import_time_only=True) if i in modules and i != m}
             for m, p in modules.items()}

    def circle(start: str) -> list[str] | None:
        stack = [[start]]
        while stack:
            path = stack.pop()
            for n in graph[path[-1]]:
                if n == start:
                    return path
                if n not in path:
                    stack.append([*path, n])
        return None

    assert len(modules) > 60 and [c for m in modules if (c := circle(m))] == []
