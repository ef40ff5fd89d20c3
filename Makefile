# gpuwarden task runner. `make demo` and `make test` do all set-up on a fresh Linux machine
# with Docker (root is needed once, to build the cluster image with debootstrap).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: all venv image cluster-up cluster-down demo test unit e2e lint bench clean

all: test

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

image: $(STAMP)
	$(PY) -m gpuwarden.devcluster image

cluster-up: $(STAMP)
	$(PY) -m gpuwarden.devcluster up

cluster-down: $(STAMP)
	$(PY) -m gpuwarden.devcluster down

demo: $(STAMP)
	$(PY) -m gpuwarden.devcluster up
	$(PY) -m gpuwarden.devcluster demo

lint: $(STAMP)
	$(PY) -m ruff check gpuwarden tests benchmarks
	$(PY) -m mypy

unit: $(STAMP)
	$(PY) -m pytest tests/unit -q

e2e: $(STAMP)
	$(PY) -m pytest tests/e2e -q -m e2e

test: lint $(STAMP)
	$(PY) -m pytest tests -q

bench: $(STAMP)
	$(PY) benchmarks/slurm_parse.py
	$(PY) benchmarks/prolog_latency.py
	$(PY) benchmarks/prolog_local.py
	$(PY) benchmarks/drain_calls.py
	$(PY) benchmarks/lemon_detection.py
	$(PY) benchmarks/lemon_scale.py
	$(PY) benchmarks/placement_lua.py
	$(PY) benchmarks/placement_quality.py
	$(PY) benchmarks/placement_submit.py
	@# Exits 1 while the restore goal (>= 13x vs S3) is not met against the local S3 server.
	-$(PY) benchmarks/ckpt_tiers.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
