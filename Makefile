# make demo: create .venv, install, run the digits job on 2 local Ray nodes.
# make test: create .venv, install, run the tests.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STORAGE ?= /tmp/raylaunch-runs

.PHONY: install demo test clean bench

$(BIN)/raylaunch: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[test]'
	touch $@

install: $(BIN)/raylaunch

demo: install
	$(BIN)/raylaunch run jobs/examples/digits.yaml --local-nodes 2 --storage $(STORAGE) --fresh

test: install
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) raylaunch-local

# Benchmark against torchrun and Ray Train (quick: under two minutes; BENCH_FULL=1: the full run).
bench: install
	$(BIN)/pip install --quiet -c constraints.txt -e '.[test,bench]'
	$(BIN)/python bench/run.py
