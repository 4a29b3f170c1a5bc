"""Operator tools that drive a daemon through a client: cached tune and its CUDA timing core,
pre-warm manifests."""
