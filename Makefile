# plait: `make run` trains the built-in default job, `make test` runs the whole suite.
# Both create .venv if missing and install plait into it, torch first (override with TORCH=...).
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.plait-installed
DEVSTAMP := $(VENV)/.plait-dev-installed

.PHONY: run test bench lint clean extras

# `make run` installs the core and what the default job needs; `make test` adds the dev extra (Ray, onnxruntime,
# peft, ... : what the tests use), once, on top.
# tools/install.py is `pip install` done by uv (same packages, several times faster: ~10 s for torch, plait and the dev
# extra from a warm cache against pip's ~110 s on 2 cores), with pip's configuration carried over; pip where uv cannot
# be had (PLAIT_INSTALL_WITH_PIP=1: pip always).
INSTALL := $(BIN)/python tools/install.py

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(INSTALL) "$(TORCH)"
	$(INSTALL) -e .
	@echo "$(TORCH)" > $(STAMP)

# LitData pulls torchvision, whose PyPI wheel is built for the CUDA torch: next to a CPU torch its operators do not
# load and importing transformers (peft's tests) fails. plait does not use torchvision: such a broken one is removed.
# --no-compile: the dev extra's packages (Ray, onnxruntime, mlflow, transformers, ...) are not byte-compiled at install
# (with pip, ~55 s of a fresh clone's 3 min install on 2 cores): the suite imports a small part of them, and caches what
# it imports (tests/conftest.py lets its processes write bytecode). The core (`make run`) is compiled.
$(DEVSTAMP): $(STAMP)
	$(INSTALL) --no-compile "$(TORCH)" -e '.[dev]'
	$(BIN)/python -c "import torchvision" >/dev/null 2>&1 || $(BIN)/pip uninstall -q -y torchvision
	@touch $(DEVSTAMP)

# `make extras EXTRAS=data,audit`: optional extras into .venv with the installed torch kept (pip would otherwise pull
# the newest CUDA torch for their dependencies), and a torchvision that cannot load next to it removed.
EXTRAS ?= edge
extras: $(STAMP)
	$(INSTALL) "$(TORCH)" -e '.[$(EXTRAS)]'
	$(BIN)/python -c "import torchvision" >/dev/null 2>&1 || $(BIN)/pip uninstall -q -y torchvision

# Reinstall when TORCH differs from what the venv was set up with.
ifneq ($(wildcard $(STAMP)),)
ifneq ($(shell cat $(STAMP)),$(TORCH))
.PHONY: $(STAMP)
endif
endif

run: $(STAMP)
	$(BIN)/plait train

# The suite on WORKERS pytest-xdist processes, a test file at a time (its fixtures built once, on one worker), the
# longest files first (tests/conftest.py). Much of a serial run waits (heartbeats, requeues, readiness): one worker per
# core fills that time. WORKERS=0 runs it in this process, serially.
WORKERS ?= 2

test: $(DEVSTAMP)
	$(BIN)/lint-imports --no-cache
	OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=lo $(BIN)/python -m pytest -q --durations=25 -n $(WORKERS) --dist loadfile --no-loadscope-reorder

# Every peer comparison in turn, each with its A/A control (the baseline against itself) as the noise floor, one
# table in runs/bench/all.md (benchmarks/all.py; BENCH="--only serve --repeats 5" passes options).
BENCHSTAMP := $(VENV)/.plait-bench-installed
$(BENCHSTAMP): $(DEVSTAMP)
	$(INSTALL) "$(TORCH)" -e '.[dev,bench]'
	$(BIN)/python -c "import torchvision" >/dev/null 2>&1 || $(BIN)/pip uninstall -q -y torchvision
	@touch $(BENCHSTAMP)

bench: $(BENCHSTAMP)
	OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=lo $(BIN)/python benchmarks/all.py $(BENCH)

lint: $(DEVSTAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/lint-imports --no-cache
	$(BIN)/mypy

clean:
	rm -rf $(VENV) runs .pytest_cache
