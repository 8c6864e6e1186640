"""Which layer imports what: the driver side needs neither torch nor Accelerate, the training
side nothing from Ray (docs/architecture.md, docs/training-function.md, CONTRIBUTING.md's conventions)."""

from __future__ import annotations

import json
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
    assert imported_after("import jobs.cli, jobs.driver, jobs.submit, jobs.runs, jobs.progress, jobs.board\n"
                          "from cluster.train_function import check_train_fn\n"
                          "check_train_fn('train_fn.digits:train')",
                          ["torch", "accelerate", "transformers"]) == []


def test_the_runtime_and_the_training_functions_import_nothing_from_ray():
    assert imported_after("import cluster.runtime, train_fn.digits", ["ray"]) == []


def test_the_spec_modules_import_each_other_without_a_circle():
    """#45: jobs/spec_*.py were a circle only because a method of JobSpec reached back into loading; every import
    between them, at the top or inside a function, now goes one way."""
    import ast

    graph: dict[str, set[str]] = {}
    for path in sorted((ROOT / "jobs").glob("spec*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jobs.spec"):
                names.add(node.module.split(".")[1])
        graph[path.stem] = names - {path.stem}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in graph.get(start, ()))

    assert len(graph) >= 5 and not [m for m in graph if reaches(m, m, {m})], graph


def test_cluster_never_imports_jobs():
    """The layering (docs/architecture.md): ``jobs`` (spec, driver, run directory) uses ``cluster`` (placement,
    node actors, ranks), never the reverse: not at the top of a module, not inside a function."""
    import ast

    back = []
    for path in sorted((ROOT / "cluster").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            back += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n.split(".")[0] == "jobs"]
    assert len(list((ROOT / "cluster").rglob("*.py"))) > 20 and back == [], back
