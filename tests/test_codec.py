"""ZipCCL codec: bit-exact round trips, identical bytes from every backend, format checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_zep.collectives import compress, decompress, native
from ray_zep.collectives.codec import decode_chunk, read_header, split_packed
from ray_zep.collectives.format import (
    BF16,
    BLOCK_VALUES,
    FP16,
    FP32,
    TILE_VALUES,
    float_format,
    static_bytes,
)
from ray_zep.collectives.reference import split_fields
from ray_zep.collectives.table import block_tables
from ray_zep.errors import CodecError

pytestmark = pytest.mark.unit

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
NATIVE_MISSING = native.unavailable_reason(torch.device("cpu"), BF16)
BACKENDS = ["torch"] + ([] if NATIVE_MISSING else ["native"])


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(float_format(tensor.dtype).int_dtype)


def assert_round_trip(tensor: torch.Tensor, splits=None) -> None:
    """Every backend decodes every backend's bytes to the same bits; the bytes agree."""
    outputs = {b: compress(tensor, splits, backend=b) for b in BACKENDS}
    reference = outputs["torch"]
    for name, out in outputs.items():
        assert torch.equal(out.static, reference.static), f"{name} static part differs"
        assert torch.equal(out.dynamic, reference.dynamic), f"{name} dynamic part differs"
        for decoder in BACKENDS:
            back = decompress(out, backend=decoder)
            assert back.dtype == tensor.dtype and back.shape == tensor.shape
            assert torch.equal(bits(back), bits(tensor)), f"{name} -> {decoder} changed bits"


def from_bits(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return raw.to(float_format(dtype).int_dtype).view(dtype)


@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(0, 40), min_size=0, max_size=3),
    log_sigma=st.floats(-30, 30),
    seed=st.integers(0, 2**31 - 1),
    transpose=st.booleans(),
)
@settings(max_examples=120, deadline=None)
def test_round_trip_of_gaussian_tensors_of_any_shape(dtype, shape, log_sigma, seed, transpose):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=gen, dtype=torch.float64) * 10.0**log_sigma
    tensor = values.to(dtype)
    if transpose and tensor.dim() >= 2:
        tensor = tensor.transpose(0, 1)
    assert_round_trip(tensor)


@given(
    dtype=st.sampled_from(DTYPES),
    n=st.integers(0, 3000),
    parts=st.integers(1, 5),
    seed=st.integers(0, 2**31 - 1),
)
@settings(max_examples=60, deadline=None)
def test_round_trip_of_random_bit_patterns_in_chunks(dtype, n, parts, seed):
    """Any bits at all (NaN payloads, Inf, subnormals), cut into uneven chunks."""
    gen = torch.Generator().manual_seed(seed)
    width = 8 * float_format(dtype).value_bytes
    raw = torch.randint(-(2 ** (width - 1)), 2 ** (width - 1), (n,), generator=gen)
    cuts = sorted(torch.randint(0, n + 1, (parts - 1,), generator=gen).tolist())
    splits = [b - a for a, b in zip([0, *cuts], [*cuts, n], strict=True)]
    assert_round_trip(from_bits(raw, dtype), splits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_16_bit_pattern(dtype):
    """All 65536 patterns: every exponent, NaN payloads, ±Inf, ±0, subnormals."""
    assert_round_trip(from_bits(torch.arange(-(2**15), 2**15), dtype))


def test_every_fp32_exponent_with_random_sign_and_mantissa():
    gen = torch.Generator().manual_seed(0)
    exponent = torch.arange(256).repeat_interleave(64)
    mantissa = torch.randint(0, 2**23, exponent.shape, generator=gen)
    sign = torch.randint(0, 2, exponent.shape, generator=gen)
    raw = (sign << 31) | (exponent << 23) | mantissa
    raw = torch.where(raw >= 2**31, raw - 2**32, raw)
    assert_round_trip(from_bits(raw, torch.float32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "values",
    [
        [],
        [1.0],
        [0.0] * 5000,
        [-0.0] * 7,
        [float("nan")] * 9,
        [float("inf"), -float("inf")] * 600,
        [3.5] * 4097,
    ],
)
def test_special_and_constant_tensors(dtype, values):
    assert_round_trip(torch.tensor(values, dtype=torch.float64).to(dtype))


def test_non_contiguous_views():
    base = torch.randn(64, 48).to(torch.bfloat16)
    for view in (base[:, ::3], base.t(), base[5:40:2, 7], base.expand(2, 64, 48)):
        assert_round_trip(view)


@pytest.mark.parametrize("sigma", [1e-30, 1e-12, 1e-3, 0.02, 1.0, 7.0, 1e4, 1e12, 1e30])
def test_gaussian_bf16_compresses_at_least_1_4x_at_every_sigma(sigma):
    tensor = (torch.randn(1 << 16, generator=torch.Generator().manual_seed(1)) * sigma).bfloat16()
    assert compress(tensor).ratio >= 1.40


def tables_of(tensor: torch.Tensor) -> list[list[int]]:
    fmt = float_format(tensor.dtype)
    return block_tables(split_fields(tensor.reshape(-1), fmt)[0], fmt).tolist()


def test_relu_like_activations_code_their_zeros():
    gen = torch.Generator().manual_seed(2)
    tensor = torch.relu(torch.randn(1 << 16, generator=gen)).bfloat16()
    assert all(table[0] == 0 for table in tables_of(tensor)), "zeros are the most frequent field"
    assert compress(tensor).ratio >= 1.35


def test_each_block_codes_its_seven_most_frequent_fields_by_count_then_field():
    fields = [120, 5, 7, 9, 121, 33, 200, 201, 202]
    counts = [10, 40, 40, 3, 1, 2, 2, 40, 0]
    block = torch.tensor([f for f, c in zip(fields, counts, strict=True) for _ in range(c)])
    block = torch.cat([block, torch.full((BLOCK_VALUES - block.numel(),), 77)])
    second = torch.tensor([3, 3, 4])  # a short last block: the unused fields fill its table
    exp_N = torch.cat([block[torch.randperm(BLOCK_VALUES)], second])
    assert block_tables(exp_N, BF16).tolist() == [
        [77, 5, 7, 201, 120, 9, 33],
        [3, 4, 0, 1, 2, 5, 6],
    ]


def test_mixed_scales_get_a_table_per_block():
    gen = torch.Generator().manual_seed(4)
    scales = torch.tensor([1e-8, 1.0, 1e5, 1e-3]).repeat_interleave(BLOCK_VALUES)
    tensor = (torch.randn(scales.numel(), generator=gen) * scales).bfloat16()
    assert len({tuple(sorted(t)) for t in tables_of(tensor)}) == 4
    assert compress(tensor).ratio >= 1.40


def test_tables_stay_inside_the_exponent_range():
    for fmt, huge in ((BF16, 1e30), (FP16, 6e4), (FP32, 1e30)):
        for sigma in (1e-30, huge):
            for table in tables_of((torch.randn(999) * sigma).to(fmt.dtype)):
                assert len(set(table)) == 7 and all(0 <= e < fmt.exp_max for e in table)


def test_inf_and_nan_always_escape():
    tensor = torch.tensor([float("nan"), float("inf")] * 3000).bfloat16()
    static, _ = compress(tensor).chunk(0)
    assert read_header(static).n_escapes == tensor.numel()


def test_chunks_are_padded_to_128_bytes_and_split_back():
    tensor = torch.randn(10_000).bfloat16()
    splits = [0, 1, TILE_VALUES, 10_000 - TILE_VALUES - 1]
    out = compress(tensor, splits)
    assert all(size % 128 == 0 for size in (*out.static_sizes, *out.dynamic_sizes))
    assert out.static_sizes == tuple(static_bytes(n, torch.bfloat16) for n in splits)
    assert out.nbytes == out.static.numel() + out.dynamic.numel()
    decoded = [decode_chunk(s, d) for s, d in split_packed(out.packed(), len(splits))]
    assert torch.equal(bits(torch.cat(decoded)), bits(tensor))


def test_bad_input_raises_codec_errors():
    with pytest.raises(CodecError, match="int64"):
        compress(torch.arange(4))
    with pytest.raises(CodecError, match="sum to the 4 values"):
        compress(torch.zeros(4), splits=[1, 2])
    with pytest.raises(CodecError, match="backend"):
        compress(torch.zeros(4), backend="zstd")
    out = compress(torch.randn(3000).bfloat16())
    static, dynamic = out.chunk(0)
    with pytest.raises(CodecError, match="not a ZipCCL"):
        decode_chunk(torch.zeros_like(static), dynamic)
    with pytest.raises(CodecError, match="truncated"):
        decode_chunk(static[:64], dynamic)


@pytest.mark.parametrize("backend", ["torch", "native"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_flipped_bit_anywhere_in_a_chunk_is_an_error_not_a_wrong_value(backend, dtype):
    if backend == "native" and NATIVE_MISSING is not None:
        pytest.skip(f"C codec kernel: {NATIVE_MISSING}")
    tensor = (torch.randn(2500, generator=torch.Generator().manual_seed(3)) * 1e-3).to(dtype)
    tensor[::5] = 1e-30  # escapes: a dynamic part to corrupt too
    static, dynamic = compress(tensor, backend=backend).chunk(0)
    layout = read_header(static).layout
    used = [(static, b) for b in range(layout.static_bytes)]
    used += [(dynamic, b) for b in range(read_header(static).n_escapes)]
    for part, byte in used[:: max(1, len(used) // 400)]:
        original = int(part[byte])
        part[byte] = original ^ (1 << (byte % 8))
        try:
            decoded = decode_chunk(static, dynamic, backend=backend)
        except CodecError:
            decoded = None
        finally:
            part[byte] = original
        if decoded is not None:  # only padding bytes may change without effect
            assert torch.equal(bits(decoded), bits(tensor)), f"byte {byte} gave wrong values"


@pytest.mark.skipif(NATIVE_MISSING is not None, reason=f"C codec kernel: {NATIVE_MISSING}")
def test_native_decoder_rejects_escape_codes_that_do_not_match_the_header():
    tensor = torch.randn(5000).bfloat16()
    tensor[::7] = float("nan")
    out = compress(tensor, backend="native")
    static, dynamic = out.chunk(0)
    tampered = static.clone()
    tampered[32] += 1  # first tile index entry
    tampered[36] += 1  # second: the decoder checks it against the escapes it used
    with pytest.raises(CodecError, match="corrupt"):
        decode_chunk(tampered, dynamic, backend="native")


def test_formats_describe_their_dtypes():
    for fmt in (BF16, FP16, FP32):
        assert 1 + fmt.exp_bits + fmt.man_bits == 8 * torch.finfo(fmt.dtype).bits // 8
        assert fmt.raw_bytes * 8 + fmt.extra_planes == fmt.sm_bits
