"""When FSDP2 gathers the next block's parameters in the forward
(`parallel.prefetch_after_attention`).

When a block starts, as FSDP2's explicit prefetch does, the gather crosses the NICs
while the block's attention runs, and a ring across nodes shares the links with it: its
K/V move beside the gather's bytes, slowed by at most the gather's time on the links (the
latency of its ring steps holds no link). Once the block's attention has run, the
gather has the output projection and the feed-forward to hide under, and what they do
not hide waits before the next block.
Unset, the option takes the second where, by the cost model, what it would leave
exposed is less than the first's time on the links. One block ahead
(`parallel.prefetch_depth=1`), on cluster A at 4k tokens per GPU that is after attention
at 64-1,024 GPUs, and when the block starts at 4,096 GPUs, where a 7B block's gather over
every rank takes 20 ms (16 of them its ring steps' latency) beside a 7 ms feed-forward
(the simulator, its links shared, on `bench scale`'s 7b batches: at 4,096 GPUs arxiv
2.70 s a step after attention, 2.33 s at the block's start; at 1,024 GPUs chat about
even, 2.687 and 2.672 s, where the rule gathers two ahead after attention, 2.652 s).
Two blocks ahead, a gather need not end before the next block: its
ring steps' latency, which holds no link, may run on into it, and the rule counts the
next block's projections before attention as hiding that much of it (the simulator plays
what runs on, bytes included, beside the next block's messages: `ray_zep.sim.step`).
How many blocks ahead (`parallel.prefetch_depth`, `prefetch_depth`) also bounds how far
ranks run ahead of one another across blocks (`DEFAULT_PREFETCH_DEPTH`).
"""

from __future__ import annotations

import functools

from ray_zep.config import Config, ParallelConfig
from ray_zep.costmodel import CostModel, linear_flops_per_token, preset_rates, ring_steps_latency
from ray_zep.model_shapes import ModelShape
from ray_zep.options import FsdpUnit
from ray_zep.parallel.axes import SEQUENCE_AXES, WEIGHTS_AXES
from ray_zep.parallel.memory import mean_block_params
from ray_zep.parallel.shard_groups import run_shard_ranks
from ray_zep.topology import Topology

DEEP_PREFETCH_LATENCY_S = 2e-3
"""Unset, for a placement whose ranks move together (`SequenceAxis.ranks_apart` false),
`parallel.prefetch_depth` is 2 where one gather's ring steps take at least this
long (cluster A: 4.0 ms over 1,024 GPUs, 15.9 ms over 4,096) and the block gathers after
its attention (only then does the deeper prefetch hide anything: the gather runs on into
the next block instead of before it), else 1. Below it what the deeper prefetch hides did
not pay for the block it holds: at 256 GPUs (1.0 ms) `bench scale` stepped 0.994-1.002 of
one ahead, and 13B rows recomputed more to make the room (BENCHMARKS.md, thirty-fourth
series)."""


DEFAULT_PREFETCH_DEPTH = 3
"""Unset, `parallel.prefetch_depth` where blocks are FSDP2 units gathered with prefetch
and the placement leaves ranks that share no exchange (`SequenceAxis.ranks_apart`). No
rank starts block l before every rank of the FSDP group has posted block l's gather,
which it does `depth` blocks earlier: the deeper, the further such ranks run ahead of one
another, so that the forward's slowest ranks (short whole sequences: their linear
modules) and the backward's (ring members: attention) need not hold every block back
(`ray_zep.sim.drift`). Each block ahead holds one more block's parameters (7B: 0.4 GB in
bf16, 13B: 0.63 GB). On `bench scale`'s 4k batches of cluster A at 64-1,024 GPUs
(zeppelin), step / bound averaged 1.1528 under the rule before (two ahead where a
gather's ring steps took 2 ms: at 1,024 GPUs; else one), 1.1485 two ahead everywhere,
1.1443 three, 1.1445 four; three was no slower on any row, some 13B rows recomputing a
few blocks' feed-forward to make the room (BENCHMARKS.md, seventy-first series)."""


def _sharded_blocks(parallel: ParallelConfig) -> bool:
    """FSDP2 with prefetch and blocks as units: what both rules here are about."""
    axis = WEIGHTS_AXES[parallel.weights]
    return axis.fsdp and parallel.prefetch and parallel.fsdp_unit is FsdpUnit.BLOCK


def prefetch_depth(
    parallel: ParallelConfig,
    topology: Topology,
    shape: ModelShape,
    mean_tokens: float,
    param_bytes: int,
) -> int:
    """1 where blocks are not FSDP2 units gathered with prefetch (the key holds only
    there); else `parallel.prefetch_depth`, or where unset `DEFAULT_PREFETCH_DEPTH` where
    the placement leaves ranks apart, else 2 where one gather over the weights mode's
    FSDP group waits at least `DEEP_PREFETCH_LATENCY_S` on its ring steps and the block
    gathers after its attention two ahead (`gathers_after_attention`), else 1."""
    if not _sharded_blocks(parallel):
        return 1
    if parallel.prefetch_depth is not None:
        return parallel.prefetch_depth
    if SEQUENCE_AXES[parallel.sequence].ranks_apart:
        return DEFAULT_PREFETCH_DEPTH
    group = run_shard_ranks(parallel, topology)
    if _gather_latency(topology, group) < DEEP_PREFETCH_LATENCY_S:
        return 1
    late = parallel.prefetch_after_attention
    if late is None:
        late = _late(group, topology, shape, float(mean_tokens), param_bytes, True)
    return 2 if late else 1


@functools.lru_cache(maxsize=64)
def _gather_latency(topology: Topology, size: int) -> float:
    """Ring-step latency of one all-gather over an FSDP group of `size` ranks."""
    group = range(size)
    return ring_steps_latency(topology, group, len(group) - 1, 1)


def gathers_after_attention(
    parallel: ParallelConfig,
    topology: Topology,
    shape: ModelShape,
    mean_tokens: float,
    param_bytes: int,
) -> bool:
    """Whether each block gathers the next unit once its attention has run: FSDP2 with
    prefetch and blocks as units, `parallel.prefetch_after_attention` where set, else
    where the cost model prefers it (module docstring) for a rank holding `mean_tokens`
    tokens, parameters gathered in `param_bytes` per element."""
    if not _sharded_blocks(parallel):
        return False
    if parallel.prefetch_after_attention is not None:
        return parallel.prefetch_after_attention
    deep = prefetch_depth(parallel, topology, shape, mean_tokens, param_bytes) > 1
    group = run_shard_ranks(parallel, topology)
    return _late(group, topology, shape, float(mean_tokens), param_bytes, deep)


@functools.lru_cache(maxsize=256)
def _late(
    size: int,
    topology: Topology,
    shape: ModelShape,
    mean_tokens: float,
    param_bytes: int,
    deep: bool,
) -> bool:
    """The cost model's choice (module docstring) for an FSDP group of `size` ranks,
    gathers posted two or more blocks ahead where `deep` (kept: the memory model asks for
    every rank it models)."""
    group = range(size)
    if len(group) < 2:
        return False
    cost = CostModel.create(shape, topology)
    gather = cost.all_gather_seconds(mean_block_params(shape) / len(group) * param_bytes, group)
    latency = cost.ring_latency(group, len(group) - 1, 1)
    on_links = gather - latency
    before, after = linear_flops_per_token(shape)
    matmul = preset_rates(topology.gpu_model).matmul
    feed_forward = mean_tokens * after / matmul
    # posted two blocks ahead, the gather's latency may run on into the next block: at
    # least that block's projections before attention hide it (attention hides more)
    hidden = min(latency, mean_tokens * before / matmul) if deep else 0.0
    return max(0.0, gather - hidden - feed_forward) < on_links


def run_prefetch_depth(
    config: Config, topology: Topology, shape: ModelShape, param_bytes: int
) -> int:
    """`prefetch_depth` for a run of `config` (ranks holding `train.tokens_per_rank` x
    `data.batch_fill` tokens on average)."""
    mean_tokens = config.train.tokens_per_rank * config.data.batch_fill
    return prefetch_depth(config.parallel, topology, shape, mean_tokens, param_bytes)


def run_gathers_after_attention(
    config: Config, topology: Topology, shape: ModelShape, param_bytes: int
) -> bool:
    """`gathers_after_attention` for a run of `config`: its ranks hold
    `train.tokens_per_rank` x `data.batch_fill` tokens on average."""
    mean_tokens = config.train.tokens_per_rank * config.data.batch_fill
    return gathers_after_attention(config.parallel, topology, shape, mean_tokens, param_bytes)
