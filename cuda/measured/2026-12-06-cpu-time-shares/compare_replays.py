"""Step / bound of replays of the same rows, each step divided by the first replay's bound;
the last line's oracle takes each row's best.

Usage: python compare_replays.py BASE.json OTHER.json [...]
"""

import json
import sys

import numpy as np


def rows(path):
    return {(r["gpus"], r["distribution"], r["model"]): r for r in json.load(open(path))["rows"]
            if r.get("placement") == "zeppelin"}


base = rows(sys.argv[1])
others = [rows(path) for path in sys.argv[2:]]
table = []
for key, row in base.items():
    line = [row["step_over_bound"]]
    line += [other[key]["step_s"] / row["step_s"] * row["step_over_bound"] for other in others]
    table.append(line)
    print(*key, " ".join(f"{x:.4f}" for x in line))
table = np.array(table)
print("mean", " ".join(f"{x:.4f}" for x in table.mean(axis=0)),
      f"| oracle {table.min(axis=1).mean():.4f} | worst",
      " ".join(f"{x:.3f}" for x in table.max(axis=0)))
