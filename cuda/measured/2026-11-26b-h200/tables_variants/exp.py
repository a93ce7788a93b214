"""Table kernel: warp-aggregated atomics (a, shipped) against per-warp histograms (b)."""
import json, statistics, sys, time
from pathlib import Path
import torch
from torch.utils.cpp_extension import load

here = Path(__file__).resolve().parent
ext = load(name="zc_exp", sources=[str(here / "exp.cu")], extra_include_paths=[str(here.parents[1] / "cuda")],
           extra_cuda_cflags=["-O3", "-DZC_TILE_VALUES=1024", "-DZC_BLOCK_VALUES=4096"], verbose=False)

def timed(fn, repeats=30):
    fn(); torch.cuda.synchronize(); out = []
    for _ in range(repeats):
        torch.cuda.synchronize(); t = time.perf_counter(); fn(); torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return statistics.median(out)

rows = []
for name, make in (("gaussian 0.02", lambda n: torch.randn(n, device="cuda") * 0.02),
                   ("gaussian 1", lambda n: torch.randn(n, device="cuda")),
                   ("uniform bits", lambda n: torch.randint(-2**15, 2**15, (n,), device="cuda", dtype=torch.int16).view(torch.bfloat16).float())):
    for mib in (16, 256):
        n = mib << 19
        v = make(n).bfloat16().view(torch.int16)
        tiles = (n + 1023) // 1024
        a = ext.run(v, tiles, False); b = ext.run(v, tiles, True)
        same = all(torch.equal(x, y) for x, y in zip(a, b))
        ta, tb = timed(lambda: ext.run(v, tiles, False)), timed(lambda: ext.run(v, tiles, True))
        rows.append({"data": name, "mib": mib, "same": same, "a_us": ta * 1e6, "b_us": tb * 1e6})
        print(f"{name:14s} {mib:4d} MiB  same={same}  a {ta*1e6:8.1f} us  b {tb*1e6:8.1f} us", flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
