"""The CUDA codec kernel writes the reference's bytes.

On a GPU the JIT-built kernel is compared directly. Everywhere else the same
kernel source runs on the CPU under a thread-per-CUDA-thread emulation
(tests/helpers/cuda_emulation.cpp), through the same host code, which checks
the kernels' logic (indexing, the block scan, escape order, tails) but not
the CUDA toolchain.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ray_zep.collectives import compress, cuda_kernels, decompress, reference
from ray_zep.collectives.codec import read_header
from ray_zep.collectives.format import BF16, BLOCK_VALUES, TILE_VALUES
from ray_zep.errors import CodecError
from tests.helpers.cuda_emulation import EmulatedKernels, build

SIZES = [0, 1, 7, 8, 9, 1000, TILE_VALUES, TILE_VALUES + 1, 3 * TILE_VALUES + 333, BLOCK_VALUES]
SIZES += [2 * BLOCK_VALUES + TILE_VALUES + 5]


def sample(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    scale = 10.0 ** (torch.arange(n) // BLOCK_VALUES * 4 - 2)  # every block its own table
    values = (torch.randn(n, generator=gen) * scale).bfloat16()
    values[:: 5] = torch.randint(-(2**15), 2**15, values[:: 5].shape, generator=gen,
                                 dtype=torch.int16).view(torch.bfloat16)  # fmt: skip
    return values


@pytest.fixture(scope="module")
def emulated(tmp_path_factory) -> EmulatedKernels:
    try:
        return EmulatedKernels(build(Path(tmp_path_factory.mktemp("emu"))))
    except RuntimeError as exc:
        pytest.skip(f"cannot build the CUDA-kernel emulation with g++ -std=c++20: {exc}")


@pytest.mark.unit
@pytest.mark.parametrize("n", SIZES)
def test_cuda_kernel_logic_writes_the_reference_bytes(emulated, n):
    values = sample(n, seed=n)
    static, dynamic = cuda_kernels.encode_chunk(values, BF16, kernels=emulated)
    ref_static, ref_dynamic = reference.encode_chunk(values, BF16)
    assert torch.equal(static, ref_static), "static part differs from the reference"
    assert torch.equal(dynamic, ref_dynamic), "escapes differ from the reference"
    decoded = cuda_kernels.decode_chunk(static, dynamic, read_header(static), kernels=emulated)
    assert torch.equal(decoded.view(torch.int16), values.view(torch.int16))


@pytest.mark.unit
@pytest.mark.parametrize("offset", [1, 3, 8])
def test_cuda_kernel_logic_codes_a_chunk_that_starts_unaligned(emulated, offset):
    """A chunk cut from a longer tensor starts anywhere: the kernels' 16- and 8-byte loads and
    stores give way to single values there."""
    n = BLOCK_VALUES + 2 * TILE_VALUES + 13
    values = sample(n + offset, seed=offset)[offset:]
    static, dynamic = cuda_kernels.encode_chunk(values, BF16, kernels=emulated)
    ref_static, ref_dynamic = reference.encode_chunk(values, BF16)
    assert torch.equal(static, ref_static) and torch.equal(dynamic, ref_dynamic)
    decoded = cuda_kernels.decode_chunk(static, dynamic, read_header(static), kernels=emulated)
    assert torch.equal(decoded.view(torch.int16), values.view(torch.int16))


@pytest.mark.unit
def test_cuda_kernel_logic_checks_the_decoded_checksum(emulated):
    values = sample(BLOCK_VALUES + 77, seed=5)
    static, dynamic = cuda_kernels.encode_chunk(values, BF16, kernels=emulated)
    header = read_header(static)
    static[header.layout.raw + 1000] ^= 0x01  # one mantissa bit of value 1000
    with pytest.raises(CodecError, match="checksum"):
        cuda_kernels.decode_chunk(static, dynamic, header, kernels=emulated)


GPU_MISSING = cuda_kernels.unavailable_reason(BF16)


@pytest.mark.gpu
@pytest.mark.skipif(GPU_MISSING is not None, reason=f"CUDA codec kernel: {GPU_MISSING}")
@pytest.mark.parametrize("n, offset", [*((n, 0) for n in SIZES), (1 << 22, 0), (40000, 3)])
def test_cuda_kernel_writes_the_reference_bytes_on_a_gpu(n, offset):
    whole = sample(n + offset, seed=n)
    values = whole[offset:]
    on_gpu = compress(whole.cuda()[offset:], backend="native")  # unaligned where offset > 0
    on_cpu = compress(values, backend="torch")
    assert torch.equal(on_gpu.static.cpu(), on_cpu.static)
    assert torch.equal(on_gpu.dynamic.cpu(), on_cpu.dynamic)
    back = decompress(on_gpu, backend="native")
    assert torch.equal(back.cpu().view(torch.int16), values.view(torch.int16))
