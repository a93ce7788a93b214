"""The differentiable all-to-all-v between the linear and attention layouts.

`to_attention` moves a rank's rows from the balanced linear layout to the
attention layout and `to_linear` back; each is the other's exact inverse, so
the backward of one is the other applied to the gradients. Only ranks with
transfers communicate (point-to-point sends and receives on the Comm's group,
waited on with its timeout).

What crosses the wire: the model calls the attention function with Q, K and V
already projected on the linear layout, so the remap moves q/k/v rows on the
way in ((H + 2K) E values per token) and the attention output on the way out
(H E values). Moving hidden states instead (D = H E values each way) would be
(2 + 2K/H) / 2 times fewer bytes per moved token, 1.25x for the paper's 8:1
GQA models, but the QKV and output projections would then run on the
unbalanced attention layout; the planner already balances tokens within a
rank's capacity, so few tokens move, and keeping every linear module balanced
is worth the extra K/V bytes of those tokens.

Shapes: T rows, C values per row (heads x head dim, flattened).
"""

from __future__ import annotations

from collections import Counter

import torch

from ray_zep.attention.kv_exchange import exchange
from ray_zep.attention.links import Links
from ray_zep.options import CompressionStream
from ray_zep.remap.layout import RankRemap


def _move(x_TC: torch.Tensor, remap: RankRemap, links: Links, ops: Counter, to_linear: bool):
    """Keep the leading rows this rank holds in both layouts, send the rest, append arrivals."""
    if to_linear:
        outgoing, incoming = remap.sends, remap.recvs
        keep = remap.linear_tokens if remap.sends else remap.attention_tokens
    else:
        outgoing, incoming = remap.recvs, remap.sends
        keep = remap.attention_tokens if remap.recvs else remap.linear_tokens
    sends, offset = [], keep
    for peer, n in outgoing:
        sends.append((x_TC[offset : offset + n], peer))
        offset += n
    received = x_TC.new_empty((sum(n for _, n in incoming), x_TC.shape[1]))
    recvs, offset = [], 0
    for peer, n in incoming:
        recvs.append((received[offset : offset + n], peer))
        offset += n
    stream = CompressionStream.REMAP_ALL_TO_ALL.value
    exchange(sends, recvs, links, ops, "remap all-to-all-v", zip_stream=stream).wait()
    return torch.cat((x_TC[:keep], received))


class _Remap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TC, remap: RankRemap, links: Links, ops: Counter, to_linear: bool):
        ctx.remap, ctx.links, ctx.ops, ctx.to_linear = remap, links, ops, to_linear
        return _move(x_TC, remap, links, ops, to_linear)

    @staticmethod
    def backward(ctx, grad_TC):
        grad = _move(grad_TC.contiguous(), ctx.remap, ctx.links, ctx.ops, not ctx.to_linear)
        return grad, None, None, None, None


def to_attention(x_TC: torch.Tensor, remap: RankRemap, links: Links, ops: Counter) -> torch.Tensor:
    """Rows of the linear layout (B x C) -> rows of the attention layout (A x C)."""
    return _Remap.apply(x_TC, remap, links, ops, False)


def to_linear(x_TC: torch.Tensor, remap: RankRemap, links: Links, ops: Counter) -> torch.Tensor:
    """Rows of the attention layout (A x C) -> rows of the linear layout (B x C)."""
    return _Remap.apply(x_TC, remap, links, ops, True)
