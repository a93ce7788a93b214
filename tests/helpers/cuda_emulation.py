"""The CUDA codec kernels' logic on the CPU: `cuda_emulation.cpp` built with g++ and
wrapped in the interface of the torch extension, so `cuda_kernels.encode_chunk` and
`decode_chunk` run unchanged on CPU tensors."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import torch

from ray_zep.collectives.format import BLOCK_VALUES

ROOT = Path(__file__).resolve().parents[2]


def build(out_dir: Path) -> ctypes.CDLL:
    compiler = shutil.which("g++")
    if compiler is None:
        raise RuntimeError("g++ is not on PATH")
    target = out_dir / "cuda_emulation.so"
    source = Path(__file__).with_name("cuda_emulation.cpp")
    flags = ["-std=c++20", "-O1", "-shared", "-fPIC", f"-I{ROOT / 'cuda'}", "-lpthread"]
    cmd = [compiler, *flags, str(source), "-o", str(target)]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(result.stderr.strip().splitlines()[0])
    return ctypes.CDLL(str(target))


def _p(tensor: torch.Tensor, offset: int = 0) -> ctypes.c_void_p:
    return ctypes.c_void_p(tensor.data_ptr() + offset)


class EmulatedKernels:
    """Same methods and arguments as the JIT-built extension of `cuda/zipccl.cu`."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib

    def tables(self, values, tiles, table_bytes):
        blocks = -(-values.numel() // BLOCK_VALUES)
        code_of = torch.empty((blocks, 256), dtype=torch.uint8)
        counts = torch.empty(tiles, dtype=torch.int64)  # as the extension: the kernel fills
        sums = torch.empty(blocks, dtype=torch.int64)
        self.lib.emu_tables(
            _p(values), ctypes.c_int64(values.numel()), ctypes.c_int64(tiles), _p(code_of),
            _p(table_bytes), _p(counts), _p(sums), ctypes.c_int64(blocks),
        )  # fmt: skip
        return code_of, counts, sums

    def encode(self, values, code_of, tile_index, static, raw_offset, code_offsets, dynamic):
        tiles = tile_index.numel()
        planes = [_p(static, off) for off in code_offsets]
        self.lib.emu_encode(
            _p(values), ctypes.c_int64(values.numel()), _p(code_of), _p(tile_index),
            _p(static, raw_offset), *planes, _p(dynamic), ctypes.c_int64(tiles),
        )  # fmt: skip

    def decode(self, static, raw_offset, code_offsets, tile_index, dynamic, table8, out, sums):
        planes = [_p(static, off) for off in code_offsets]
        self.lib.emu_decode(
            _p(static, raw_offset), *planes, _p(tile_index), _p(dynamic), _p(table8),
            ctypes.c_int64(out.numel()), _p(out), _p(sums), ctypes.c_int64(tile_index.numel()),
        )  # fmt: skip
