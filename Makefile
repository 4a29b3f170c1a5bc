# `make serve` and `make test` each do all the set-up on a fresh machine first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ARGS ?=

.PHONY: setup serve test lint bench clean

setup: $(STAMP)

$(STAMP): requirements.txt requirements-dev.txt pyproject.toml client/pyproject.toml
	@command -v gcc >/dev/null || (apt-get update -qq && apt-get install -y -qq gcc)
	@command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server)
	@command -v promtool >/dev/null || (apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus)
	@command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium)
	@command -v systemd-socket-activate >/dev/null || (apt-get update -qq && apt-get install -y -qq systemd)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -r requirements.txt -r requirements-dev.txt
	$(BIN)/pip install -q --no-deps -e client -e .
	touch $(STAMP)

serve: setup
	$(BIN)/cached serve $(ARGS)

test: setup
	$(BIN)/ruff check cached client tests bench
	$(BIN)/pytest -q $(ARGS)

bench: setup
	$(BIN)/python bench/run_all.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
