"""Where the CUDA codec's time goes: each stage of `cuda_kernels.encode_chunk` and
`decode_chunk`, timed alone (median of 20, synchronised), at 1, 16 and 256 MiB of
Gaussian BF16 (sigma 0.02). Writes JSON to argv[1]."""
import json
import statistics
import sys
import time

import torch

from ray_zep.collectives import compress, cuda_kernels, decompress
from ray_zep.collectives.codec import read_header
from ray_zep.collectives.format import BF16, HEADER_BYTES, TABLE_BYTES, Header, Layout, dynamic_bytes


def timed(fn, repeats=20):
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


ext = cuda_kernels._extension()
rows = []
for mib in (1, 16, 256):
    n = mib << 19
    x = (torch.randn(n, device="cuda") * 0.02).bfloat16()
    values = x.view(torch.int16)
    layout = Layout.of(n, BF16)
    static = torch.zeros(layout.static_bytes, dtype=torch.uint8, device="cuda")
    tables = static[layout.tables : layout.tables + TABLE_BYTES * layout.blocks]
    code_of, counts, sums = ext.tables(values, layout.tiles, tables)
    index = (torch.cumsum(counts, 0) - counts).to(torch.int32)
    n_esc = int(counts.sum())
    dynamic = torch.zeros(dynamic_bytes(n_esc), dtype=torch.uint8, device="cuda")
    stage = {
        "zeros static": lambda: torch.zeros(layout.static_bytes, dtype=torch.uint8, device="cuda"),
        "tables kernel": lambda: ext.tables(values, layout.tiles, tables),
        "cumsum index": lambda: (torch.cumsum(counts, 0) - counts).to(torch.int32),
        "sync for count + checksum": lambda: torch.stack([counts.sum(), sums.sum()]).tolist(),
        "zeros dynamic": lambda: torch.zeros(dynamic_bytes(n_esc), dtype=torch.uint8, device="cuda"),
        "header to GPU": lambda: static[:HEADER_BYTES].copy_(torch.frombuffer(bytearray(Header(BF16, n, n_esc, 0).pack()), dtype=torch.uint8)),
        "index copy": lambda: static[layout.tile_index : layout.tile_index + 4 * layout.tiles].copy_(index.view(torch.uint8)),
        "encode kernel": lambda: ext.encode(values, code_of, index, static, layout.raw, list(layout.codes), dynamic),
        "encode_chunk": lambda: cuda_kernels.encode_chunk(x, BF16),
        "compress": lambda: compress(x, backend="native"),
    }
    packed = compress(x, backend="native")
    s, d = packed.chunk(0)
    header = read_header(s)
    stage |= {
        "read header": lambda: read_header(s),
        "decode_chunk": lambda: cuda_kernels.decode_chunk(s, d, header),
        "decompress": lambda: decompress(packed, backend="native"),
    }
    for name, fn in stage.items():
        sec = timed(fn)
        rows.append({"mib": mib, "stage": name, "us": sec * 1e6, "gbps": (2 * n) / sec / 1e9})
        print(f"{mib:4d} MiB  {name:28s} {sec * 1e6:9.1f} us  {(2 * n) / sec / 1e9:8.1f} GB/s", flush=True)
json.dump({"device": torch.cuda.get_device_name(0), "rows": rows}, open(sys.argv[1], "w"), indent=1)
