"""The CUDA codec kernel (`cuda/zipccl.cu`), JIT-built with torch's extension loader.

Built on first use when torch sees a GPU and nvcc is found; BF16 only (FP16 and
FP32 tensors on a GPU use the torch reference, which `unavailable_reason` says).
Encoding takes two launches: the first picks each block's table (the rule of
`table.py`), writes it into the chunk, counts the escapes of each 1024-value
tile and adds up each block's share of the checksum; torch turns the counts
into the tile index (an exclusive prefix sum), and the second launch writes the
planes and the escapes at their tile's offset, so the bytes are deterministic
and equal to the reference's. The escape count and the checksum reach the host
in one wait (the header needs them). Decoding is one launch, which also adds up
each tile's share of the checksum of what it decoded.
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path
from types import ModuleType

import torch

from ray_zep.collectives.format import (
    BLOCK_VALUES,
    HEADER_BYTES,
    TABLE_BYTES,
    TILE_VALUES,
    FloatFormat,
    Header,
    Layout,
    dynamic_bytes,
)
from ray_zep.collectives.reference import CHECKSUM_MASK, check_total
from ray_zep.errors import CodecError

SOURCE = Path(__file__).resolve().parents[2] / "cuda" / "zipccl.cu"


def unavailable_reason(fmt: FloatFormat) -> str | None:
    """None when the CUDA kernel can code `fmt` here, else why not."""
    if fmt.dtype is not torch.bfloat16:
        return f"the CUDA kernel codes bfloat16 only, not {fmt.dtype}"
    if not torch.cuda.is_available():
        return "torch sees no CUDA GPU"
    if shutil.which("nvcc") is None and not _cuda_home_nvcc():
        return "nvcc is not on PATH (set CUDA_HOME) to build the CUDA codec kernel"
    try:
        _extension()
    except Exception as exc:  # the loader raises several types; report any
        return f"building the CUDA codec kernel failed: {exc}"
    return None


def encode_chunk(
    flat_N: torch.Tensor, fmt: FloatFormat, kernels=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `reference.encode_chunk`, for a bfloat16 tensor on a GPU.

    `kernels` replaces the built extension (tests run the kernels' logic elsewhere).
    """
    ext, n = kernels or _extension(), flat_N.numel()
    layout = Layout.of(n, fmt)
    values = flat_N.view(torch.int16)
    static = torch.zeros(layout.static_bytes, dtype=torch.uint8, device=flat_N.device)
    tables = static[layout.tables : layout.tables + TABLE_BYTES * layout.blocks]
    code_of_KE, counts_T, sums_K = ext.tables(values, layout.tiles, tables)
    index_T = (torch.cumsum(counts_T, 0) - counts_T).to(torch.int32)
    n_escapes, total = (int(x) for x in torch.stack([counts_T.sum(), sums_K.sum()]).tolist())
    dynamic = torch.zeros(dynamic_bytes(n_escapes), dtype=torch.uint8, device=flat_N.device)
    header = Header(fmt, n, n_escapes, total & CHECKSUM_MASK)
    header = torch.frombuffer(bytearray(header.pack()), dtype=torch.uint8)
    static[:HEADER_BYTES] = header.to(flat_N.device)
    static[layout.tile_index : layout.tile_index + 4 * layout.tiles] = index_T.view(torch.uint8)
    ext.encode(
        values,
        code_of_KE,
        index_T,
        static,
        layout.raw,
        list(layout.codes),
        dynamic,
    )
    return static, dynamic


def decode_chunk(
    static: torch.Tensor, dynamic: torch.Tensor, header: Header, kernels=None
) -> torch.Tensor:
    """Same contract as `reference.decode_chunk`, on the GPU that holds `static`, and the
    decoded values' checksum checked against the header's.

    Raises:
        CodecError: the checksums differ.
    """
    layout = header.layout
    tables_K8 = static[layout.tables : layout.tables + TABLE_BYTES * layout.blocks]
    table8_K8 = tables_K8.view(-1, TABLE_BYTES).roll(1, dims=1).contiguous()
    table8_K8[:, 0] = 0  # code 0 is an escape (its field comes from the dynamic part)
    out = torch.empty(header.n_values, dtype=torch.int16, device=static.device)
    sums_T = torch.empty(layout.tiles, dtype=torch.int64, device=static.device)  # all written
    index_bytes = static[layout.tile_index : layout.tile_index + 4 * layout.tiles]
    (kernels or _extension()).decode(
        static.contiguous(),
        layout.raw,
        list(layout.codes),
        index_bytes.clone().view(torch.int32),
        dynamic.contiguous(),
        table8_K8,
        out,
        sums_T,
    )
    check_total(int(sums_T.sum()), header)
    return out.view(torch.bfloat16)


def _cuda_home_nvcc() -> bool:
    from torch.utils.cpp_extension import CUDA_HOME

    return CUDA_HOME is not None and (Path(CUDA_HOME) / "bin" / "nvcc").is_file()


@functools.cache
def _extension() -> ModuleType:
    from torch.utils.cpp_extension import load

    if not SOURCE.is_file():
        raise CodecError(f"CUDA kernel source {SOURCE} is missing from this installation")
    return load(
        name="ray_zep_zipccl",
        sources=[str(SOURCE)],
        extra_cuda_cflags=[
            "-O3",
            f"-DZC_TILE_VALUES={TILE_VALUES}",
            f"-DZC_BLOCK_VALUES={BLOCK_VALUES}",
        ],
        verbose=False,
    )
