"""Toolchains and identity: the compiler stacks a daemon builds with, the identity of an
environment, and who may be served what."""
