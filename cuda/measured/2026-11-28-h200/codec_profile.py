"""Where a compress call's time goes on a GPU: the wall time of `compress` (its public
path, as `bench codec` times it) against the device time of its kernels, read with
torch's profiler, at 1 MiB and 256 MiB of Gaussian bf16 values."""

import time

import torch
from torch.profiler import ProfilerActivity, profile

from ray_zep.collectives.codec import compress, decompress


def wall_us(fn, calls: int) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / calls * 1e6


def host_us(fn, calls: int) -> float:
    """Host time per call with the device queue never waited on (the launch side alone)."""
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - started
    torch.cuda.synchronize()
    return host / calls * 1e6


for mib in (1, 16, 256):
    x = torch.randn(mib << 19, device="cuda").to(torch.bfloat16)
    packed = compress(x, backend="native")
    assert torch.equal(decompress(packed, backend="native").view(torch.int16), x.view(torch.int16))
    calls = 200 if mib < 256 else 20
    for _ in range(10):
        compress(x, backend="native")
    wall = wall_us(lambda: compress(x, backend="native"), calls)
    host = host_us(lambda: compress(x, backend="native"), calls)
    empty = wall_us(lambda: torch.empty(16, device="cuda").zero_(), calls)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            compress(x, backend="native")
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    device_us = sum(e.self_device_time_total for e in kernels) / calls
    print(f"{mib:4d} MiB: wall {wall:8.1f} us/call ({x.numel() * 2 / wall / 1e3:6.1f} GB/s), "
          f"host {host:6.1f} us/call, kernels {device_us:8.1f} us/call; "
          f"one tiny op {empty:5.1f} us")
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total):
        print(f"      {e.key[:60]:60s} {e.self_device_time_total / calls:8.1f} us x {e.count // calls}")
