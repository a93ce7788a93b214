"""Zeppelin on the demo's documents at a real shape, three seeded batches per size, as the
demo's closing summary plays them (`ray_zep.bench.real_shape`).

usage: python demo_rows.py GPUS ROOMS KV_ROOMS SEEDS [ROOM_UP_TO]
e.g.   python demo_rows.py 64,1024 1,1.25,1.5 model 3 2
"""

import sys

from ray_zep.bench.real_shape import TOKENS_PER_GPU, document_lengths
from ray_zep.bench.scale import ScaleBenchSpec, scale_case
from ray_zep.config import load_config
from ray_zep.data.catalog import open_configured_source
from ray_zep.data.synthetic import drawn_batch_lengths

config = load_config("conf/demo.yaml", [])
documents = document_lengths(open_configured_source(config))
gpus = [int(g) for g in sys.argv[1].split(",")]
rooms = tuple(float(x) for x in sys.argv[2].split(","))
kv = tuple(None if x == "model" else float(x) for x in sys.argv[3].split(","))
up_to = float(sys.argv[5]) if len(sys.argv) > 5 else None
spec = ScaleBenchSpec(gpus=tuple(gpus), models=("7b",), tokens_per_gpu=(TOKENS_PER_GPU,),
                      placements=("zeppelin",), room=rooms, kv_room=kv, room_up_to=up_to)
for size in gpus:
    for seed in range(int(sys.argv[4])):
        batch = drawn_batch_lengths(documents, TOKENS_PER_GPU * size, seed)
        for r in scale_case(spec, size, "demo", "7b", TOKENS_PER_GPU, [batch]):
            print(f"{size} seed {seed}: L={r.tokens_per_rank} step={r.step_s:.3f} "
                  f"x bound={r.step_over_bound:.3f} tok/s/GPU={r.tokens_per_s_per_gpu:.0f}")
