"""Each replayed row with the blocks kept on the node where they fit, against the same rows
before (`parallel.reshard_to_node` did not exist): whether the row keeps the node's shards,
its checkpointing and peak, its step over its own bound before and now, and its step now
over its step before.

Usage: python node_shards_rows.py BEFORE.json NOW.json
"""

import json
import statistics
import sys


def rows(path):
    return {(r["gpus"], r["distribution"], r["model"]): r for r in json.load(open(path))["rows"]}


before, now = rows(sys.argv[1]), rows(sys.argv[2])
print("GPUs data model | node shards | ckpt | GB | step/bound before -> now | step now/before")
ratios, old, new = [], [], []
for key, row in now.items():
    was = before[key]
    ratio = row["step_s"] / was["step_s"]
    ratios.append(ratio)
    old.append(was["step_over_bound"])
    new.append(row["step_over_bound"])
    print(*key, "|", row["node_shards"], "|", row["checkpointing"], "|",
          f"{row['peak_memory_gb']:.1f} | {was['step_over_bound']:.4f} -> "
          f"{row['step_over_bound']:.4f} | {ratio:.4f}")
print(f"mean step/bound {statistics.mean(old):.4f} -> {statistics.mean(new):.4f}, worst "
      f"{max(old):.3f} -> {max(new):.3f}; step now/before mean {statistics.mean(ratios):.4f} "
      f"({min(ratios):.4f}-{max(ratios):.4f}), {sum(r < 0.9995 for r in ratios)} of "
      f"{len(ratios)} rows faster, {sum(r > 1.0005 for r in ratios)} slower")
