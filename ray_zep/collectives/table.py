"""Which seven exponents get a 3-bit code: derived from the tensor's spread, no histogram.

For values drawn from N(0, σ²), the window of seven consecutive exponents
[2^x, 2^(x+7)) holds the largest share of values when
x = log2(σ) + ½·log2(14·ln2 / 16383) ≈ log2(σ) − 5.35 (ZipCCL eq. 5); the share
itself is erf(2^(x+7)/(σ√2)) − erf(2^x/(σ√2)) (eq. 2). Exponents are integers,
so of the two integers around x we take the one whose window holds more.

σ is estimated as median(|v|) / 0.6745 over the finite non-zero values: for
N(0, σ²) data that is σ, and unlike the root mean square it is not pulled up
by a few large values (gradients and weights of a whole model mix tensors of
very different scales; on the demo model's gradients it raises the ratio from
1.05 to 1.18). It is taken over at most `SAMPLE_VALUES` evenly strided values,
on the CPU, so that every backend derives the same table from the same tensor.

Data with many exact zeros (ReLU outputs, padding) would escape every zero;
when the zeros (exponent field 0) outnumber what the window's lowest exponent
is expected to hold, that exponent's code goes to the zeros instead.
"""

from __future__ import annotations

import math

import torch

from ray_zep.collectives.format import TABLE_SIZE, FloatFormat

SAMPLE_VALUES = 1 << 14
HALF_NORMAL_MEDIAN = 0.6744897501960817
"""Median of |z| for z ~ N(0, 1)."""
WINDOW_OFFSET = 0.5 * math.log2(14 * math.log(2) / 16383)
"""x_opt − log2(σ) of eq. 5 (≈ −5.35)."""


def window_share(base: float, sigma: float) -> float:
    """Expected share of N(0, σ²) values with |v| in [2^base, 2^(base+7)) (eq. 2)."""
    return _share(base, base + TABLE_SIZE, sigma)


def _share(low: float, high: float, sigma: float) -> float:
    scale = sigma * math.sqrt(2.0)
    return math.erf(2.0**high / scale) - math.erf(2.0**low / scale)


def best_base(sigma: float) -> int:
    """Unbiased exponent that starts the best window for N(0, σ²) data."""
    x_opt = math.log2(sigma) + WINDOW_OFFSET
    low = math.floor(x_opt)
    return max((low, low + 1), key=lambda b: window_share(b, sigma))


def choose_table(flat: torch.Tensor, fmt: FloatFormat) -> tuple[int, ...]:
    """The exponent fields coded 1..7 for this tensor.

    Args:
        flat: the values (any device, 1-D, dtype of `fmt`).
        fmt: their float layout.

    Returns:
        Seven distinct exponent fields in [0, fmt.exp_max).
    """
    sample = flat[:: max(1, flat.numel() // SAMPLE_VALUES)].detach().to("cpu", torch.float64)
    spread = sample[torch.isfinite(sample) & (sample != 0)].abs()
    sigma = float(spread.median()) / HALF_NORMAL_MEDIAN if spread.numel() else 0.0
    if not sigma > 0.0:
        return tuple(range(TABLE_SIZE))
    base = best_base(sigma)
    first = min(max(base + fmt.bias, 0), fmt.exp_max - TABLE_SIZE)
    table = list(range(first, first + TABLE_SIZE))
    zero_share = float((sample == 0).sum()) / max(sample.numel(), 1)
    lowest_share = _share(first - fmt.bias, first - fmt.bias + 1, sigma)
    if first > 0 and zero_share > lowest_share:
        table[0] = 0
    return tuple(table)
