"""The CUDA codec kernels' logic on the CPU: `cuda_emulation.cpp` built with g++ and
wrapped in the interface of the torch extension, so `cuda_kernels.encode_chunk` and
`decode_chunk` run unchanged on CPU tensors."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import torch

from ray_zep.collectives.format import BLOCK_VALUES, TILE_VALUES

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
    """Same methods and arguments as the JIT-built extension of `cuda/zipccl.cu`; the
    scratch the extension allocates on the device is filled with garbage here, so a byte
    the kernels should write but do not shows."""

    def __init__(self, lib: ctypes.CDLL, order: int = 0) -> None:
        """`order`: 0 runs the blocks in index order, else shuffled with that seed."""
        self.lib, self.order = lib, order

    def encode(self, values, static, room):
        self.lib.emu_set_order(ctypes.c_uint(self.order))
        n = values.numel()
        blocks, tiles = -(-n // BLOCK_VALUES), -(-n // TILE_VALUES)
        code_of = _garbage(blocks * 256, torch.uint8)
        status, sums = _garbage(tiles, torch.int64), _garbage(blocks, torch.int64)
        self.lib.emu_encode(
            _p(values), ctypes.c_int64(n), _p(static), _p(room), _p(code_of), _p(status),
            _p(sums),
        )  # fmt: skip

    def decode(self, static, dynamic, out, status):
        self.lib.emu_set_order(ctypes.c_uint(self.order))
        shares = _garbage(-(-out.numel() // TILE_VALUES), torch.int64)
        self.lib.emu_decode(
            _p(static), _p(dynamic), ctypes.c_int64(dynamic.numel()), ctypes.c_int64(out.numel()),
            _p(out), _p(shares), _p(status),
        )  # fmt: skip


def _garbage(numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randint(0, 256, (numel * torch.empty(0, dtype=dtype).element_size(),),
                         dtype=torch.uint8).view(dtype)  # fmt: skip
