"""The batch-invariant GEMMs: which kernel (policy), the plan per weight shape (plan), the
certification of a family on a GPU (certify) and the host-side launcher of the daemon's own
Hopper kernel (hopper_fp8). Core: it imports the rest of the core and no integration; a
family served through an integration is reached through :func:`plan.register_installer`."""
