"""FlashAttention-4 (flash-attn-4, routed through torch's flash ops) against torch's own FA2
on one GPU: the same packed calls through `ray_zep.attention.torch_flash` (the calls the ring
engine and the model make), their outputs compared and their rates timed side by side.

Parity: out, LSE and dq/dk/dv of FA4 against FA2 on packed varlen batches (GQA 32/8, head dim
128, bf16): square causal blocks and non-causal blocks with fewer queries than keys (a ring
step's earlier chunks). Rates: 65,536 query tokens packed into sequences of each length,
causal and full, forward and backward, CUDA events, median of 5 after 2 warm-ups.
"""

from __future__ import annotations

import statistics
import sys
from functools import partial

import torch
from torch.nn import attention

from ray_zep.attention import torch_flash
from ray_zep.attention.torch_flash import Varlen

HEADS, KV_HEADS, DIM = 32, 8, 128
TOKENS = 65536
LABELS = ("out", "lse", "dq", "dk", "dv")
LENGTHS = (512, 1024, 2048, 4096, 8192, 16384, 65536)


def packed(lengths, device):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device)
    return cu, max(lengths)


def call(lengths_q, lengths_k, causal, device):
    cu_q, max_q = packed(lengths_q, device)
    cu_k, max_k = packed(lengths_k, device)
    return Varlen(cu_q, cu_k, max_q, max_k, causal, DIM**-0.5)


def tensors(n_q, n_k, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(n_q, HEADS, DIM, generator=g, device=device, dtype=torch.bfloat16)
    kv = torch.randn(n_k, 2, KV_HEADS, DIM, generator=g, device=device, dtype=torch.bfloat16)
    dout = torch.randn(n_q, HEADS, DIM, generator=g, device=device, dtype=torch.bfloat16)
    return q, kv[:, 0], kv[:, 1], dout  # K and V strided views, as the engine passes them


def run_both(q, k, v, dout, c):
    out, lse = torch_flash.forward(q, k, v, c)
    grads = torch_flash.backward(dout, q, k, v, out, lse, c)
    return (out, lse, *grads)


def set_impl(name):
    attention.restore_flash_attention_impl(_raise_warn=False)
    if name != "FA2":
        attention.activate_flash_attention_impl(name)


def parity(device) -> bool:
    cases = {
        "causal square": ([5, 1, 7, 96, 1000, 2048], None, True),
        "full, fewer queries than keys": ([3, 64, 700], [9, 128, 1400], False),
        "full square": ([128, 1024], None, False),
    }
    ok = True
    for name, (lq, lk, causal) in cases.items():
        lk = lk or lq
        q, k, v, dout = tensors(sum(lq), sum(lk), device, seed=len(name))
        c = call(lq, lk, causal, device)
        results = {}
        for impl in ("FA2", "FA4"):
            set_impl(impl)
            results[impl] = run_both(q, k, v, dout, c)
        for label, a, b in zip(LABELS, results["FA2"], results["FA4"], strict=True):
            a, b = a.float(), b.float()
            if a.shape != b.shape:
                print(f"parity {name} {label}: shape FA2 {tuple(a.shape)} FA4 {tuple(b.shape)}")
                ok = False
                continue
            rel = float((a - b).abs().max()) / max(float(a.abs().max()), 1e-6)
            flag = "ok" if rel <= 2e-2 else "MISMATCH"
            ok &= rel <= 2e-2
            print(f"parity {name:32s} {label:3s} max|FA4-FA2|/max|FA2| = {rel:.2e} {flag}")
    return ok


def timed(fn, repeats=5, warm=2):
    for _ in range(warm):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def rates(device):
    print(f"{'length':>7} {'mask':6} {'impl':4} {'fwd TFLOP/s':>12} {'bwd TFLOP/s':>12}")
    q, k, v, dout = tensors(TOKENS, TOKENS, device, seed=0)
    for length in LENGTHS:
        lengths = [length] * (TOKENS // length)
        for causal in (True, False):
            c = call(lengths, lengths, causal, device)
            pairs = sum(n * n for n in lengths) * (0.5 if causal else 1.0)
            fwd_flops = 4 * pairs * HEADS * DIM
            row = []
            for impl in ("FA2", "FA4"):
                set_impl(impl)
                out, lse = torch_flash.forward(q, k, v, c)
                f = timed(partial(torch_flash.forward, q, k, v, c))
                b = timed(partial(torch_flash.backward, dout, q, k, v, out, lse, c))
                row.append((fwd_flops / f / 1e12, 2.5 * fwd_flops / b / 1e12))
                mask = "causal" if causal else "full"
                print(f"{length:7d} {mask:6} {impl:4} {row[-1][0]:12.1f} {row[-1][1]:12.1f}")
            print(f"{length:7d} {mask:6} FA4/FA2 fwd {row[1][0] / row[0][0]:.2f}x"
                  f" bwd {row[1][1] / row[0][1]:.2f}x", flush=True)  # fmt: skip


def main() -> int:
    device = torch.device("cuda")
    print("torch", torch.__version__, torch.cuda.get_device_name(device))
    print("impls", attention.list_flash_attention_impls())
    set_impl("FA4")
    set_impl("FA2")
    ok = parity(device)
    print("parity", "ok" if ok else "FAILED", flush=True)
    rates(device)
    attention.restore_flash_attention_impl(_raise_warn=False)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
