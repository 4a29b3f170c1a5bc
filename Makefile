# `make serve` and `make test` each do all the set-up on a fresh machine first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed
JIT_DIR := .venv-jit
JIT_STAMP := $(JIT_DIR)/.installed
ARGS ?=

.PHONY: setup setup-test setup-vllm setup-jit serve test bench clean

setup: $(STAMP)

setup-test: $(TEST_STAMP) $(VLLM_STAMP) $(JIT_STAMP)

setup-vllm: $(VLLM_STAMP)

setup-jit: $(JIT_STAMP)

# The daemon: a C linker (kernels are linked into .so files) and the pinned toolchain.
# torch's CPU build comes from PyTorch's CPU index (TORCH_INDEX=URL in the environment: a mirror).
$(STAMP): requirements.txt deploy/install-deps.sh pyproject.toml client/pyproject.toml
	@command -v gcc >/dev/null || (apt-get update -qq && apt-get install -y -qq gcc)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	sh deploy/install-deps.sh $(BIN)/pip -q
	$(BIN)/pip uninstall -q -y cached cached-client 2>/dev/null || true  # the names before 0.1's rename
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

# The second environment, as a vLLM 0.33.0 user has it: vLLM's pins of FlashInfer, the DSL
# and TVM-FFI, vLLM itself without its GPU dependencies, and cached-kernel-client as the only
# project package. requirements-vllm.txt is a complete lock (hence --no-deps); the import
# at the end checks it.
$(VLLM_STAMP): requirements-vllm.txt client/pyproject.toml
	test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q torch==2.13.0
	$(VLLM_BIN)/pip install -q --no-deps -r requirements-vllm.txt
	$(VLLM_BIN)/pip install -q --no-deps vllm==0.33.0
	$(VLLM_BIN)/pip uninstall -q -y cached-client 2>/dev/null || true  # the client's name before
	$(VLLM_BIN)/pip install -q --no-deps -e client
	$(VLLM_BIN)/python -c "import vllm.plugins, vllm.model_executor.kernels.linear" >/dev/null
	touch $(VLLM_STAMP)

# The JIT libraries the tests compile with (Triton, Humming, the CUDA 13.0 compiler wheels:
# requirements-jit.txt), in one directory both test environments put on their path; and
# the link-time stand-in for the driver library that the CUDA toolkit ships as
# lib64/stubs/libcuda.so and no wheel does (FlashInfer links its modules with -lcuda; the
# machines running the tests have no driver). tests/jit_harness.py says how each is used.
$(JIT_STAMP): requirements-jit.txt $(STAMP)
	@command -v g++ >/dev/null || (apt-get update -qq && apt-get install -y -qq g++)
	rm -rf $(JIT_DIR)
	$(BIN)/pip install -q --no-deps --target $(JIT_DIR) -r requirements-jit.txt
	mkdir -p $(JIT_DIR)/stubs
	printf 'void cached_libcuda_link_stub(void) {}\n' > $(JIT_DIR)/stubs/stub.c
	gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o $(JIT_DIR)/stubs/libcuda.so $(JIT_DIR)/stubs/stub.c
	ln -sfn ../nvidia/cu13/lib/libcudart.so.13 $(JIT_DIR)/stubs/libcudart.so
	touch $(JIT_STAMP)

serve: setup
	$(BIN)/cached serve $(ARGS)

# Three test processes, one test file each at a time (module fixtures are built once): most
# tests wait on daemons, compiles and sockets, so three share two cores well.
TEST_PROCS ?= 3

test: setup-test
	$(BIN)/ruff check cached client tests bench
	$(BIN)/pytest -q -n $(TEST_PROCS) --dist loadfile $(ARGS)

bench: setup-test
	$(BIN)/python bench/run_all.py $(ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(JIT_DIR) .pytest_cache .ruff_cache
