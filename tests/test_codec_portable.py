"""The C kernel's plain-C path (built with ZC_PORTABLE, as on CPUs without SSE2) writes the
reference's bytes and rejects damaged chunks like the SIMD path the other tests exercise."""

from __future__ import annotations

import ctypes

import pytest
import torch

from ray_zep.collectives import compress, decompress, native
from ray_zep.collectives.codec import decode_chunk
from ray_zep.collectives.format import BF16, BLOCK_VALUES, float_format
from ray_zep.errors import CodecError

pytestmark = pytest.mark.unit

NATIVE_MISSING = native.unavailable_reason(torch.device("cpu"), BF16)


@pytest.fixture
def portable(monkeypatch) -> None:
    if NATIVE_MISSING is not None:
        pytest.skip(f"C codec kernel: {NATIVE_MISSING}")
    kernels = native.Kernels(ctypes.CDLL(str(native._build(("ZC_PORTABLE",)))))
    monkeypatch.setattr(native, "_library", lambda: kernels)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(float_format(tensor.dtype).int_dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n", [0, 1, 15, 17, 1000, BLOCK_VALUES + 7, 3 * BLOCK_VALUES])
def test_portable_c_path_writes_the_reference_bytes(portable, dtype, n):
    gen = torch.Generator().manual_seed(n)
    scale = 10.0 ** (torch.arange(n) // BLOCK_VALUES * 3 - 3)
    tensor = (torch.randn(n, generator=gen) * scale).to(dtype)
    tensor[::9] = 1e-30  # escapes
    splits = [n // 3, n - n // 3]
    ours, ref = (
        compress(tensor, splits, backend="native"),
        compress(tensor, splits, backend="torch"),
    )
    assert torch.equal(ours.static, ref.static) and torch.equal(ours.dynamic, ref.dynamic)
    assert torch.equal(bits(decompress(ref, backend="native")), bits(tensor))


def test_portable_c_path_rejects_a_damaged_chunk(portable):
    tensor = torch.randn(5000, generator=torch.Generator().manual_seed(1)).bfloat16()
    static, dynamic = compress(tensor, backend="native").chunk(0)
    static[static.numel() // 2] ^= 4  # a raw byte: only the checksum can tell
    with pytest.raises(CodecError, match="checksum"):
        decode_chunk(static, dynamic, backend="native")
