"""Native codec kernels: C on the CPU, CUDA on a GPU, built on first use.

The C kernel (`cuda/zipccl_cpu.c`) is compiled with the system C compiler into
the ray_zep cache directory and called through ctypes; the CUDA kernel
(`cuda/zipccl.cu`) is built with torch's extension loader when a GPU and nvcc
are present (`cuda_kernels.py`). Both write exactly the bytes of the torch
reference; `unavailable_reason` says why a kernel cannot be used, so callers
never fall back silently.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from ray_zep import constants
from ray_zep.collectives import cuda_kernels, reference
from ray_zep.collectives.format import (
    HEADER_BYTES,
    FloatFormat,
    Header,
    Layout,
    dynamic_bytes,
)
from ray_zep.collectives.reference import code_lookup
from ray_zep.errors import CodecError

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parents[2] / "cuda" / "zipccl_cpu.c"
_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


class _Sections(ctypes.Structure):
    _fields_ = [
        ("tile_index", ctypes.c_void_p),
        ("raw", ctypes.c_void_p),
        ("planes", ctypes.c_void_p * 6),
    ]


def unavailable_reason(device: torch.device, fmt: FloatFormat) -> str | None:
    """None when a native kernel serves this device and dtype, else why not (asked once)."""
    return _unavailable_reason(device.type, fmt)


@functools.cache
def _unavailable_reason(device_type: str, fmt: FloatFormat) -> str | None:
    if device_type == "cuda":
        return cuda_kernels.unavailable_reason(fmt)
    if device_type != "cpu":
        return f"no native kernel for device type {device_type!r}"
    try:
        _library()
    except CodecError as exc:
        return str(exc)
    return None


def encode_chunk(
    flat_N: torch.Tensor, fmt: FloatFormat, table: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `reference.encode_chunk`."""
    if flat_N.is_cuda:
        return cuda_kernels.encode_chunk(flat_N, fmt, table)
    n = flat_N.numel()
    layout = Layout.of(n, fmt)
    static = torch.empty(layout.static_bytes, dtype=torch.uint8)
    escapes = torch.empty(max(n, 1), dtype=torch.uint8)
    code_of = code_lookup(table, fmt, flat_N.device).to(torch.uint8)
    sections = _sections(static, layout)
    encode = getattr(_library(), f"zc_encode_{_NAMES[fmt.dtype]}")
    n_escapes = encode(_ptr(flat_N), n, _ptr(code_of), ctypes.byref(sections), _ptr(escapes))
    header = Header(fmt, table, n, n_escapes, checksum(flat_N, fmt))
    static[:HEADER_BYTES] = _header_bytes(header)
    _zero_gaps(static, layout)
    dynamic = torch.zeros(dynamic_bytes(n_escapes), dtype=torch.uint8)
    dynamic[:n_escapes] = escapes[:n_escapes]
    return static, dynamic


def decode_chunk(static: torch.Tensor, dynamic: torch.Tensor, header: Header) -> torch.Tensor:
    """Same contract as `reference.decode_chunk`."""
    if static.is_cuda:
        return cuda_kernels.decode_chunk(static, dynamic, header)
    fmt, n = header.fmt, header.n_values
    static = static.contiguous()
    escapes = torch.zeros(header.n_escapes + 1, dtype=torch.uint8)
    escapes[: header.n_escapes] = dynamic[: header.n_escapes]
    out = torch.empty(n, dtype=fmt.dtype)
    table8 = torch.tensor((0, *header.table), dtype=torch.uint8)
    sections = _sections(static, header.layout)
    decode = getattr(_library(), f"zc_decode_{_NAMES[fmt.dtype]}")
    status = decode(
        ctypes.byref(sections), _ptr(escapes), header.n_escapes, _ptr(table8), n, _ptr(out)
    )
    if status != 0:
        raise CodecError(
            f"corrupt chunk: escape codes do not match the {header.n_escapes} escapes "
            "and the tile index of its header"
        )
    return out


def checksum(flat_N: torch.Tensor, fmt: FloatFormat) -> int:
    """Same contract as `reference.checksum`, for contiguous values on the CPU."""
    if flat_N.is_cuda:
        return reference.checksum(flat_N, fmt)
    name = "u16" if fmt.value_bytes == 2 else "u32"
    return int(getattr(_library(), f"zc_checksum_{name}")(_ptr(flat_N), flat_N.numel()))


def _sections(static: torch.Tensor, layout: Layout) -> _Sections:
    base = static.data_ptr()
    planes = (ctypes.c_void_p * 6)(*[base + off for off in (*layout.extra, *layout.codes)])
    return _Sections(base + layout.tile_index, base + layout.raw, planes)


def _zero_gaps(static: torch.Tensor, layout: Layout) -> None:
    """Zero the padding after each section (the kernel writes only the sections)."""
    fmt, n = layout.fmt, layout.n_values
    ends = [
        (layout.tile_index + 4 * layout.tiles, layout.raw),
        (layout.raw + fmt.raw_bytes * n, (layout.extra or layout.codes)[0]),
    ]
    planes = [*layout.extra, *layout.codes, layout.static_bytes]
    ends += [(start + layout.plane_bytes, nxt) for start, nxt in itertools.pairwise(planes)]
    for start, stop in ends:
        static[start:stop] = 0


def _header_bytes(header: Header) -> torch.Tensor:
    return torch.frombuffer(bytearray(header.pack()), dtype=torch.uint8)


def _ptr(tensor: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(tensor.data_ptr())


@functools.cache
def _library() -> ctypes.CDLL:
    path = _build()
    lib = ctypes.CDLL(str(path))
    for name in _NAMES.values():
        encode = getattr(lib, f"zc_encode_{name}")
        encode.restype = ctypes.c_int64
        encode.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                           ctypes.POINTER(_Sections), ctypes.c_void_p]  # fmt: skip
        decode = getattr(lib, f"zc_decode_{name}")
        decode.restype = ctypes.c_int
        decode.argtypes = [ctypes.POINTER(_Sections), ctypes.c_void_p, ctypes.c_int64,
                           ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]  # fmt: skip
    for name in ("u16", "u32"):
        check = getattr(lib, f"zc_checksum_{name}")
        check.restype = ctypes.c_uint32
        check.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    return lib


def _build() -> Path:
    """Compile the C kernel once per source version; atomic so concurrent ranks can race."""
    if not SOURCE.is_file():
        raise CodecError(f"C kernel source {SOURCE} is missing from this installation")
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise CodecError("no C compiler (cc or gcc) on PATH to build the CPU codec kernel")
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    target = constants.cache_dir() / "native" / f"zipccl_cpu_{digest}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        cmd = [compiler, "-O3", "-std=c99", "-shared", "-fPIC", "-o", str(built), str(SOURCE)]
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise CodecError(f"building the CPU codec kernel failed: {result.stderr.strip()}")
        os.replace(built, target)
    log.info("built the CPU codec kernel: %s", target)
    return target
