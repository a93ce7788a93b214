"""Rows of a series against an earlier one: python3 compare.py BEFORE AFTER (each a
comma-separated list of `ray-zep bench scale` JSON files), matched by GPUs, data and model."""
import json
import sys


def rows(files):
    out = {}
    for f in files.split(","):
        for r in json.load(open(f))["rows"]:
            out[(r["gpus"], r["distribution"], r["model"])] = r
    return out


old, new = rows(sys.argv[1]), rows(sys.argv[2])
before, after = [], []
for k in sorted(new, key=lambda k: (k[2], k[0], ["arxiv", "github", "prolong64k", "chat"].index(k[1]))):
    o, n = old.get(k), new[k]
    if o is None:
        continue
    before.append(o["step_over_bound"])
    after.append(n["step_over_bound"])
    print(f"| {k[2]} | {k[0]:,} | {k[1]} | {o['step_over_bound']:.3f} -> {n['step_over_bound']:.3f} | "
          f"{o['tokens_per_s_per_gpu']:.0f} -> {n['tokens_per_s_per_gpu']:.0f} | "
          f"{(o['step_s'] / n['step_s'] - 1) * 100:+.1f}% | {o['level']:.5g} -> {n['level']:.5g} | "
          f"{o['tokens_per_rank']:,} -> {n['tokens_per_rank']:,} |")
print(f"rows {len(after)}: mean {sum(before) / len(before):.4f} -> {sum(after) / len(after):.4f}, "
      f"worst {max(before):.3f} -> {max(after):.3f}")
