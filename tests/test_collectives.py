"""Zipped collectives equal their plain counterparts bit for bit on 2 and 4 gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ray_zep.collectives import compress
from ray_zep.collectives.codec import read_header
from ray_zep.collectives.format import float_format
from ray_zep.collectives.ops import (
    AllToAllDesign,
    Group,
    all_gather_ints,
    all_gather_v,
    all_to_all_v,
    native_reduce_scatter,
    reduce_scatter_via_all_to_all,
    zipped_all_gather,
    zipped_all_to_all,
    zipped_reduce_scatter,
)
from ray_zep.errors import CodecError
from tests.helpers.procs import run_ranks

pytestmark = pytest.mark.dist

WIDTH = 24


def inputs(rank: int, world: int) -> dict[str, torch.Tensor]:
    """Gaussian BF16 and FP32, random bits (mostly escapes) and NaN/Inf payloads (every
    value escapes: no table codes the Inf/NaN exponent); rows differ by rank (rank 1 has none)."""
    gen = torch.Generator().manual_seed(100 + rank)
    rows = 0 if rank == 1 else 17 * rank + 5
    noise = torch.randint(-(2**15), 2**15, (rows, WIDTH), generator=gen, dtype=torch.int16)
    return {
        "bf16": torch.randn(rows, WIDTH, generator=gen).bfloat16() * 0.02,
        "fp32": torch.randn(rows, WIDTH, generator=gen) * 3.0,
        "random bits": noise.view(torch.bfloat16),
        "all escapes": (noise | 0x7F80).view(torch.bfloat16),
    }


def send_rows(rank: int, world: int, total: int) -> list[int]:
    """Uneven, with zeros: destination d gets (d + rank) parts out of a skewed split."""
    weights = [(d + rank) % world for d in range(world)]
    out = [total * w // max(sum(weights), 1) for w in weights]
    out[rank] += total - sum(out)
    return out


def same_shape(tensor: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Reduce-scatter input: the same shape on every rank, this rank's values."""
    gen = torch.Generator().manual_seed(rank)
    like = torch.randn(world * 9, WIDTH, generator=gen).to(tensor.dtype)
    rows = min(tensor.shape[0], like.shape[0])
    like[:rows] = tensor[:rows]
    return like


def collectives_rank(rank: int, world: int) -> dict:
    g = Group(dist.group.WORLD, 60.0)
    results: dict = {}
    for name, tensor in inputs(rank, world).items():
        results[f"ag/{name}"] = (zipped_all_gather(tensor, g)[0], all_gather_v(tensor, g))
        rows = send_rows(rank, world, tensor.shape[0])
        recv = [every[rank] for every in all_gather_ints(rows, g, "row counts")]
        plain = all_to_all_v(tensor, rows, recv, g)
        for design in AllToAllDesign:
            zipped, _ = zipped_all_to_all(tensor, rows, recv, g, design)
            results[f"a2a-{design.value}/{name}"] = (zipped, plain)
        stacked = same_shape(tensor, rank, world)
        zipped_rs, _ = zipped_reduce_scatter(stacked, g)
        results[f"rs/{name}"] = (zipped_rs, reduce_scatter_via_all_to_all(stacked, g))
        if name == "fp32":
            results["rs-native/fp32"] = (zipped_rs, native_reduce_scatter(stacked, g))
    return results


def test_nan_and_inf_payloads_escape_every_value():
    values = inputs(2, 4)["all escapes"]
    zipped = compress(values)
    header = read_header(zipped.chunk(0)[0])
    assert header.n_escapes == values.numel() > 0


def as_bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(float_format(tensor.dtype).int_dtype)


@pytest.mark.parametrize("world", [2, 4])
def test_zipped_collectives_equal_plain_ones_bit_for_bit(world):
    for rank, results in enumerate(run_ranks(collectives_rank, world)):
        for key, (zipped, plain) in results.items():
            if key == "rs-native/fp32":
                continue
            zipped = zipped if isinstance(zipped, list) else [zipped]
            plain = plain if isinstance(plain, list) else [plain]
            for z, p in zip(zipped, plain, strict=True):
                assert z.shape == p.shape and z.dtype == p.dtype, f"{key} rank {rank}"
                assert torch.equal(as_bits(z), as_bits(p)), f"{key} differs on rank {rank}"


@pytest.mark.parametrize("world", [4])
def test_zipped_reduce_scatter_is_close_to_the_native_one(world):
    """Only the summation order differs: float32 relative error <= 1e-6."""
    for rank, results in enumerate(run_ranks(collectives_rank, world)):
        zipped, native = results["rs-native/fp32"]
        scale = native.abs().max().clamp_min(1e-30)
        err = ((zipped - native).abs().max() / scale).item()
        assert err <= 1e-6, f"rank {rank}: max rel. difference {err:.2e}"


def _damaged_all_to_all(rank: int, world: int, design: str) -> str:
    """Rank 2 flips one bit of the chunk it sends rank 0; what each rank raises."""
    from ray_zep.collectives import ops

    honest = ops.compress

    def compress_damaged(tensor, splits=None, backend="auto"):
        out = honest(tensor, splits, backend)
        if rank == 2:
            out.static[out.static_offsets[0] + 100] ^= 0x04  # the chunk for rank 0
        return out

    g = Group(dist.group.WORLD, 60.0)
    tensor = torch.randn(world * 64, WIDTH, generator=torch.Generator().manual_seed(rank))
    rows = [64] * world
    ops.compress = compress_damaged  # pooled ranks serve later tests: put it back
    try:
        zipped_all_to_all(tensor.bfloat16(), rows, rows, g, AllToAllDesign(design), what="moe")
    except CodecError as exc:
        return str(exc)
    finally:
        ops.compress = honest
    return "no error"


@pytest.mark.parametrize("design", [d.value for d in AllToAllDesign])
def test_a_corrupted_all_to_all_chunk_names_the_stream_and_the_sender(design):
    errors = run_ranks(_damaged_all_to_all, 3, design)
    assert errors[0].startswith("moe: the compressed data from rank 2"), errors[0]
    assert "checksum" in errors[0] or "corrupt" in errors[0]
    assert errors[1:] == ["no error", "no error"], "only rank 0 received the damaged chunk"
