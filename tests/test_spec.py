"""Spec parsing: pure, no processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from jobs.spec import JobSpec, SpecError, load_spec, load_spec_text, spec_to_dict, with_overrides

ROOT = Path(__file__).resolve().parent.parent
MINIMAL = "name: t\ntrain_fn: train_fn.digits:train\n"


def problems(text: str, overrides=None) -> list[str]:
    with pytest.raises(SpecError) as info:
        load_spec_text(text, overrides)
    return info.value.problems


def test_example_spec_loads_with_its_values():
    spec = load_spec(ROOT / "jobs/examples/digits.yaml")
    assert isinstance(spec, JobSpec)
    assert spec.scaling.num_nodes == 2 and spec.scaling.workers_per_node == 1
    assert spec.config["lr"] == 2e-3  # YAML 1.1 would leave "2e-3" a string
    assert spec.accelerate.dataloader.even_batches is True


def test_defaults_fill_what_is_left_out():
    spec = load_spec_text(MINIMAL)
    assert spec.scaling.num_nodes == 1 and spec.scaling.use_gpu == "auto"
    assert spec.failure.max_restarts == 0 and spec.checkpoint.keep == 2


def test_every_default_is_the_documented_one():
    """Every key left out, at every level: a changed default or a new key fails here, naming it."""
    assert spec_to_dict(load_spec_text(MINIMAL)) == {
        "name": "t", "train_fn": "train_fn.digits:train", "config": {},
        "script": None, "args": [], "resume_arg": "--resume_from_checkpoint",
        "scaling": {"num_nodes": 1, "workers_per_node": 1, "use_gpu": "auto", "cpus_per_worker": 1.0,
                    "min_nodes": None, "keep_global_batch": True},
        "accelerate": {"mixed_precision": "no", "gradient_accumulation_steps": 1,
                       "dataloader": {"even_batches": True, "use_seedable_sampler": True, "split_batches": False,
                                      "dispatch_batches": "auto", "use_stateful_dataloader": False},
                       "fsdp": None, "config_file": None},
        "storage": "~/raylaunch-runs",
        "checkpoint": {"keep": 2, "async": True, "every": None, "mtbf_s": 86400.0,
                       "snapshots": {"every": "auto", "memory_mb": "auto"}},
        "failure": {"max_restarts": 0, "max_infra_restarts": 3, "max_preemptions": 10},
        "timeouts": {"placement_s": 120.0, "rendezvous_s": 300.0, "heartbeat_s": 60.0, "collective_s": 600.0,
                     "resize_s": 30.0},
        "rendezvous": {"ports": "any", "socket_ifname": "auto"},
        "env": {"vars": {}, "secrets": [], "pip": [], "warm_host": True, "warm_host_idle_s": 600.0},
    }
    # `fsdp: {}` asks for FSDP with every one of its own defaults
    assert spec_to_dict(load_spec_text(MINIMAL + "accelerate: {fsdp: {}}\n"))["accelerate"]["fsdp"] == {
        "version": 2, "reshard_after_forward": True, "state_dict_type": "sharded",
        "transformer_layer_cls_to_wrap": None, "min_num_params": None, "activation_checkpointing": False,
        "cpu_ram_efficient_loading": False, "offload_params": False}


def test_misspelt_key_names_path_and_nearest_key():
    assert problems(MINIMAL + "scaling:\n  num_node: 2\n") == [
        "scaling.num_node: unknown key; did you mean 'num_nodes'?"
    ]
    assert problems(MINIMAL + "scalng: {}\n") == ["scalng: unknown key; did you mean 'scaling'?"]


def test_wrong_types_name_the_field_and_what_was_given():
    got = problems(MINIMAL + "scaling:\n  num_nodes: two\n  workers_per_node: many\n")
    assert got == [
        "scaling.num_nodes: expected an integer, got a string 'two'",
        "scaling.workers_per_node: expected an integer or 'auto', got a string 'many'",
    ]


def test_impossible_values_are_rejected_with_the_fix():
    got = problems(MINIMAL + "scaling: {num_nodes: 0}\ncheckpoint: {keep: 0}\n")
    assert "scaling.num_nodes: must be at least 1, got 0" in got
    assert any(p.startswith("checkpoint.keep: must be at least 1") for p in got)
    assert problems("name: t\ntrain_fn: digits.train\n")[0].startswith(
        "train_fn: 'digits.train' must be 'module:function'"
    )


def test_missing_required_keys():
    assert problems("train_fn: a:b\n") == ["name: required, but missing"]


def test_yaml_that_does_not_parse():
    got = problems("name: [unclosed\n")
    assert got[0].startswith("not valid YAML")


def test_overrides_keep_types_and_reject_unknown_paths():
    spec = load_spec_text(MINIMAL, ["scaling.num_nodes=4", "config.lr=3e-4", "scaling.workers_per_node=auto"])
    assert spec.scaling.num_nodes == 4 and spec.config["lr"] == 3e-4
    assert spec.scaling.workers_per_node == "auto"
    assert problems(MINIMAL, ["scaling.num_nods=4"]) == ["scaling.num_nods: unknown key; did you mean 'num_nodes'?"]
    assert problems(MINIMAL, ["scaling"])[0].startswith("--set 'scaling': expected KEY=VALUE")


def test_spec_round_trips_through_overrides():
    spec = load_spec_text(MINIMAL)
    assert with_overrides(spec, ["name=other"]).name == "other"
    assert with_overrides(spec, []) == spec


def test_rendezvous_port_range_is_read_as_written():
    spec = load_spec_text(MINIMAL + "rendezvous:\n  ports: 29400-29499\n")
    assert spec.rendezvous.ports == "29400-29499" and spec.rendezvous.port_range == (29400, 29499)
    assert load_spec_text(MINIMAL + "rendezvous: {ports: 29400}\n").rendezvous.port_range == (29400, 29400)
    assert load_spec_text(MINIMAL).rendezvous.port_range is None  # "any": the system picks
    assert load_spec_text(MINIMAL, ["rendezvous.ports=30000-30010"]).rendezvous.port_range == (30000, 30010)


@pytest.mark.parametrize("value", ["29499-29400", "0-10", "29400-70000", "294OO", "29400:29499", "''"])
def test_bad_port_ranges_name_the_key_and_the_format(value):
    got = problems(MINIMAL + f"rendezvous: {{ports: {value}}}\n")
    assert len(got) == 1 and got[0].startswith("rendezvous.ports: ")
    assert "29400-29499" in got[0]  # the example of what to write


def test_socket_interface_defaults_to_auto_and_takes_a_name():
    assert load_spec_text(MINIMAL).rendezvous.socket_ifname == "auto"
    assert load_spec_text(MINIMAL, ["rendezvous.socket_ifname=eth1"]).rendezvous.socket_ifname == "eth1"
    assert problems(MINIMAL + "rendezvous: {socket_ifnam: eth1}\n") == [
        "rendezvous.socket_ifnam: unknown key; did you mean 'socket_ifname'?"
    ]


def test_an_elastic_spec_reads_min_nodes_and_its_bounds():
    plain = load_spec_text(MINIMAL + "scaling: {num_nodes: 3}\n")
    assert plain.scaling.min_nodes is None and plain.scaling.elastic_min == 3  # not elastic
    assert plain.scaling.keep_global_batch is True and plain.timeouts.resize_s == 30.0
    spec = load_spec_text(MINIMAL + "scaling: {num_nodes: 3, min_nodes: 2, keep_global_batch: false}\n"
                          "timeouts: {resize_s: 5}\n")
    assert spec.scaling.elastic_min == 2 and spec.scaling.keep_global_batch is False
    assert spec.timeouts.resize_s == 5.0
    assert with_overrides(spec, ["scaling.min_nodes=1"]).scaling.min_nodes == 1


def test_min_nodes_beyond_num_nodes_or_below_one_is_refused_with_the_fix():
    assert problems(MINIMAL + "scaling: {num_nodes: 2, min_nodes: 3}\n") == [
        "scaling.min_nodes: 3 is more than scaling.num_nodes (2); set it to at most 2 (--set scaling.min_nodes=2)"]
    assert problems(MINIMAL + "scaling: {num_nodes: 2, min_nodes: 0}\n") == [
        "scaling.min_nodes: must be at least 1, got 0"]
    assert problems(MINIMAL + "scaling: {min_nodes: two}\n") == [
        "scaling.min_nodes: expected an integer or null (unset), got a string 'two'"]


def test_an_unquoted_no_is_the_mixed_precision_no_in_a_file_and_in_set():
    """YAML reads a bare `no` as false; `mixed_precision: no` means the string "no"."""
    assert load_spec_text("name: p\ntrain_fn: m:f\naccelerate: {mixed_precision: no}\n").accelerate.mixed_precision == "no"
    spec = load_spec_text("name: p\ntrain_fn: m:f\naccelerate: {mixed_precision: bf16}\n", ["accelerate.mixed_precision=no"])
    assert spec.accelerate.mixed_precision == "no"
    with pytest.raises(SpecError, match="accelerate.mixed_precision"):
        load_spec_text("name: p\ntrain_fn: m:f\naccelerate: {mixed_precision: true}\n")


def test_a_job_runs_exactly_one_of_a_train_fn_and_a_script():
    both = problems("name: t\ntrain_fn: m:f\nscript: train.py\n")
    neither = problems("name: t\n")
    assert both == neither and "give exactly one" in both[0]
    assert problems("name: t\nscript: train.sh\n") == ["script: 'train.sh' must be a Python file ending in .py, "
                                                          "e.g. train.py"]
    assert "inside the working directory" in problems("name: t\nscript: ../x.py\n")[0]
    assert "a train_fn gets config instead" in problems("name: t\ntrain_fn: m:f\nargs: [--lr, '3']\n")[0]
    assert "must be an option" in problems("name: t\nscript: t.py\nresume_arg: resume\n")[0]
    spec = load_spec_text("name: t\nscript: src/train.py\nargs: ['--lr', '3e-4']\nresume_arg: null\n")
    assert (spec.script, spec.args, spec.resume_arg, spec.train_fn) == ("src/train.py", ["--lr", "3e-4"], None, None)


def test_raylaunch_schema_prints_the_shipped_schema(capsys):
    """`raylaunch schema` prints jobs/spec.schema.json as shipped: regenerate it with
    `raylaunch schema > jobs/spec.schema.json` after changing the spec."""
    from jobs.cli import main

    assert main(["schema"]) == 0
    printed = capsys.readouterr().out
    assert printed == (ROOT / "jobs/spec.schema.json").read_text()
    schema = json.loads(printed)
    assert schema["properties"]["scaling"]["properties"]["num_nodes"] == {
        "type": "integer", "minimum": 1, "maximum": 10000, "default": 1}
    assert schema["properties"]["checkpoint"]["properties"]["async"]["default"] is True  # the key as spelt
    assert schema["required"] == ["name"] and schema["additionalProperties"] is False


@pytest.mark.parametrize("example", sorted((ROOT / "jobs/examples").glob("*.yaml")), ids=lambda p: p.name)
def test_example_specs_name_the_schema_and_pass_it(example):
    """Editors with the YAML language server check a spec as it is typed, from its first line."""
    jsonschema = pytest.importorskip("jsonschema")
    first = example.read_text().splitlines()[0]
    assert first == "# yaml-language-server: $schema=../spec.schema.json"
    schema = json.loads((example.parent / "../spec.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    assert not list(validator.iter_errors(spec_to_dict(load_spec(example))))
    raw = yaml.safe_load(example.read_text())
    assert not list(validator.iter_errors(raw))
    # what the spec's own checks refuse, the schema refuses too
    for bad in ({"scaling": {"num_nodez": 2}}, {"scaling": {"num_nodes": 0}}, {"scaling": {"workers_per_node": "all"}},
                {"timeouts": {"placement_s": 0}}, {"accelerate": {"mixed_precision": "fp8"}}):
        assert list(validator.iter_errors({**raw, **bad})), bad


def test_env_pip_names_a_requirements_file_that_exists_where_the_spec_is_loaded(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert problems(MINIMAL + "env: {pip: requirements.txt}\n") == [
        "env.pip: 'requirements.txt' is not a requirements file in the working directory; give a list of "
        "requirements or the file's path relative to the project folder"]
    (tmp_path / "requirements.txt").write_text("humanize==4.9.0  # pinned\n\n")
    spec = load_spec_text(MINIMAL + "env: {pip: requirements.txt}\n")
    assert spec.env.requirements == ["humanize==4.9.0"]
    assert problems(MINIMAL + "env: {pip: ['']}\n") == [
        "env.pip: empty requirement; write each as it goes to pip, e.g. 'humanize==4.9.0'"]
