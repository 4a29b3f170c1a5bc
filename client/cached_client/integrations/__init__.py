"""What knows a framework: FlashInfer (flashinfer/), vLLM (vllm/) and the JIT libraries'
hooks (jit/: FlashInfer's nvcc modules, Humming, Triton), and the import hooks they attach
by. They import the core (cached_client, cached_client.gemm); neither the core nor the
daemon imports them (tests/test_structure.py)."""
