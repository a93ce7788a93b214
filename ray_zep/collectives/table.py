"""Which seven exponents get a 3-bit code: the seven most frequent of each block.

A value costs 3 code bits, plus 8 more when its exponent is escaped, so the
table that makes a block smallest is the one with the fewest escapes: the
seven exponent fields that occur most often in the block (a histogram and its
top seven). The ZipCCL paper instead derives one window of seven consecutive
exponents per tensor from its spread (eq. 5); that fits Gaussian data as well,
but a model's gradients mix tensors of very different scales, and there one
table per 4096-value block raises the ratio from about 1.2 to 1.38 (BF16) for
8 table bytes per block.

The order is part of the format, so every backend derives the same table:
codes 1..7 go to the fields by decreasing count, ties to the smaller field.
Fields that do not occur count 0, so a block with fewer than seven distinct
exponents still gets seven distinct fields (the smallest unused ones). The
field of Inf and NaN is never coded: such values always escape, as they did
with the paper's window, and a block of them stays visibly exceptional.

Legend: N values, K blocks, E = 2^exp_bits - 1 fields that can be coded.
"""

from __future__ import annotations

import torch

from ray_zep.collectives.format import BLOCK_VALUES, TABLE_SIZE, FloatFormat


def block_tables(exp_N: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """The table of every block.

    Args:
        exp_N: int64 exponent fields of a chunk's values (any device, 1-D).
        fmt: their float layout.

    Returns:
        int64 (K, 7): row k holds the fields coded 1..7 in block k, all below fmt.exp_max.
    """
    n, fields = exp_N.numel(), fmt.exp_max
    blocks = -(-n // BLOCK_VALUES)
    padded = exp_N.new_full((blocks * BLOCK_VALUES,), fields)  # the tail joins Inf / NaN's bin
    padded[:n] = exp_N
    counts_KE = exp_N.new_zeros((blocks, fields + 1))
    field_KB = padded.view(blocks, BLOCK_VALUES)
    counts_KE.scatter_add_(1, field_KB, torch.ones_like(field_KB))
    field_E = torch.arange(fields, device=exp_N.device)
    key_KE = counts_KE[:, :fields] * fields + (fields - 1 - field_E)  # unique within a row
    return key_KE.topk(TABLE_SIZE, dim=1).indices
