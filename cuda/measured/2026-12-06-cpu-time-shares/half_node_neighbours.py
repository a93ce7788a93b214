"""A 32,652-token document on three half-node USP positions (U = 4, ranks 4-15 of cluster
A, routed, L = 5,120, 7b) played alone, beside a second such group whose first position
shares its first node (ranks 0-3 and 16-23), and beside one on other nodes (ranks 24-35),
against the work model's member seconds (`WorkModel.usp_member_seconds`), which shares
each member's NIC with the GPU beside it as in a full batch.

Usage (from the repository root): python cuda/measured/2026-12-06-cpu-time-shares/half_node_neighbours.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))

from ray_zep.partition.plan import AttentionPlan, SeqPlacement  # noqa: E402
from ray_zep.partition.registry import Placement  # noqa: E402
from ray_zep.sim.events import Lane  # noqa: E402
from ray_zep.sim.step import simulate_plan  # noqa: E402
from tests.test_narrow_usp import bounds_for_counts, usp_cluster  # noqa: E402

topology, run, model = usp_cluster(8)
n = 32652
counts = [n // 3] * 2 + [n - n // 3 * 2]


def played(groups):
    seqs = tuple(SeqPlacement(i, n, ranks, bounds_for_counts(counts), ulysses=4)
                 for i, ranks in enumerate(groups))
    step = simulate_plan(AttentionPlan(Placement.ZEPPELIN, topology, 5120, seqs), run, True, None)
    hops = [end - start for start, end, name in step.forward.intervals(4, Lane.INTER_NODE)
            if name == "K/V piece"]
    layers = run.shape.n_layers
    return layers * (step.forward_layer_seconds + step.backward_layer_seconds), hops


modelled = float(model.usp_member_seconds([n], [3], [4])[0])
first = tuple(range(4, 16))
sharing = tuple(range(0, 4)) + tuple(range(16, 24))
apart = tuple(range(24, 36))
parts = model._usp_group(model.ring_parts([float(n)], [3]), [float(n)], [3], [4])
heads, inter = parts[2], parts[4]
print(f"work model: member seconds {modelled:.3f} s; forward K/V hop "
      f"{(inter[0] + float(heads.send_bytes[0]) / inter[1]) * 1e3:.2f} ms")
for name, groups in (("alone", [first]), ("beside a group sharing its first node", [first, sharing]),
                     ("beside a group on other nodes", [first, apart])):
    seconds, hops = played(groups)
    print(f"{name:38s} played {seconds:.3f} s (model / played {modelled / seconds:.3f}); "
          f"rank 4's forward K/V hops {', '.join(f'{h * 1e3:.2f}' for h in hops)} ms")
