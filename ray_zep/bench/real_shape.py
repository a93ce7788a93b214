"""What a run's data would give at a real shape: its documents' lengths, a 7B model and
64 or 1,024 GPUs of cluster A, modelled.

A CPU run trains a tiny model on a few virtual ranks, where every placement is within a
few percent of another. The closing summary of `ray-zep train` adds what the same
document lengths give where placement matters: global batches of `TOKENS_PER_GPU` tokens
per GPU drawn from the run's documents (with replacement, seeded; the last document cut
to fill the batch), placed and simulated as `ray-zep bench scale` does it (the same
rows: step, step / bound, tokens/s per GPU, inter-node bytes, memory and the activation
checkpointing that fits) for the product's placement, the reference (TE CP) and
Megatron-LM's dynamic CP.

Each placement plays the token room `ray-zep plan --auto` searches for the same batches
(L, and L x each of `ROOM_FACTORS`, then the factors next to the fastest, up to
`ROOM_MOST`: `bench scale --room --room-up-to`) and keeps its fastest that fits,
so a row shows what the product would run, and every baseline gets the same choice. On
the demo's documents at 1,024 GPUs Zeppelin at the default L alone stepped 3.14 s, 1.39x
its bound; at 1.5 L 2.77 s, 1.24x (BENCHMARKS.md, "The first hour at the token room the
product picks"), and at 2 L, which the search plays every time, 2.76 s (fifty-third and
fifty-fourth series). The summary leaves out the search's halved gaps beside the fastest
(`ray_zep.sim.token_room.ROOM_HALVINGS`): on the demo's documents they moved zeppelin's
steps by under 0.1% (64 GPUs: L = 5,440 rather than 5,120; 1,024: 9,600 rather than 8,960)
and took the summary from 35 to 53 s on two cores.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ray_zep.bench.scale import ScaleBenchSpec, ScaleRow, scale_case
from ray_zep.config import Config
from ray_zep.data.catalog import open_configured_source
from ray_zep.data.source import TokenSource
from ray_zep.data.synthetic import drawn_batch_lengths
from ray_zep.partition import registry
from ray_zep.partition.spec import Role
from ray_zep.sim.megatron_dynamic_cp import NAME as MEGATRON_DYNAMIC_CP
from ray_zep.sim.token_room import ROOM_FACTORS, ROOM_MOST

MODEL = "7b"
TOKENS_PER_GPU = 4096
DRAWN_DOCUMENTS = 20_000
"""Documents whose lengths stand for an endless (synthetic) source."""
ROOMS = (1.0, *ROOM_FACTORS)
"""L x these are played for each placement, the fastest that fits kept (module docstring)."""


def compared_placements() -> tuple[str, ...]:
    """The product's placement, the reference and Megatron-LM's dynamic CP."""
    return (registry.playing(Role.SYSTEM).axis.placement.value,
            registry.reference().axis.placement.value, MEGATRON_DYNAMIC_CP)  # fmt: skip


def document_lengths(source: TokenSource) -> np.ndarray:
    """Every document's length (a source without end: its first `DRAWN_DOCUMENTS`)."""
    known = getattr(source, "lengths", None)
    if known is not None:
        return np.asarray(known, dtype=np.int64)
    return np.asarray([source.length(d) for d in range(DRAWN_DOCUMENTS)], dtype=np.int64)


def real_shape_rows(config: Config, gpus: Sequence[int], seed: int = 0) -> list[ScaleRow]:
    """`compared_placements` on one batch of the run's document lengths per size in
    `gpus`, each at its fastest fitting token room of `ROOMS` or above (module docstring);
    rows labelled with the run's `data.source`; none, and the source left unread, without
    sizes."""
    if not gpus:
        return []
    documents = document_lengths(open_configured_source(config))
    spec = ScaleBenchSpec(gpus=tuple(gpus), models=(MODEL,), tokens_per_gpu=(TOKENS_PER_GPU,),
                          placements=compared_placements(), room=ROOMS,
                          room_up_to=ROOM_MOST, room_halvings=0)  # fmt: skip
    rows = []
    for size in spec.gpus:
        batch = drawn_batch_lengths(documents, TOKENS_PER_GPU * size, seed)
        rows += scale_case(spec, size, config.data.source, MODEL, TOKENS_PER_GPU, [batch])
    return rows


def real_shape_lines(rows: list[ScaleRow]) -> list[str]:
    """The summary's lines: per size, each placement's step and the token room it ran at,
    step / bound, tokens/s per GPU and inter-node bytes, and the product's speedup over
    each other placement."""
    if not rows:
        return []
    lines = [f"modelled at a real shape (this run's document lengths, {MODEL}, "
             f"{TOKENS_PER_GPU // 1024}k tokens per GPU, cluster A):"]  # fmt: skip
    for size in dict.fromkeys(r.gpus for r in rows):
        mine = [r for r in rows if r.gpus == size]
        ours = mine[0]
        lines.append(f"  {size:,} GPUs:")
        for row in mine:
            if row.step_s is None:
                lines.append(f"    {row.placement}: not modelled ({row.error})")
                continue
            speed = ""
            if row is not ours and ours.step_s:
                speed = f", {ours.placement} {row.step_s / ours.step_s:.2f}x faster"
            memory = "" if row.fits != "NO" else ", does not fit the GPU"
            lines.append(
                f"    {row.placement}: {row.step_s:,.2f} s/step at L = {row.tokens_per_rank:,}, "
                f"{row.step_over_bound:,.2f}x the bound, {row.tokens_per_s_per_gpu:,.0f} tokens/s "
                f"per GPU, {_gb(row.inter_node_gb)} between nodes{memory}{speed}"
            )
    return lines


def _gb(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f} GB"
