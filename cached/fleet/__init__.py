"""The fleet tier: what one node's compilations share with every other node (a Redis of
Ed25519-signed entries), behind the :class:`~cached.fleet.tier.Tier` protocol the
scheduler depends on."""
