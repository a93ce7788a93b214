"""Compute rates of one device, measured on the kernels and the model training runs.

- attention: one ring step as the engine runs it (`ray_zep.attention.ring`: the
  kernel training selects, flash-attn on a GPU in bf16, the torch reference
  otherwise; the merge of the partial output; the gradients' accumulation),
  forward and backward, on packed batches of `TOKENS` tokens cut into sequences
  of one length, for every length of `ATTENTION_LENGTHS` (on a GPU
  `GPU_TOKENS` and `GPU_ATTENTION_LENGTHS`, up to 64k): the diagonal (causal)
  blocks of a ring's first step, and the unmasked blocks of its other steps,
  whose queries and keys are a zigzag chunk and half of one; and the backward of
  local causal attention through autograd, as whole-sequence placements run it.
  The rate per length is the curve the simulator interpolates
  (`ComputeRates.curves`); one call on a single short sequence gives the fixed
  cost of a call.
  Each block is also timed on the kernel alone (`KERNEL_ALONE`): the ring step's rate
  over the kernel's is what the engine costs around it (`ring_step_shares`).
- matmul: the model's feed-forward matmul at several token counts.
- pointwise: the model itself, forward and backward over packed tokens with an
  attention that only passes its queries through; what the matmuls do not
  explain is the element-wise work (`costmodel.pointwise_elements_per_token`).
- optimizer: one AdamW update with gradient clipping of the model's parameters.
- codec: ZipCCL's compress and decompress (`ray_zep.collectives.codec`, the kernel
  training uses) of `CODEC_VALUES` Gaussian values in the training dtype.

FLOPs are counted as the simulator counts them (`ray_zep.costmodel`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ray_zep.attention import ring
from ray_zep.attention.kernels import BackwardInputs, select_backward, select_kernel, tiled
from ray_zep.attention.schedule import StepMeta
from ray_zep.costmodel import (
    BACKWARD_ATTENTION_FACTOR,
    BACKWARD_LINEAR_FACTOR,
    CURVE_KINDS,
    head_flops_per_token,
    linear_flops_per_token,
    pointwise_elements_per_token,
)
from ray_zep.model_shapes import ModelShape

ATTENTION_LENGTHS = (32, 64, 128, 256, 512, 1024, 2048, 4096)
"""Sequence lengths of the packed attention batches on CPU."""
TOKENS = 4096
"""Query tokens of every packed attention batch on CPU."""
GPU_ATTENTION_LENGTHS = tuple(128 << i for i in range(10))
"""On a GPU: 128 ... 65,536 (a tiled kernel's rate still climbs past 4k)."""
GPU_TOKENS = 65536
"""On a GPU: query tokens of every packed batch (one sequence at the longest length)."""
MATMUL_TOKENS = (256, 512, 1024, 2048)
MODEL_TOKENS = (512, 2048)
"""Packed tokens of the two model measurements the element-wise rate is fitted on."""
CALLS_PER_REPEAT = 40
"""A call takes tens of microseconds: the mean of 5 calls came out at 40-75 us on one
machine within a minute, of 200 calls at 39-40 us (the simulator charges it for every
block of every sequence, so short sequences lean on it)."""
CODEC_VALUES = 1 << 20
"""Values of the codec measurement (4 MB in float32: a typical gradient bucket)."""
KERNEL_ALONE = "kernel_"
"""Prefix of the measurements of the kernel alone on a ring step's block (no merge, no
accumulators, K and V in tensors of their own)."""
MODEL_SEQUENCE = 64
"""Sequence length of those batches (short: attention is passed through anyway)."""


@dataclass
class Measurement:
    op: str
    size: int
    flops: float
    seconds: float


def timed(repeats: int, fn, *args, **kwargs) -> float:
    """Mean seconds of `fn(*args, **kwargs)` after one warm-up call: training pays the
    occasional slow call too (page faults of fresh buffers, a descheduled process)."""
    fn(*args, **kwargs)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = []
    for _ in range(repeats):
        sync()
        started = time.perf_counter()
        fn(*args, **kwargs)
        sync()
        times.append(time.perf_counter() - started)
    return float(np.mean(times))


def _block(shape: ModelShape, q_len: int, k_len: int, count: int, device, dtype, generator):
    """A ring step of `count` sequences of q_len queries and k_len keys: the queries,
    packed K/V, and the step's metadata as the engine builds it."""

    def rand(*size: int) -> torch.Tensor:  # drawn where the generator lives (the device)
        return torch.randn(size, generator=generator, device=generator.device).to(device, dtype)

    q = rand(q_len * count, shape.n_heads, shape.head_dim)
    kv = rand(k_len * count, 2, shape.n_kv_heads, shape.head_dim)
    segments = [(i * q_len, q_len, i * k_len, k_len) for i in range(count)]
    return q, kv, StepMeta.of_segments(0, segments, q_len == k_len, device)


def _engine_step(q, kv, meta: StepMeta, kernel, backward, repeats: int) -> tuple[float, float]:
    """Seconds of the engine's forward and backward of one ring step (kernel, merge of the
    partial output, accumulation of the gradients: `ray_zep.attention.ring`), into
    accumulators made once, as the engine makes them once per item."""
    rows, heads = q.shape[0], q.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((heads, rows), float("-inf"), device=q.device)

    def forward() -> None:
        ring.step_forward(q, kv, meta, out, lse, kernel)

    forward()
    final = out.to(q.dtype)  # the engine keeps the output in the compute dtype for backward
    dq, dkv = torch.zeros_like(out), torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
    dout = torch.randn_like(q)

    def backward_step() -> None:
        ring.step_backward(dout, q, kv, final, lse, meta, dq, dkv, backward)

    return timed(repeats, forward), timed(repeats, backward_step)


def _kernel_alone(q, kv, meta: StepMeta, kernel, backward, repeats: int) -> tuple[float, float]:
    """Seconds of the forward and the backward kernel alone on the same block, K and V in
    tensors of their own: what the ring step is measured against."""
    k, v = kv[:, 0].contiguous(), kv[:, 1].contiguous()
    out, lse = kernel(q, k, v, meta.seqs_q, meta.seqs_k, causal=meta.causal)
    block = BackwardInputs(
        torch.randn_like(q), q, k, v, out, lse, meta.seqs_q, meta.seqs_k, meta.causal
    )
    forward = timed(repeats, kernel, q, k, v, meta.seqs_q, meta.seqs_k, causal=meta.causal)
    return forward, timed(repeats, backward, block)


def _autograd_backward(q, kv, meta: StepMeta, kernel, repeats: int) -> float:
    """Seconds of the backward of local attention through autograd, as whole-sequence
    placements run it (the model calls the kernel itself)."""
    q = q.detach().requires_grad_(True)
    k, v = (kv[:, i].detach().requires_grad_(True) for i in (0, 1))

    def both() -> None:
        out, _ = kernel(q, k, v, meta.seqs_q, meta.seqs_k, causal=True)
        out.sum().backward()

    def forward() -> None:
        with torch.no_grad():
            kernel(q, k, v, meta.seqs_q, meta.seqs_k, causal=True)

    return max(timed(repeats, both) - timed(repeats, forward), 1e-9)


def measure_attention(
    shape: ModelShape, device: torch.device, dtype: torch.dtype, repeats: int
) -> list[Measurement]:
    """Forward and backward of both block kinds at every length, as the engine runs a ring
    step, and the autograd backward of local causal attention (module docstring)."""
    kernel = select_kernel("auto", device, dtype)
    backward = select_backward(kernel)
    generator = torch.Generator(device).manual_seed(0)
    per_pair = 4.0 * shape.n_heads * shape.head_dim
    lengths, tokens = attention_lengths(device)
    out = []
    for length in lengths:
        count = max(1, tokens // length)
        for causal in (True, False):
            k_len = length if causal else max(1, length // 2)
            q, kv, meta = _block(shape, length, k_len, count, device, dtype, generator)
            pairs = count * (length * (length + 1) / 2 if causal else length * k_len)
            size = length if causal else round((length * k_len) ** 0.5)
            kind = "causal" if causal else "full"
            fwd, bwd = _engine_step(q, kv, meta, kernel, backward, repeats)
            alone_fwd, alone_bwd = _kernel_alone(q, kv, meta, kernel, backward, repeats)
            flops = per_pair * pairs
            out.append(Measurement(f"forward_{kind}", size, flops, fwd))
            out.append(Measurement(f"{KERNEL_ALONE}forward_{kind}", size, flops, alone_fwd))
            flops *= BACKWARD_ATTENTION_FACTOR
            out.append(Measurement(f"backward_{kind}", size, flops, bwd))
            out.append(Measurement(f"{KERNEL_ALONE}backward_{kind}", size, flops, alone_bwd))
            if causal:
                seconds = _autograd_backward(q, kv, meta, kernel, repeats)
                out.append(Measurement("backward_autograd", size, flops, seconds))
    return out


def attention_lengths(device: torch.device) -> tuple[tuple[int, ...], int]:
    """(sequence lengths, tokens per packed batch) of the attention measurements."""
    if device.type == "cuda":
        return GPU_ATTENTION_LENGTHS, GPU_TOKENS
    return ATTENTION_LENGTHS, TOKENS


def calibration_dtype(device: torch.device) -> torch.dtype:
    """The dtype training computes in on `device` (bf16 on a GPU, float32 on CPU)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def curve_heads(shape: ModelShape, device: torch.device) -> int:
    """`ComputeRates.curve_heads` of the curves `measure_attention` measures: the model's
    query heads where the kernel training selects materializes the score tensor (the
    torch reference: its rate falls as the tensor outgrows the caches), 0 for
    flash-attn (tiles: its rate follows the length)."""
    flash = tiled(select_kernel("auto", device, calibration_dtype(device)))
    return 0 if flash else shape.n_heads


def measure_call(shape: ModelShape, device: torch.device, dtype: torch.dtype, repeats: int):
    """Seconds of a forward call on one 8-token sequence: the fixed cost of a call, over
    `CALLS_PER_REPEAT` x `repeats` calls."""
    kernel = select_kernel("auto", device, dtype)
    q, kv, meta = _block(shape, 8, 8, 1, device, dtype, torch.Generator(device).manual_seed(1))
    k, v, seqs = kv[:, 0], kv[:, 1], meta.seqs_q
    seconds = timed(CALLS_PER_REPEAT * repeats, kernel, q, k, v, seqs, seqs)
    return Measurement("attention_call", 8, 0.0, seconds)


def measure_matmul(
    shape: ModelShape, device: torch.device, dtype: torch.dtype, repeats: int
) -> list[Measurement]:
    weight = torch.randn((shape.dim, shape.ffn_dim), device=device, dtype=dtype)
    out = []
    for tokens in MATMUL_TOKENS:
        x = torch.randn((tokens, shape.dim), device=device, dtype=dtype)
        seconds = timed(repeats, torch.matmul, x, weight)
        out.append(Measurement("matmul", tokens, 2.0 * tokens * shape.dim * shape.ffn_dim, seconds))
    return out


def _passthrough(q_THE, k_TKE, v_TKE, seqs, causal=True):
    return q_THE * 1.0, None


def measure_model(
    shape: ModelShape, device: torch.device, dtype: torch.dtype, repeats: int
) -> tuple[list[Measurement], float]:
    """Forward + backward of the model without attention at `MODEL_TOKENS`, and the
    seconds of one optimizer update (AdamW, clipped) of its parameters."""
    from ray_zep.model.llama import Transformer

    model = Transformer(shape).to(device)
    generator = torch.Generator().manual_seed(2)
    out = []
    for tokens in MODEL_TOKENS:
        ids = torch.randint(0, shape.vocab_size, (tokens,), generator=generator).to(device)
        positions = torch.arange(tokens, device=device) % MODEL_SEQUENCE
        autocast = torch.autocast(device.type, dtype, enabled=dtype != torch.float32)

        def step(ids=ids, positions=positions, autocast=autocast) -> None:
            with autocast:
                logits = model(ids, positions, None, _passthrough)
                loss = F.cross_entropy(logits.float(), ids)
            loss.backward()

        out.append(Measurement("model", tokens, 0.0, timed(repeats, step)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def update() -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    return out, timed(repeats, update) / sum(p.numel() for p in model.parameters())


def measure_codec(device: torch.device, dtype: torch.dtype, repeats: int) -> Measurement:
    """Seconds of one compress and one decompress, averaged: the codec's rate is
    `size` / `seconds` original bytes/s each way (`ComputeRates.codec_bytes_s`)."""
    from ray_zep.collectives.codec import compress, decompress

    generator = torch.Generator().manual_seed(3)
    values = torch.randn(CODEC_VALUES, generator=generator).to(device, dtype)
    packed = compress(values)
    both = timed(repeats, compress, values) + timed(repeats, decompress, packed)
    return Measurement("codec", values.numel() * values.element_size(), 0.0, both / 2)


def pointwise_rate(shape: ModelShape, model: list[Measurement], matmul_rate: float) -> float:
    """Elements/s of the element-wise work: the model's seconds per token beyond its matmuls."""
    (n0, t0), (n1, t1) = ((m.size, m.seconds) for m in model)
    per_token = (t1 - t0) / (n1 - n0)
    before, after = linear_flops_per_token(shape)
    flops = shape.n_layers * (before + after) + head_flops_per_token(shape)
    pointwise = per_token - (1 + BACKWARD_LINEAR_FACTOR) * flops / matmul_rate
    elements = shape.n_layers * pointwise_elements_per_token(shape)
    return elements / pointwise if pointwise > 0 else 0.0


def curves(attention: list[Measurement], call_seconds: float) -> tuple:
    """(kind, ((length, FLOP/s), ...)) per block kind, the call's fixed cost taken out."""
    out = []
    for kind in CURVE_KINDS:
        points = sorted((m.size, m.flops / max(m.seconds - call_seconds, 1e-9))
                        for m in attention if m.op == kind)  # fmt: skip
        out.append((kind, tuple((float(n), float(r)) for n, r in points)))
    return tuple(out)


def ring_step_shares(measurements: list) -> list[tuple[str, int, float, float, float]]:
    """(op, length, ring step FLOP/s, kernel alone FLOP/s, step / kernel) of every block the
    ring step and the kernel alone were both measured on."""
    alone = {
        (m.op[len(KERNEL_ALONE) :], m.size): m
        for m in measurements
        if isinstance(m, Measurement) and m.op.startswith(KERNEL_ALONE)
    }
    rows = []
    for m in measurements:
        kernel = alone.get((m.op, m.size)) if isinstance(m, Measurement) else None
        if kernel is None or not m.flops:
            continue
        step, bare = m.flops / m.seconds, kernel.flops / kernel.seconds
        rows.append((m.op, m.size, step, bare, step / bare))
    return rows
