"""cached: a per-node compilation-cache daemon for CuTe-DSL GEMM kernels.

Flow: socket (server.py) -> scheduler.py -> pool.py -> worker.py -> store.py.
"""
