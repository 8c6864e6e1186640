"""The examples in the product's docstrings hold: every module of cluster/ and jobs/, its doctests run as written
(a docstring's example is a promise a reader copies; `python -m doctest` is not how the suite runs)."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                 for folder in ("cluster", "jobs") for p in (ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("name", MODULES)
def test_the_examples_in_a_modules_docstrings_hold(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed (printed above)"


def test_the_modules_with_examples_are_among_those_run():
    ran = {name: doctest.testmod(importlib.import_module(name), verbose=False).attempted
           for name in ("jobs.driver.policy", "cluster.protocol", "jobs.run.events")}
    assert all(ran.values()), ran
    assert len(MODULES) > 60
