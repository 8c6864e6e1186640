"""The job spec: what the user asked for, as a frozen, typed tree (the public surface).

A spec is YAML read with ``yaml.safe_load`` (through a loader that also reads
``3e-4`` as a float, which plain YAML 1.1 leaves as a string) and checked
against its dataclasses before anything starts. Every problem is
reported at once, each with the path of the field and, for a misspelt key,
the nearest valid one::

    >>> load_spec_text("name: x\\ntrain_fn: m:f\\nscalng: {}")
    Traceback (most recent call last):
    ...
    jobs.spec.schema.SpecError: the job spec has 1 problem:
      - scalng: unknown key; did you mean 'scaling'?

The parts: the dataclass tree and its JSON Schema (``jobs.spec.schema``), the type checker
(``jobs.spec.check``), the cross-field rules (``jobs.spec.rules``), and YAML, overrides
and file reads (``jobs.spec.load``).
"""

from __future__ import annotations

from jobs.spec.load import (MAX_VALUES, apply_overrides, load_spec, load_spec_text, read_spec_dict, spec_from_dict,
                            with_overrides)
from jobs.spec.rules import run_name_problem
from jobs.spec.schema import (
    RUNNER_VARS, AccelerateSpec, CheckpointSpec, DataLoaderSpec, EnvSpec, FailureSpec, FsdpSpec, JobSpec,
    RendezvousSpec, ScalingSpec, SpecError, TimeoutSpec, json_schema, parse_port_range, spec_to_dict,
)

__all__ = [
    "MAX_VALUES",
    "RUNNER_VARS",
    "AccelerateSpec",
    "CheckpointSpec",
    "DataLoaderSpec",
    "EnvSpec",
    "FailureSpec",
    "FsdpSpec",
    "JobSpec",
    "RendezvousSpec",
    "ScalingSpec",
    "SpecError",
    "TimeoutSpec",
    "apply_overrides",
    "json_schema",
    "load_spec",
    "load_spec_text",
    "parse_port_range",
    "read_spec_dict",
    "run_name_problem",
    "spec_from_dict",
    "with_overrides",
    "spec_to_dict",
]
