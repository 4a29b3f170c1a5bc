"""Hopper (sm_90a) FP8 GEMM family written in CuTe-DSL.

tactic.py (the tactic type and its resource arithmetic), cost.py (the fitted cost model),
winners.py (the recorded winners) and space.py (the tactic space and its order) import
neither cutlass nor torch, so the daemon's main process can use them; family.py is the
family behind the registry. kernel.py / compile.py (cutlass) are imported by the workers,
and the launcher lives in the client (cached_client.gemm.hopper_fp8, torch).
"""
