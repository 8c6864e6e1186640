"""The job's environment (`env.vars`, `env.secrets`, `env.pip`) on a real two-node Ray cluster."""

from __future__ import annotations

import hashlib
import io
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, cli_env
from jobs.driver.driver import Driver
from jobs.spec import SpecError, load_spec_text
from jobs.spec.environment import runner_versions, with_runner_pins

SECRET_NAME = "RAYLAUNCH_TEST_HF_TOKEN"
SPEC = """
name: {name}
train_fn: tests.fns:env_probe
config: {{var: WANDB_PROJECT, secret: {secret}, package: {package}}}
scaling: {{num_nodes: 2, workers_per_node: 1}}
storage: {storage}
env: {{vars: {{WANDB_PROJECT: raylaunch-demo}}, secrets: [{secret}], pip: {pip}}}
"""


def _spec(tmp_path: Path, name: str, package: str = "null", pip: str = "[]", nodes: int = 2) -> str:
    text = SPEC.format(name=name, secret=SECRET_NAME, package=package, pip=pip, storage=tmp_path / "runs")
    return text.replace("num_nodes: 2, workers_per_node: 1", f"num_nodes: {nodes}, workers_per_node: {3 - nodes}")


def _files_holding(root: Path, needle: str) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and needle.encode() in p.read_bytes()]


def raylaunch(*args: str, env: dict, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jobs.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_a_variable_and_a_secret_reach_every_rank_and_the_secret_is_written_nowhere(
        ray_cluster, tmp_path, monkeypatch):
    value = f"hf_{secrets.token_hex(12)}"
    monkeypatch.setenv(SECRET_NAME, value)
    out = io.StringIO()
    result = Driver(load_spec_text(_spec(tmp_path, "env")), can_grow=False, out=out).run()
    assert result.status == "succeeded", result.error
    for rank, seen in result.rank_results.items():
        assert seen["var"] == "raylaunch-demo", (rank, seen)
        assert seen["secret_sha256"] == hashlib.sha256(value.encode()).hexdigest(), rank
    assert sorted(seen["rank_env"] for seen in result.rank_results.values()) == ["0", "1"]
    printed = out.getvalue()
    assert "[node 0 rank 0] the secret is ***" in printed and "[node 1 rank 1] the secret is ***" in printed
    assert value not in printed
    run_dir = tmp_path / "runs" / "env"
    assert (run_dir / "logs").is_dir() and (run_dir / "spec.yaml").exists()
    assert not _files_holding(run_dir, value)  # logs, spec.yaml, result.json, metrics, TensorBoard
    assert SECRET_NAME in (run_dir / "spec.yaml").read_text()  # its name is part of the spec


def test_validate_names_the_environment_and_refuses_a_runner_variable(tmp_path):
    value = f"hf_{secrets.token_hex(12)}"
    spec = tmp_path / "job.yaml"
    spec.write_text(_spec(tmp_path, "env-validate"))
    env = {**cli_env(), SECRET_NAME: value}
    ok = raylaunch("validate", str(spec), "--set", "env.vars.NCCL_DEBUG=INFO", env=env)
    assert ok.returncode == 0, ok.stderr
    assert f"environment: vars WANDB_PROJECT, NCCL_DEBUG; secrets {SECRET_NAME} (set in this shell)" in ok.stdout
    assert value not in ok.stdout + ok.stderr
    bad = raylaunch("validate", str(spec), "--set", "env.vars.RANK=3", env=env)
    assert bad.returncode == 2
    assert "env.vars: RANK is set by raylaunch for every rank and cannot be overridden" in bad.stderr


def test_an_unset_secret_stops_the_run_before_anything_starts(tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text(_spec(tmp_path, "env-unset"))
    env = cli_env()
    env.pop(SECRET_NAME, None)
    proc = raylaunch("run", str(spec), "--local-nodes", "1", env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"env.secrets: {SECRET_NAME} is not set (or empty) where the job is launched" in proc.stderr
    assert not (tmp_path / "runs").exists()


def test_a_package_in_env_pip_is_installed_for_the_job_and_a_misspelt_or_torch_replacing_one_fails_first(
        ray_cluster, tmp_path, monkeypatch):
    """`humanize` is not in the project's environment; Ray installs it for the job on each node.

    One node with two ranks: the simulated nodes of this machine share one Ray session folder, where
    two nodes building the same package environment at once collide (real nodes have their own)."""
    monkeypatch.setenv(SECRET_NAME, "unused-here")
    result = Driver(load_spec_text(_spec(tmp_path, "pip", package="humanize", pip="[humanize]", nodes=1)),
                    can_grow=False, out=io.StringIO()).run()
    assert result.status == "succeeded", result.error
    assert len(result.rank_results) == 2
    for seen in result.rank_results.values():
        assert "site-packages/humanize" in seen["package_file"] and str(ROOT / ".venv") not in seen["package_file"]

    out = io.StringIO()
    bad = Driver(load_spec_text(_spec(tmp_path, "pip-bad", pip="[raylaunch-no-such-package-xyz]", nodes=1)),
                 can_grow=False, out=out)
    with pytest.raises(SpecError) as refused:
        bad.run()
    assert "env.pip: ['raylaunch-no-such-package-xyz'] cannot be installed" in str(refused.value)
    assert "No matching distribution found for raylaunch-no-such-package-xyz" in str(refused.value)
    assert not (tmp_path / "runs" / "pip-bad").exists()  # nothing started, nothing written

    # A package that needs another torch would install a second one over the nodes' own: refused,
    # naming the version kept and how to choose another.
    versions = runner_versions()
    torch_pin = f"torch=={versions['torch']}"
    assert "+" not in torch_pin  # the public version: a node's +cu121 build and a +cpu one both satisfy it
    other = Driver(load_spec_text(_spec(tmp_path, "pip-torch", pip="[torchvision==0.20.0]", nodes=1)),
                   can_grow=False, out=io.StringIO())
    with pytest.raises(SpecError) as refused:
        other.run()
    assert f"Cannot install {torch_pin} and torchvision==0.20.0" in str(refused.value)
    assert f"installed with {torch_pin} kept" in str(refused.value) and "name one in env.pip" in str(refused.value)
    assert not (tmp_path / "runs" / "pip-torch").exists()


UNBUILDABLE_BACKEND = '''"""A build backend whose metadata is fine (pip resolves it) and whose wheel never builds."""
import os


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    info = os.path.join(metadata_directory, "raylaunch_unbuildable-1.0.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\\nName: raylaunch-unbuildable\\nVersion: 1.0\\n")
    return "raylaunch_unbuildable-1.0.dist-info"


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    raise RuntimeError("raylaunch-unbuildable does not build on this node")
'''


def test_a_node_that_cannot_install_env_pip_fails_the_run_before_any_rank_starts_naming_the_node(
        ray_cluster, tmp_path, monkeypatch):
    """A package that resolves where the job is launched (pip's check passes) but does not build on
    the node: the run fails before any rank starts, naming the node and what pip said."""
    package = tmp_path / "unbuildable"
    package.mkdir()
    (package / "pyproject.toml").write_text('[build-system]\nrequires = []\nbuild-backend = "backend"\n'
                                            'backend-path = ["."]\n\n[project]\nname = "raylaunch-unbuildable"\n'
                                            'version = "1.0"\n')
    (package / "backend.py").write_text(UNBUILDABLE_BACKEND)
    monkeypatch.setenv(SECRET_NAME, "unused-here")
    out = io.StringIO()
    result = Driver(load_spec_text(_spec(tmp_path, "pip-node", pip=f"['{package}']", nodes=1)), can_grow=False,
                    out=out).run()
    assert result.status == "failed", result.error
    assert result.error.startswith(f"env.pip: the job's packages ['{package}'") and \
        "could not be installed before any rank started: node 0 (" in result.error, result.error
    assert "ERROR: Failed building wheel for raylaunch-unbuildable" in result.error, result.error  # pip's words
    assert result.attempts == 0 and result.rank_results == {}  # no attempt began: no rank ever started
    assert not list((tmp_path / "runs" / "pip-node" / "logs").iterdir())


def test_env_pip_pins_torch_and_accelerate_unless_the_requirements_choose_them():
    v = {"torch": "2.13.0", "accelerate": "1.15.0"}
    pins = ["torch==2.13.0", "accelerate==1.15.0"]
    assert with_runner_pins(["humanize"], v) == ["humanize", *pins]
    assert with_runner_pins([], v) == []
    index = "--extra-index-url https://example.org/simple"
    assert with_runner_pins(["Torch>=2", index], v) == ["Torch>=2", index, "accelerate==1.15.0"]
    assert with_runner_pins(["accelerate[deepspeed]"], v) == ["accelerate[deepspeed]", "torch==2.13.0"]
    # a URL, a wheel or an editable names the package too; another requirements file may: pin nothing
    for line in ["git+https://github.com/huggingface/accelerate", "-e ./vendor/accelerate"]:
        assert with_runner_pins([line], v) == [line, "torch==2.13.0"]
    assert with_runner_pins(["./wheels/torch-2.4.0-cp311-cp311-linux_x86_64.whl"], v)[-1] == "accelerate==1.15.0"
    assert with_runner_pins(["humanize", "-r more.txt"], v) == ["humanize", "-r more.txt"]
    # a requirement whose marker is false on the nodes chooses nothing there
    never = 'torch==2.4; python_version < "3"'
    assert with_runner_pins([never], v) == [never, *pins]
