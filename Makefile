# `make serve` and `make test` each do all the set-up on a fresh machine first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
ARGS ?=

.PHONY: setup setup-test serve test bench clean

setup: $(STAMP)

setup-test: $(TEST_STAMP)

# The daemon: a C linker (kernels are linked into .so files) and the pinned toolchain.
# torch's CPU build comes from PyTorch's CPU index (TORCH_INDEX=URL in the environment: a mirror).
$(STAMP): requirements.txt deploy/install-deps.sh pyproject.toml client/pyproject.toml
	@command -v gcc >/dev/null || (apt-get update -qq && apt-get install -y -qq gcc)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	sh deploy/install-deps.sh $(BIN)/pip -q
	$(BIN)/pip install -q --no-deps -e client -e .
	touch $(STAMP)

# Tests and benchmarks: the real servers and tools they drive.
$(TEST_STAMP): $(STAMP) requirements-dev.txt
	@command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server)
	@command -v promtool >/dev/null || (apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus)
	@command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium)
	@command -v systemd-socket-activate >/dev/null || (apt-get update -qq && apt-get install -y -qq systemd)
	@command -v ip >/dev/null || (apt-get update -qq && apt-get install -y -qq iproute2)
	$(BIN)/pip install -q -r requirements-dev.txt
	touch $(TEST_STAMP)

serve: setup
	$(BIN)/cached serve $(ARGS)

test: setup-test
	$(BIN)/ruff check cached client tests bench
	$(BIN)/pytest -q $(ARGS)

bench: setup-test
	$(BIN)/python bench/run_all.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
