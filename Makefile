# plait: `make run` trains the built-in default job, `make test` runs the whole suite.
# Both create .venv if missing and install plait into it, torch first (override with TORCH=...).
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.plait-installed

.PHONY: run test bench lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check "$(TORCH)"
	$(BIN)/pip install -q --disable-pip-version-check -e '.[dev]' "$(TORCH)"  # torch pinned: litdata's torchvision must not replace it
	@echo "$(TORCH)" > $(STAMP)

# Reinstall when TORCH differs from what the venv was set up with.
ifneq ($(wildcard $(STAMP)),)
ifneq ($(shell cat $(STAMP)),$(TORCH))
.PHONY: $(STAMP)
endif
endif

run: $(STAMP)
	$(BIN)/plait train

test: $(STAMP)
	$(BIN)/lint-imports --no-cache
	OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=lo $(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python benchmarks/overhead.py

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/lint-imports --no-cache

clean:
	rm -rf $(VENV) runs .pytest_cache
