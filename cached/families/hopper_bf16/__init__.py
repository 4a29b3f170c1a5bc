"""Hopper (sm_90a) BF16 GEMM family ``cached.hopper_bf16``: the hopper_fp8 family's kernel,
tactic type, space, cost model and compile path on bf16 operands (family.py is the family
behind the registry; everything else lives in cached.families.hopper_fp8)."""
