"""Weight-passing pipeline parallelism (TawPipe) and its baselines.

Every device trains its own micro-batches through the whole model while the
weights travel: each device owns one shard of consecutive layers (weights,
gradients and optimizer state) and the others borrow it for as long as they
compute with it. `layout` decides who owns what, `transport` moves shards and
gradients (TawPipe's grouped scheme, a ring, or global collectives),
`weights` keeps borrowed shards only while in use, and `runner` drives one
step's forward and backward shard by shard.
"""
