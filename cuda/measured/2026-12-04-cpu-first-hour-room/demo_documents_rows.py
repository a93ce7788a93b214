"""Zeppelin on the demo's documents (conf/demo.yaml: the standard library's Python files,
byte-tokenized) at a real shape, as the closing summary draws its batches (7b, 4k tokens per
GPU, cluster A), at the default L alone and at the fastest of the token rooms `plan --auto`
searches, per seed.
Usage (from the repository root): PYTHONPATH=. python3 demo_documents_rows.py GPUS ROOMS SEEDS
e.g. 64,1024 1 3 (L alone), 64,1024 1,1.25,1.5 3 (the search)."""

import sys

import numpy as np

from ray_zep.bench.real_shape import TOKENS_PER_GPU, document_lengths
from ray_zep.bench.scale import ScaleBenchSpec, scale_case
from ray_zep.config import load_config
from ray_zep.data.catalog import open_configured_source
from ray_zep.data.synthetic import drawn_batch_lengths


def main() -> None:
    gpus = [int(g) for g in sys.argv[1].split(",")]
    rooms = tuple(float(x) for x in sys.argv[2].split(","))
    seeds = int(sys.argv[3])
    documents = document_lengths(open_configured_source(load_config("conf/demo.yaml", [])))
    print(f"{documents.size} documents, mean {documents.mean():.0f}, max {documents.max()}")
    spec = ScaleBenchSpec(gpus=tuple(gpus), models=("7b",), tokens_per_gpu=(TOKENS_PER_GPU,),
                          placements=("zeppelin",), room=rooms)  # fmt: skip
    for size in gpus:
        for seed in range(seeds):
            batch = drawn_batch_lengths(documents, TOKENS_PER_GPU * size, seed)
            (row,) = scale_case(spec, size, "stdlib", "7b", TOKENS_PER_GPU, [batch])
            print(f"{size} GPUs seed {seed} ({batch.size} documents, longest "
                  f"{np.sort(batch)[::-1][:3].tolist()}): L = {row.tokens_per_rank}, "
                  f"step {row.step_s:.3f} s, {row.step_over_bound:.3f}x the bound, "
                  f"{row.tokens_per_s_per_gpu:.0f} tokens/s per GPU, level {row.level:.3f}")


if __name__ == "__main__":
    main()
