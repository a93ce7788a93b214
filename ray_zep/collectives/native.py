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
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from ray_zep import constants
from ray_zep.collectives import cuda_kernels, reference
from ray_zep.collectives.format import CHUNK_ALIGN, FloatFormat, Layout, align
from ray_zep.errors import CodecError

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parents[2] / "cuda" / "zipccl_cpu.c"
_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_ERRORS = {
    1: "not a ZipCCL v3 chunk of {dtype} (magic, version, format or header fields)",
    2: "the chunk's header holds a different number of values than the {values} expected",
    3: "truncated chunk: {static} + {dynamic} bytes are fewer than its header announces",
    4: "corrupt chunk: escape codes do not match the escapes and the tile index of its header",
    5: "corrupt chunk: the checksum of its {values} decoded values does not match its header",
}
"""zc_decompress_* status -> CodecError message."""


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


def encode_chunks(
    flat_N: torch.Tensor, fmt: FloatFormat, chunk_values: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """Same contract as `reference.encode_chunks`: one C call for all chunks on the CPU."""
    if flat_N.is_cuda:
        return reference.encode_each(flat_N, fmt, chunk_values, cuda_kernels.encode_chunk)
    static_sizes = tuple(Layout.of(n, fmt).static_bytes for n in chunk_values)
    static = torch.empty(sum(static_sizes), dtype=torch.uint8)
    room = sum(align(n, CHUNK_ALIGN) for n in chunk_values)
    scratch = torch.empty(room, dtype=torch.uint8)
    count = len(chunk_values)
    dynamic_sizes = (ctypes.c_int64 * count)()
    used = _library().compress[fmt.code](
        flat_N.data_ptr(),
        (ctypes.c_int64 * count)(*chunk_values),
        count,
        static.data_ptr(),
        scratch.data_ptr(),
        dynamic_sizes,
    )
    dynamic = scratch if used == room else scratch[:used].clone()  # free the unused room
    return static, dynamic, static_sizes, tuple(dynamic_sizes)


def decode_chunks(
    chunks: list[tuple[torch.Tensor, torch.Tensor]], chunk_values: tuple[int, ...], fmt: FloatFormat
) -> torch.Tensor:
    """Same contract as `reference.decode_chunks`: one C call for all chunks on the CPU."""
    if chunks and chunks[0][0].is_cuda:
        return reference.decode_each(chunks, chunk_values, fmt, cuda_kernels.decode_chunk)
    chunks = [(s.contiguous(), d.contiguous()) for s, d in chunks]
    count = len(chunks)
    out = torch.empty(sum(chunk_values), dtype=fmt.dtype)
    failed = ctypes.c_int64(0)
    status = _library().decompress[fmt.code](
        (ctypes.c_void_p * count)(*[s.data_ptr() for s, _ in chunks]),
        (ctypes.c_int64 * count)(*[s.numel() for s, _ in chunks]),
        (ctypes.c_void_p * count)(*[d.data_ptr() for _, d in chunks]),
        (ctypes.c_int64 * count)(*[d.numel() for _, d in chunks]),
        (ctypes.c_int64 * count)(*chunk_values),
        count,
        out.data_ptr(),
        ctypes.byref(failed),
    )
    if status != 0:
        static, dynamic = chunks[failed.value]
        raise CodecError(
            _ERRORS[status].format(
                dtype=str(fmt.dtype).removeprefix("torch."),
                values=chunk_values[failed.value],
                static=static.numel(),
                dynamic=dynamic.numel(),
            )
        )
    return out


class Kernels:
    """The C entry points of a built kernel, by float format code."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.compress, self.decompress = {}, {}
        for fmt_code, name in ((1, "bf16"), (2, "fp16"), (3, "fp32")):
            compress = getattr(lib, f"zc_compress_{name}")
            compress.restype = ctypes.c_int64
            compress.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                 ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]  # fmt: skip
            decompress = getattr(lib, f"zc_decompress_{name}")
            decompress.restype = ctypes.c_int
            decompress.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64, ctypes.c_void_p,
                                                           ctypes.c_void_p]  # fmt: skip
            self.compress[fmt_code], self.decompress[fmt_code] = compress, decompress


@functools.cache
def _library() -> Kernels:
    return Kernels(ctypes.CDLL(str(_build())))


def _build(defines: tuple[str, ...] = ()) -> Path:
    """Compile the C kernel once per source version and `defines` (e.g. "ZC_PORTABLE", the
    plain-C path the tests check on x86 too); atomic so concurrent ranks can race."""
    if not SOURCE.is_file():
        raise CodecError(f"C kernel source {SOURCE} is missing from this installation")
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise CodecError("no C compiler (cc or gcc) on PATH to build the CPU codec kernel")
    flags = [f"-D{name}" for name in defines]
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(flags).encode()).hexdigest()[:16]
    target = constants.cache_dir() / "native" / f"zipccl_cpu_{digest}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        cmd = [
            compiler,
            "-O3",
            "-std=c99",
            *flags,
            "-shared",
            "-fPIC",
            "-o",
            str(built),
            str(SOURCE),
        ]
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise CodecError(f"building the CPU codec kernel failed: {result.stderr.strip()}")
        os.replace(built, target)
    log.info("built the CPU codec kernel: %s", target)
    return target
