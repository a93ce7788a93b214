"""Training with `comm.compression` on equals training with it off, on every stream.

Streams that only move bytes (ring K/V, FSDP2's all-gather, weight shards) leave
every bit of a run unchanged. Streams that sum (the DP gradient all-reduce, FSDP2's
reduce-scatter, TawPipe's group sums) sum in float32 in rank or chain order when
zipped, where gloo sums in its own order, so they differ by rounding only: the
bound is 1e-6 relative on losses. The ring's sums add in one order either way.
Each step's metrics carry the bytes of every stream, raw and on the wire.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ray_zep.collectives import ops
from ray_zep.collectives.codec import Compressed
from ray_zep.config import load_config
from ray_zep.config.sizes import check_sizes
from ray_zep.errors import CodecError
from ray_zep.topology import build_topology
from tests.helpers.procs import run_ranks
from tests.helpers.training import (
    SMALL_RUN,
    first_gradients,
    gradients_of,
    max_relative_error,
    mixed_dataset,
    train_rank_each,
)

pytestmark = pytest.mark.dist

TWO_BY_TWO = ["topology.nodes=2", "topology.gpus_per_node=2", "parallel.sequence=whole"]
MODES = ["off", "always", "auto"]


def _gradients_each(rank: int, world: int, runs: list[list[str]]) -> list[dict]:
    results = []
    for overrides in runs:
        trainer = first_gradients(rank, overrides)
        sizes = trainer.switches.tally.peek("gradients") if trainer.zipped else None
        results.append({"grads": gradients_of(trainer), "sizes": sizes})
    return results


def test_zipped_gradient_sync_matches_the_plain_one():
    runs = [[*SMALL_RUN, *TWO_BY_TWO, f"comm.compression={mode}"] for mode in MODES]
    per_rank = run_ranks(_gradients_each, 4, runs)
    plain, *zipped_runs = (list(run) for run in zip(*per_rank, strict=True))
    assert plain[0]["sizes"] is None
    for mode, zipped in zip(MODES[1:], zipped_runs, strict=True):
        for rank in range(4):
            for name, ref in plain[rank]["grads"].items():
                got = zipped[rank]["grads"][name]
                rel = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
                assert rel <= 1e-6, f"{mode}: rank {rank} {name}: max rel. difference {rel:.2e}"
                assert torch.equal(got, zipped[0]["grads"][name]), f"ranks disagree on {name}"
        raw, wire = zipped[0]["sizes"]  # rank 0 counts the group's collectives
        assert raw > 0 and wire > 0, mode
        if mode == "always":  # fp32 gradients: only the exponent compresses (< 32/27)
            assert 1.0 < raw / wire < 32 / 27


ALWAYS = ["comm.compression=always"]
ROUTE_REMAP = ["parallel.routing=true", "parallel.remap=true", "parallel.remap_policy=always"]
SUMS = ("gradients", "fsdp_reduce_scatter", "shard_gradients")
IN_ORDER = {"ring_relay"}
"""Cases whose compressed sums add in the order of the plain ones: bit-identical."""
SPLIT = ("train.tokens_per_rank=64", "data.shuffle=false", "data.packing=budget",
         "parallel.usp_groups=false")  # fmt: skip
"""With the mixed dataset, long documents span ranks: zeppelin rings, routes, remaps (as
rings: a USP group's hops go direct, nothing to route)."""
MOE = [
    "model.preset=tiny_moe",
    "model.moe.capacity_factor=0",
    "parallel.ep=2",
    "parallel.moe_pipeline=1a1m",
]
PADDED_MOE = ["model.preset=tiny_moe", "model.moe.capacity_factor=1.25", "parallel.ep=2"]
"""Capacity-padded dispatch, no pipeline: the one-call all-to-all."""
PAIRS = {
    # name: (placement and weights, streams compressed, streams expected in the metrics)
    "gradients": ([], ["gradients"], {"gradients"}),
    "te_cp": (["parallel.sequence=te_cp"], ["kv"], {"kv"}),
    "usp": (
        ["parallel.sequence=usp", "parallel.ulysses_degree=2"],
        ["kv", "ulysses_all_to_all"],
        {"kv", "ulysses_all_to_all"},
    ),
    "fsdp_all_gather per projection": (
        ["parallel.weights=fsdp", "parallel.fsdp_unit=linear"],
        ["fsdp_all_gather"],
        {"fsdp_all_gather"},
    ),
    "fsdp": (["parallel.weights=fsdp"], [], {"fsdp_all_gather", "fsdp_reduce_scatter"}),
    "hsdp": (["parallel.weights=hsdp"], [], {"fsdp_all_gather", "fsdp_reduce_scatter"}),
    "moe_ep2_1a1m_dispatch": (MOE, ["expert_all_to_all"], {"expert_all_to_all"}),
    "moe_ep2_1a1m": (MOE, [], {"expert_all_to_all", "gradients"}),
    "moe_ep2_padded": (PADDED_MOE, ["expert_all_to_all"], {"expert_all_to_all"}),
    "tawpipe": (["parallel.weights=tawpipe"], [], {"weight_shards", "shard_gradients"}),
    "ring_relay": (["parallel.weights=ring_relay"], [], {"weight_shards", "shard_gradients"}),
    # the default work policy's unequal ring shares: the framed relay hung here once
    "zeppelin+routing": (
        ["parallel.sequence=zeppelin", "parallel.routing=true", *SPLIT],
        ["kv", "routed_kv"],
        {"kv", "routed_kv"},
    ),
    "zeppelin+fsdp+routing+remap": (
        ["parallel.sequence=zeppelin", "parallel.weights=fsdp", *ROUTE_REMAP, *SPLIT],
        [],
        {"fsdp_all_gather", "fsdp_reduce_scatter", "kv", "routed_kv", "remap_all_to_all"},
    ),
}
"""An empty stream list compresses every stream."""


def test_compressed_training_equals_plain_training(tmp_path: Path):
    """One spawn trains every pair, 2 steps each: bit-identical where every compressed
    stream only moves bytes, losses and parameters within 1e-6 where one sums."""
    base = [*SMALL_RUN, *TWO_BY_TWO, "train.steps=2", "train.save_last=false"]
    mixed = f"data.source={mixed_dataset(tmp_path / 'mixed.parquet')}"
    runs = []
    for name, (axes, streams, _) in PAIRS.items():
        axes = [*axes, mixed] if SPLIT[0] in axes else axes
        only = [f"comm.compression_streams=[{','.join(streams)}]"] if streams else []
        for side, extra in (("off", []), ("on", [*ALWAYS, *only])):
            runs.append([*base, *axes, *extra, f"train.out_dir={tmp_path / name / side}"])
    results = run_ranks(train_rank_each, 4, runs)[0]

    for i, (name, (_, streams, expected)) in enumerate(PAIRS.items()):
        off, on = results[2 * i], results[2 * i + 1]
        assert sorted(on["losses"]) == [1, 2], name
        # the framed relay's and mailboxes' threads stop with the run (the runs share a
        # process: none may pile up)
        assert not off["routing_threads"] and not on["routing_threads"], name
        moved_only = name in IN_ORDER or not set(streams or expected) & set(SUMS)
        if moved_only:
            assert on["losses"] == off["losses"], name
            for key, value in off["params"].items():
                assert torch.equal(on["params"][key], value), f"{name}: {key} differs"
        else:
            for step, loss in off["losses"].items():
                assert on["losses"][step] == pytest.approx(loss, rel=1e-6), f"{name} {step}"
            err, param = max_relative_error(on["params"], off["params"])
            assert err <= 1e-6, f"{name}: {param} relative error {err:.2e}"
        rows = [e["compression"] for e in on["events"] if e["event"] == "step"]
        assert expected <= {stream for row in rows for stream in row}, name
        for row in rows:  # a step whose plan keeps every sequence local moves no K/V
            for stream, sizes in row.items():
                if stream in expected:
                    assert sizes["raw_bytes"] > sizes["wire_bytes"] > 0, f"{name}: {stream}"
                    assert sizes["zipped_calls"] > 0, f"{name}: {stream}"
                else:  # through the switch, but not a stream it may compress
                    assert sizes["raw_bytes"] == sizes["wire_bytes"] > 0, f"{name}: {stream}"
                    assert sizes["zipped_calls"] == 0 < sizes["plain_calls"], f"{name}: {stream}"
        assert all(not e.get("compression") for e in off["events"] if e["event"] == "step")


FSDP_ALWAYS = [*SMALL_RUN, *TWO_BY_TWO, "parallel.weights=fsdp", *ALWAYS]


def _damaged(how: str, rank: int):
    """`ops.compress`, with the bytes this rank sends damaged as `how` says."""
    honest = ops.compress

    def compress(tensor, splits=None, backend="auto") -> Compressed:
        out = honest(tensor, splits, backend)
        if rank != 1:
            return out
        static = out.static.clone()
        sizes = list(out.static_sizes)
        if how == "corrupt":
            static[200] ^= 0x10  # a byte of the first chunk's raw plane
        else:  # truncated: the first chunk's static part loses its last 128 bytes
            keep = sum(sizes[:1]) - 128
            static = torch.cat([static[:keep], static[sum(sizes[:1]) :]])
            sizes[0] -= 128
        return Compressed(
            static,
            out.dynamic,
            tuple(sizes),
            out.dynamic_sizes,
            out.chunk_values,
            out.dtype,
            out.shape,
        )

    return compress


def _error_of_damaged_run(rank: int, world: int, how: str) -> str:
    honest = ops.compress
    ops.compress = _damaged(how, rank)  # pooled ranks serve later tests: put it back
    try:
        first_gradients(rank, FSDP_ALWAYS)
    except CodecError as exc:
        return str(exc)
    finally:
        ops.compress = honest
    return "no error"


@pytest.mark.parametrize("how", ["corrupt", "truncated"])
def test_a_damaged_compressed_buffer_is_a_typed_error_naming_stream_and_peer(how: str):
    """Rank 1 sends FSDP2's first all-gather damaged: every rank (rank 1 decodes its own
    block too) raises a CodecError naming the stream and rank 1, and none hangs."""
    errors = run_ranks(_error_of_damaged_run, 4, how)
    for rank, message in enumerate(errors):
        assert "fsdp_all_gather" in message and "from rank 1" in message, (rank, message)


def test_routed_kv_compressed_loads_on_any_node_count_and_zone_policy() -> None:
    """Configs the framed relay used to hang on (three nodes; two with the work policy's
    unequal shares) load: the mailbox posts tails as frames arrive; the 2 x 2
    zeppelin+routing pair above (the default work policy) trains them bit-identical."""
    on = ["topology.gpus_per_node=2", "parallel.sequence=zeppelin", "parallel.routing=true",
          "comm.compression=always"]  # fmt: skip
    for extra in (["topology.nodes=3"], ["topology.nodes=2", "parallel.zone_policy=work"]):
        config = load_config(None, [*on, *extra])
        check_sizes(config, build_topology(config.topology))
