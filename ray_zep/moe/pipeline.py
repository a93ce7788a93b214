"""FoldMoE: a transformer block whose MoE all-to-alls overlap computation.

`FoldedForward` replaces the forward of an MoE block (`Block.pipeline`). It
plays a program from `ray_zep.moe.schedule`: attention slice by slice (each
slice attends causally over the keys of its sequence's earlier tokens, kept
from the slices before), the token buffer handing the MoE layer fixed
micro-batches first-in first-out, and the dispatch / combine all-to-alls
posted asynchronously and waited for only when their result is needed, in
forward and, through `post_rows` / `wait_rows`, in backward.

Routing is decided micro-batch by micro-batch with the capacity of the whole
routing group and the claims of the earlier micro-batches (`gate.route`), so
the block computes what the plain block computes, dropped choices included.
Transfers always use variable splits (one small count exchange per
micro-batch), whatever `model.moe.dispatch` says for the plain block.

All transfers of a block are chained by an `order` tensor (see
`dispatch.post_rows`), so backward runs them in the reverse of the forward
order on every rank.

Legend: T tokens of the rank, D model dim, H query heads, K key/value heads,
E head dim, N rows of kept choices.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ray_zep.attention.rope import apply_rope
from ray_zep.attention.varlen import PackedSeqs
from ray_zep.config import MoEPipeline
from ray_zep.errors import ConfigError
from ray_zep.moe import dispatch
from ray_zep.moe.gate import Balance, route
from ray_zep.moe.layer import MoE, SortedChoices
from ray_zep.moe.schedule import Kind, Step, attention_slices, build_program
from ray_zep.moe.slicing import micro_batch_sizes, time_uniform_slices, token_uniform_slices


class TokenBuffer:
    """FIFO of rows: pieces go in as attention produces them, fixed batches come out."""

    def __init__(self) -> None:
        self._pieces: list[torch.Tensor] = []

    def push(self, rows: torch.Tensor) -> None:
        # Empty pieces stay: an empty micro-batch must still hang off the block's
        # input in the autograd graph, as on ranks with tokens, so that a sharding
        # wrapper's backward hooks (FSDP2's) fire in the same order on every rank.
        self._pieces.append(rows)

    def take(self, count: int, like: torch.Tensor) -> torch.Tensor:
        """The oldest `count` rows (the buffer must hold them); never a tensor cut off
        from the graph, even when `count` is 0 (`like`: the block's input)."""
        taken, need = [], count
        while need:
            piece = self._pieces[0]
            if piece.shape[0] <= need:
                taken.append(self._pieces.pop(0))
                need -= piece.shape[0]
            else:
                taken.append(piece[:need])
                self._pieces[0] = piece[need:]
                need = 0
        if taken:
            return torch.cat(taken)
        return self._pieces[0][:0] if self._pieces else like[:0]


@dataclass
class _MicroBatch:
    """One MoE micro-batch between its steps."""

    h_TD: torch.Tensor
    z_TD: torch.Tensor
    choices: SortedChoices
    counts_X: torch.Tensor
    in_flight: torch.Tensor | None = None
    ticket: dispatch.Ticket | None = None
    splits: dispatch.Splits | None = None


@dataclass
class _Run:
    """State of one block forward while its program plays."""

    block: object
    x_TD: torch.Tensor
    rope: tuple[torch.Tensor, torch.Tensor]
    seqs: PackedSeqs | None
    kernel: object
    slices: list[int]
    micro: list[int]
    capacity: int
    h_buffer: TokenBuffer = field(default_factory=TokenBuffer)
    z_buffer: TokenBuffer = field(default_factory=TokenBuffer)
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    batches: dict[int, _MicroBatch] = field(default_factory=dict)
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)
    order: torch.Tensor | None = None
    claimed_X: torch.Tensor | None = None
    balance: Balance | None = None

    @property
    def moe(self) -> MoE:
        return self.block.feed_forward

    def play(self, step: Step) -> None:
        {
            Kind.ATTEND: self.attend,
            Kind.DISPATCH: self.dispatch,
            Kind.EXPERTS: self.experts,
            Kind.COMBINE: self.combine,
        }[step.kind](step.index)

    def attend(self, i: int) -> None:
        start = sum(self.slices[:i])
        end = start + self.slices[i]
        if end == start:
            return
        x_SD = self.x_TD[start:end]
        out_SD = self._attention(self.block.attention, self.block.attention_norm(x_SD), start, end)
        h_SD = x_SD + out_SD
        self.h_buffer.push(h_SD)
        self.z_buffer.push(self.block.ffn_norm(h_SD))

    def _attention(self, attn, x_SD: torch.Tensor, start: int, end: int) -> torch.Tensor:
        rows = end - start
        cos, sin = self.rope[0][start:end], self.rope[1][start:end]
        q_SHE = apply_rope(attn.wq(x_SD).view(rows, attn.n_heads, attn.head_dim), cos, sin)
        k_SKE = apply_rope(attn.wk(x_SD).view(rows, attn.n_kv_heads, attn.head_dim), cos, sin)
        self.keys.append(k_SKE)
        self.values.append(attn.wv(x_SD).view(rows, attn.n_kv_heads, attn.head_dim))
        seqs_q, seqs_k, first = _slice_seqs(self.seqs, start, end, self.x_TD.device)
        k_all, v_all = torch.cat(self.keys), torch.cat(self.values)
        out_SHE, _ = self.kernel(
            q_SHE, k_all[first:end], v_all[first:end], seqs_q, seqs_k, causal=True
        )
        return attn.wo(out_SHE.reshape(rows, attn.n_heads * attn.head_dim))

    def dispatch(self, j: int) -> None:
        size = self.micro[j]
        h_TD, z_TD = self.h_buffer.take(size, self.x_TD), self.z_buffer.take(size, self.x_TD)
        moe = self.moe
        routing = route(moe.gate(z_TD), moe.top_k, self.capacity, self.claimed_X)
        self.claimed_X = routing.claimed_X
        self.balance = routing.balance if self.balance is None else self.balance + routing.balance
        choices = SortedChoices.of(routing)
        batch = _MicroBatch(h_TD, z_TD, choices, routing.counts_X)
        rows_ND = z_TD[choices.token_N]
        if moe.ep is None:
            batch.in_flight = rows_ND
        else:
            batch.splits = dispatch.Splits.exchange(routing.counts_X, moe.ep.g)
            batch.in_flight, batch.ticket, self.order = dispatch.post_rows(
                rows_ND,
                batch.splits.send_rows,
                batch.splits.recv_rows,
                moe.ep,
                f"MoE dispatch of micro-batch {j}",
                self.order,
                batch.splits.total_rows,
            )
        self.batches[j] = batch

    def experts(self, j: int) -> None:
        batch, moe = self.batches[j], self.moe
        if moe.ep is None:
            batch.in_flight = moe.all_experts(batch.in_flight, batch.counts_X)
            return
        got_ND, self.order = dispatch.wait_rows(batch.in_flight, batch.ticket, self.order)
        out_ND = dispatch.run_local_experts(got_ND, batch.splits, moe.experts)
        splits = batch.splits
        batch.in_flight, batch.ticket, self.order = dispatch.post_rows(
            out_ND,
            splits.recv_rows,
            splits.send_rows,
            moe.ep,
            f"MoE combine of micro-batch {j}",
            self.order,
            splits.total_rows,
        )

    def combine(self, j: int) -> None:
        batch = self.batches.pop(j)
        out_ND = batch.in_flight
        if batch.ticket is not None:
            out_ND, self.order = dispatch.wait_rows(out_ND, batch.ticket, self.order)
        self.outputs[j] = batch.h_TD + batch.choices.combine(out_ND, batch.z_TD)


def _slice_seqs(
    seqs: PackedSeqs, start: int, end: int, device: torch.device
) -> tuple[PackedSeqs, PackedSeqs, int]:
    """Query and key boundaries of the tokens [start, end), and where its keys begin.

    Each sequence meeting the slice queries with its tokens inside the slice
    and attends to its keys from its own first token up to the slice's end.
    """
    offsets = np.asarray(seqs.offsets, dtype=np.int64)
    ends = offsets + np.asarray(seqs.lengths, dtype=np.int64)
    meet = np.nonzero((offsets < end) & (ends > start))[0]
    q_lengths = np.minimum(ends[meet], end) - np.maximum(offsets[meet], start)
    k_lengths = np.minimum(ends[meet], end) - offsets[meet]
    first = int(offsets[meet[0]])
    return (
        PackedSeqs.from_lengths(q_lengths, device),
        PackedSeqs.from_lengths(k_lengths, device),
        first,
    )


class FoldedForward:
    """The pipelined forward of an MoE block (set as `Block.pipeline`).

    Args:
        schedule: moe_only, aaam or 1a1m (`parallel.moe_pipeline`).
        degree: d, micro-batches per block (`parallel.moe_overlap_degree`).
        uniform_slicing: time-uniform attention slices (Alg. 1) rather than
            token-uniform ones (`parallel.moe_uniform_slicing`).
    """

    def __init__(self, schedule: MoEPipeline, degree: int, uniform_slicing: bool = True) -> None:
        if schedule is MoEPipeline.NONE or degree < 1:
            raise ConfigError(
                f"config keys parallel.moe_pipeline={schedule.value} / "
                f"parallel.moe_overlap_degree={degree}: a pipelined block needs a schedule "
                "and a degree >= 1"
            )
        self.schedule, self.degree, self.uniform = schedule, degree, uniform_slicing
        self.program = build_program(schedule, degree)
        self.unsliced_program = build_program(MoEPipeline.MOE_ONLY, degree)
        self.last_slices: list[int] = []
        """Attention slices of the last call (for logs and tests)."""

    def slices(self, lengths: Sequence[int], dim: int, heads: int) -> list[int]:
        """The attention slices of a rank's packed stream."""
        tokens = int(sum(lengths))
        if attention_slices(self.schedule, self.degree) == 1:
            return [tokens]
        if self.uniform:
            return time_uniform_slices(lengths, self.degree, dim, heads)
        return token_uniform_slices(tokens, self.degree)

    def __call__(self, block, x_TD, rope, seqs: PackedSeqs | None, attention) -> torch.Tensor:
        # Attention through the engine (seqs None: sequences span ranks) runs whole, and
        # the block overlaps only its MoE micro-batches, as moe_only does.
        if block.feed_forward.routing_groups is not None:  # the reference: nothing to overlap
            return block.plain_forward(x_TD, rope, seqs, attention)
        sliced = attention_slices(self.schedule, self.degree) > 1 and seqs is not None
        program = self.program if sliced else self.unsliced_program
        moe: MoE = block.feed_forward
        tokens = x_TD.shape[0]
        attn = block.attention
        lengths = seqs.lengths if sliced else (tokens,)
        run = _Run(
            block=block,
            x_TD=x_TD,
            rope=rope,
            seqs=seqs,
            kernel=attention,
            slices=self.slices(lengths, attn.n_heads * attn.head_dim, attn.n_heads),
            micro=micro_batch_sizes(tokens, self.degree),
            capacity=moe.capacity(tokens),
            order=dispatch.new_order(x_TD),
        )
        self.last_slices = run.slices
        if not sliced:
            self._whole_attention(run, block, attention)
        for step in program:
            if sliced or step.kind is not Kind.ATTEND:
                run.play(step)
        moe.balance = run.balance
        return torch.cat([run.outputs[j] for j in range(self.degree)]) + run.order

    @staticmethod
    def _whole_attention(run: _Run, block, attention) -> None:
        """moe_only: attention as in the plain block, then the buffer holds every token."""
        x_TD = run.x_TD
        h_TD = x_TD + block.attention(block.attention_norm(x_TD), run.rope, run.seqs, attention)
        run.h_buffer.push(h_TD)
        run.z_buffer.push(block.ffn_norm(h_TD))
