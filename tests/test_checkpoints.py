"""Checkpoints that lose nothing: a full disk, a crash mid-save, a tampered file, pickles.

The runs use the shared multi-node Ray cluster; the rank-side checks run a rank's
session in this process, as the worker entry point would.
"""

from __future__ import annotations

import ast
import io
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from cluster.runtime import CheckpointError
from conftest import LoadsRecorded, rank_session
from jobs.driver.driver import Driver
from jobs.run.storage import RunDir
from jobs.spec import load_spec_text

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs, mounted for this test and unmounted after it."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_fails_the_save_and_keeps_the_previous_checkpoint(ray_cluster, tmp_path, small_disk):
    # A model of 300k parameters: one checkpoint (1.2 MB) fits on the 2 MiB disk, a second does not.
    spec = load_spec_text(f"""
name: full
train_fn: fns:steady
config: {{steps: 30, every: 10, step_s: 0.02, hidden: 30000, lr: 1.0e-4, pid_dir: {tmp_path / 'pids'}}}
scaling: {{num_nodes: 2, workers_per_node: 1}}
failure: {{max_restarts: 0}}
checkpoint: {{keep: 1}}
storage: {small_disk}
""")
    result = Driver(spec, can_grow=False).run()
    assert result.status == "failed"
    staged = small_disk / "full" / ".staging" / "attempt-1" / "checkpoint-00000020"
    assert re.search(rf"CheckpointSaveError: no space left on the device holding {re.escape(str(staged))}: "
                     "the checkpoint of step 20 was not written", result.error), result.error
    assert "The previous committed checkpoint is kept" in result.error
    checkpoints = small_disk / "full" / "checkpoints"
    assert json.loads((checkpoints / "latest.json").read_text()) == {"name": "checkpoint-00000010", "step": 10}
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint-00000010", "latest.json"]
    run = RunDir(str(small_disk), "full")
    assert run.checkpoints.loadable().step == 10  # every file matches its manifest
    manifest = json.loads((checkpoints / "checkpoint-00000010" / "manifest.json").read_text())
    assert "model.safetensors" in manifest["files"] and not any(f.startswith("pytorch_model") for f in manifest["files"])
    # the half-written part is gone, and the result could be written
    assert not any((small_disk / "full" / ".staging").rglob("*"))
    assert json.loads((small_disk / "full" / "result.json").read_text())["status"] == "failed"


def test_the_next_attempt_clears_what_a_crash_left_in_staging(ray_cluster, tmp_path):
    note = tmp_path / "litter-path"
    spec = load_spec_text(f"name: litter\ntrain_fn: fns:litter_then_fail\nscaling: {{num_nodes: 2}}\n"
                          f"config: {{note: {note}}}\nfailure: {{max_restarts: 1}}\nstorage: {tmp_path}\n")
    result = Driver(spec, can_grow=False).run()
    assert result.status == "succeeded" and result.attempts == 2, result.error
    # what attempt 1 left, where its session told it to stage, inside this run's directory
    litter = Path(note.read_text())
    assert litter.is_relative_to(tmp_path / "litter") and "checkpoints" not in litter.parts
    assert result.rank_results["0"]["earlier_staging_left"] is False
    assert result.rank_results["1"]["earlier_staging_left"] is False
    assert not litter.exists() and not any((tmp_path / "litter").rglob("random_states_*.pkl"))
    assert not (tmp_path / "litter" / "checkpoints" / "latest.json").exists()  # nothing was ever committed


def test_a_rerun_falls_back_from_an_altered_checkpoint_and_fails_on_a_missing_one(ray_cluster, tmp_path):
    def run(steps: int, keep: int = 2):  # another keep: another spec (the same one that succeeded starts nothing)
        spec = load_spec_text(f"name: fall\ntrain_fn: fns:steady\nscaling: {{num_nodes: 2}}\nstorage: {tmp_path}\n"
                              f"config: {{steps: {steps}, every: 10, step_s: 0.02, pid_dir: {tmp_path / 'pids'}}}\n"
                              f"checkpoint: {{keep: {keep}}}\n")
        out = io.StringIO()
        return Driver(spec, can_grow=False, out=out).run(), out.getvalue()

    first, _ = run(20)
    assert first.status == "succeeded", first.error
    checkpoints = tmp_path / "fall" / "checkpoints"
    weights = checkpoints / "checkpoint-00000020" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of the latest checkpoint's weights flipped on storage
    weights.write_bytes(bytes(data))
    again, said = run(20, keep=3)
    assert again.status == "succeeded", again.error
    altered = checkpoints / "checkpoint-00000020"
    assert f"raylaunch: not loading {altered}: {altered}/model.safetensors does not match the checksum" in said
    assert f"attempt 2: resuming from {checkpoints}/checkpoint-00000010 (step 10)" in said
    assert again.rank_results["0"]["restored_step"] == 10 and again.rank_results["0"]["steps"] == 20
    # a latest.json that names a checkpoint that is gone: an error, never a silent start from scratch
    shutil.rmtree(checkpoints / "checkpoint-00000020")
    third, _ = run(30)
    assert third.status == "failed" and third.attempts == 3
    assert "names checkpoint-00000020, which is not a committed checkpoint" in third.error
    assert "--fresh" in third.error
    rows = [json.loads(line) for line in (tmp_path / "fall" / "metrics.jsonl").read_text().splitlines()]
    assert {r["attempt"] for r in rows} == {1, 2}  # attempt 3 trained nothing


def _committed(tmp_path: Path, name: str):
    run = RunDir(str(tmp_path), name)
    run.prepare({"name": name})
    staged = Path(run.staging_uri(1)) / "checkpoint-00000005"
    staged.mkdir(parents=True)
    (staged / "model.safetensors").write_bytes(b"weights")
    (staged / "random_states_0.pkl").write_bytes(b"rng 0")
    return run, run.checkpoints.commit(str(staged), 5, 1, world_size=1, keep=2)


def test_a_rank_loads_nothing_from_a_file_altered_after_the_driver_checked_it(tmp_path):
    run, c = _committed(tmp_path, "r")
    run.checkpoints.verify(c)  # what the driver checked before it started the attempt
    accelerator = LoadsRecorded()
    assert rank_session(tmp_path, run, c.uri).restore(accelerator) == 5
    assert [path for path, _ in accelerator.loaded] == [c.uri]
    (Path(c.uri) / "random_states_0.pkl").write_bytes(b"rng 9")  # a pickle swapped in afterwards
    with pytest.raises(CheckpointError, match=r"checkpoint-00000005/random_states_0.pkl does not match the checksum"):
        rank_session(tmp_path, run, c.uri).restore(accelerator)
    assert len(accelerator.loaded) == 1  # nothing unpickled from it


def test_a_rank_refuses_a_checkpoint_of_another_run(tmp_path):
    run, _ = _committed(tmp_path, "mine")
    _, theirs = _committed(tmp_path, "theirs")
    with pytest.raises(CheckpointError, match="is not a committed checkpoint of this run"):
        rank_session(tmp_path, run, theirs.uri).restore(LoadsRecorded())


_BLOCKS = ("body", "orelse", "finalbody", "handlers")


def _loading_calls(tree: ast.AST) -> list[tuple[ast.Call, list[ast.stmt], int, list[str]]]:
    """Every call that unpickles or loads a checkpoint (``torch.load``, ``pickle.load(s)``,
    Accelerate's ``load_state``), with the block it sits in, its index there and the
    conditions of the ``if`` statements around it."""
    found = []

    def own_parts(stmt: ast.stmt) -> list[ast.AST]:
        """``stmt`` without its nested blocks (their calls belong to them)."""
        return [v for k, v in ast.iter_fields(stmt) if k not in _BLOCKS and isinstance(v, (ast.AST, list))]

    def visit(block: list, conditions: list[str]) -> None:
        for i, stmt in enumerate(block):
            if isinstance(stmt, ast.ExceptHandler):
                visit(stmt.body, conditions)
                continue
            for part in own_parts(stmt):
                for node in (n for n in (part if isinstance(part, list) else [part]) if isinstance(n, ast.AST)):
                    for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
                        func = ast.unparse(call.func)
                        if func in ("torch.load", "pickle.load", "pickle.loads") or func.endswith(".load_state"):
                            found.append((call, block, i, conditions))
            for name in _BLOCKS:
                inner = conditions + [ast.unparse(stmt.test)] if isinstance(stmt, ast.If) and name == "body" \
                    else conditions
                if isinstance(stmt, ast.With) and name == "body":
                    inner = conditions + [f"with {', '.join(ast.unparse(item) for item in stmt.items)}"]
                visit(getattr(stmt, name, None) or [], inner)

    visit(tree.body, [])
    return found


def test_every_load_of_a_checkpoint_under_the_runner_follows_its_checksum_check():
    """Accelerate's ``load_state`` unpickles (``weights_only=False``): under the runner it may
    only run right after ``check_manifest`` in the same block; a ``torch.load`` must be
    ``weights_only=True`` and nothing calls pickle itself."""
    loads = []
    # An accelerate-launch script has no line of raylaunch: the folder it loads under the runner is the copy
    # cluster.checkpoint.restore.node_copy made inside node_verified, of a checkpoint that check_manifest passed.
    scripts = {ROOT / "train_fn" / "digits_script.py"}
    node_copy = ast.unparse(next(n for n in ast.walk(ast.parse((ROOT / "cluster" / "checkpoint" / "restore.py").read_text()))
                                 if isinstance(n, ast.FunctionDef) and n.name == "node_copy"))
    assert "with node_verified(" in node_copy and "copytree(ready" in node_copy
    for folder in ("cluster", "jobs", "train_fn", "bench"):
        for path in sorted(set((ROOT / folder).rglob("*.py")) - scripts):
            for call, block, i, tests in _loading_calls(ast.parse(path.read_text())):
                where = f"{path.relative_to(ROOT)}:{call.lineno}"
                func = ast.unparse(call.func)
                loads.append(func)
                if func.startswith("pickle."):
                    raise AssertionError(f"{where}: {func} unpickles without a check")
                if func.startswith("torch."):
                    assert any(k.arg == "weights_only" and ast.unparse(k.value) == "True" for k in call.keywords), \
                        f"{where}: torch.load without weights_only=True"
                    continue
                outside_runner = "self.payload is None" in tests
                checked = i > 0 and "check_manifest(" in ast.unparse(block[i - 1])
                # or inside cluster.checkpoint.restore.node_verified, which yields only what check_manifest passed
                in_verified = any(t.startswith("with ") and "node_verified(" in t for t in tests)
                assert outside_runner or checked or in_verified, \
                    f"{where}: {func} without check_manifest just before it"
    # the scan sees the loads there are: one outside the runner, one verified once per node
    assert loads.count("accelerator.load_state") == 2, loads
    verified = ast.parse((ROOT / "cluster" / "checkpoint" / "restore.py").read_text())
    fn = next(n for n in verified.body if isinstance(n, ast.FunctionDef) and n.name == "node_verified")
    body = ast.unparse(fn)
    assert body.index("check_manifest(") < body.index("yield"), "node_verified yields before it checks"


@pytest.mark.parametrize("saved, accumulation, after", [
    (4, 1, 4), (6, 2, 6),  # the accumulation it was saved with: left as it is
    (2, 3, 0), (3, 2, 2), (7, 4, 4),  # another one: the next `accumulation` micro-batches are one step
])
def test_a_resume_at_another_accumulation_counts_micro_batches_from_the_checkpoint(saved, accumulation, after):
    from types import SimpleNamespace

    from cluster.checkpoint.staged import align_accumulation

    accelerator = SimpleNamespace(step=saved, gradient_accumulation_steps=accumulation)
    align_accumulation(accelerator)
    assert accelerator.step == after and accelerator.step % accumulation == 0
