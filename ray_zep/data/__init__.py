"""Token datasets, batching and per-rank shards."""
