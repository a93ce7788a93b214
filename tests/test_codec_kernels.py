"""The CUDA codec kernel writes the reference's bytes.

On a GPU the JIT-built kernel is compared directly, and compressing and decoding
are checked to take two launches each and no wait for the device. Everywhere
else the same kernel source runs on the CPU under a thread-per-CUDA-thread
emulation (tests/helpers/cuda_emulation.cpp), through the same host code, which
checks the kernels' logic (indexing, the block scan, the look-back over tiles,
escape order, tails, the header and padding they write, the verdicts) but not
the CUDA toolchain.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ray_zep.collectives import compress, cuda_kernels, decompress, reference
from ray_zep.collectives.codec import Compressed, decode_chunk, read_header
from ray_zep.collectives.format import BF16, BLOCK_VALUES, TILE_VALUES, Layout
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
@pytest.mark.parametrize("order", [0, 7])
def test_cuda_kernel_logic_writes_every_byte_of_the_static_part_and_the_dynamic_part(
    emulated, order
):
    """The static part and the room come from torch.empty on a GPU: no byte may be left.
    Order 7 runs the tiles shuffled, so their look-backs add up aggregates and prefixes."""
    n = 2 * BLOCK_VALUES + 5
    values = sample(n, seed=11)
    static = torch.full((Layout.of(n, BF16).static_bytes,), 0xA5, dtype=torch.uint8)
    room = torch.full((cuda_kernels.room_bytes(n),), 0xA5, dtype=torch.uint8)
    kernels = EmulatedKernels(emulated.lib, order)
    cuda_kernels.encode_into(values, static, room, kernels=kernels)
    ref_static, ref_dynamic = reference.encode_chunk(values, BF16)
    assert torch.equal(static, ref_static), "a static byte differs (unwritten padding?)"
    assert torch.equal(room[: ref_dynamic.numel()], ref_dynamic)


@pytest.mark.unit
@pytest.mark.parametrize(
    "splits", [(TILE_VALUES + 5, 0, 2 * TILE_VALUES + 3, 9), (3 * TILE_VALUES + 7,)],
    ids=["chunks", "one chunk, no views cut"],
)  # fmt: skip
def test_cuda_kernel_logic_leaves_the_lengths_on_the_device_until_they_are_used(emulated, splits):
    values = sample(sum(splits), seed=3)
    parts = cuda_kernels.encode_chunks(values, BF16, splits, kernels=emulated)
    static, rooms, static_sizes, room_sizes = parts
    zipped = Compressed(static, rooms, static_sizes, None, splits, values.dtype, values.shape,
                        room_sizes)  # fmt: skip
    assert not zipped.sizes_known
    decoded, _ = cuda_kernels.decode_chunks(zipped.decodable(), splits, values.device, emulated)
    assert torch.equal(decoded.view(torch.int16), values.view(torch.int16))
    assert not zipped.sizes_known, "decoding needs no length on the host"
    want = compress(values, splits, backend="torch")
    assert torch.equal(zipped.dynamic, want.dynamic) and zipped.sizes_known
    assert zipped.dynamic_sizes == want.dynamic_sizes and torch.equal(zipped.static, want.static)
    assert torch.equal(zipped.packed(), want.packed())


def _damage(static, dynamic, header, how):
    layout = header.layout
    if how == "magic":
        static[0] ^= 0x01
    elif how == "tile index":
        static[layout.tile_index + 4] += 1  # tile 1 starts one escape late
    elif how == "escape count":
        static[24] += 1
    elif how == "truncated":
        dynamic = dynamic[: header.n_escapes - 1]
    else:
        static[layout.raw + 1000] ^= 0x01  # one mantissa bit of value 1000
    return static, dynamic


@pytest.mark.unit
@pytest.mark.parametrize(
    "how, message",
    [("magic", "not a ZipCCL"), ("tile index", "escape codes"), ("escape count", "escape codes"),
     ("truncated", "truncated"), ("checksum", "checksum")],
)  # fmt: skip
def test_cuda_kernel_logic_gives_the_verdict_when_it_is_read(emulated, how, message):
    values = sample(2 * TILE_VALUES + 77, seed=5)
    static, dynamic = cuda_kernels.encode_chunk(values, BF16, kernels=emulated)
    header = read_header(static)
    static, dynamic = _damage(static, dynamic, header, how)
    chunks, count = [(static, dynamic)], (values.numel(),)
    _, verdict = cuda_kernels.decode_chunks(chunks, count, static.device, emulated, checked=False)
    with pytest.raises(CodecError, match=message):
        verdict.check()


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


@pytest.mark.gpu
@pytest.mark.skipif(GPU_MISSING is not None, reason=f"CUDA codec kernel: {GPU_MISSING}")
def test_cuda_kernel_cuts_chunks_and_reads_their_lengths_once_on_a_gpu():
    splits = [5000, 0, 40000, 3]
    values = sample(sum(splits), seed=9)
    on_gpu = compress(values.cuda(), splits, backend="native")
    assert not on_gpu.sizes_known
    back = decompress(on_gpu, backend="native")
    assert torch.equal(back.cpu().view(torch.int16), values.view(torch.int16))
    on_cpu = compress(values, splits, backend="torch")
    assert torch.equal(on_gpu.packed().cpu(), on_cpu.packed())
    for i, want in enumerate(values.split(splits)):
        one = decode_chunk(*on_gpu.chunk(i), backend="native")
        assert torch.equal(one.cpu().view(torch.int16), want.view(torch.int16))


def _cuda_launches(fn) -> list[str]:
    """Names of the kernels (and copies, fills) `fn` puts on the GPU."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.gpu
@pytest.mark.skipif(GPU_MISSING is not None, reason=f"CUDA codec kernel: {GPU_MISSING}")
def test_cuda_kernel_compresses_and_decodes_in_two_launches_each_without_waiting():
    values = sample(1 << 20, seed=2).cuda()
    device = values.device
    compress(values, backend="native").resolve()  # JIT build and allocator warm-up
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing call raises
    try:
        zipped = compress(values, backend="native")
        out, verdict = cuda_kernels.decode_chunks(
            zipped.decodable(), zipped.chunk_values, device, checked=False
        )
    finally:
        torch.cuda.set_sync_debug_mode(0)
    verdict.check()
    assert torch.equal(out.view(torch.int16), values.view(torch.int16))
    launches = _cuda_launches(lambda: compress(values, backend="native"))
    assert len(launches) == 2 and all("zc_" in name for name in launches), launches
    launches = _cuda_launches(
        lambda: cuda_kernels.decode_chunks(
            zipped.decodable(), zipped.chunk_values, device, checked=False
        )
    )
    assert len(launches) == 2 and all("zc_" in name for name in launches), launches


@pytest.mark.gpu
@pytest.mark.skipif(GPU_MISSING is not None, reason=f"CUDA codec kernel: {GPU_MISSING}")
def test_cuda_kernel_refuses_a_damaged_chunk_on_a_gpu():
    values = sample(BLOCK_VALUES + 77, seed=5).cuda()
    zipped = compress(values, backend="native").resolve()
    zipped.static[Layout.of(values.numel(), BF16).raw + 1000] ^= 0x01
    with pytest.raises(CodecError, match="checksum"):
        decompress(zipped, backend="native")
