"""FlashInfer's CuTe-DSL kernels from the daemon (cute_dsl). FlashInfer's nvcc JIT modules
are a JIT-library hook: cached_client.integrations.jit.nvcc."""
