"""One training step under a weight-passing mode (tawpipe, ring_relay), shard by shard.

Forward runs the shards in order, each on a detached copy of the previous
shard's output, so backward can run them one at a time in reverse with the
shard's weights borrowed again. While a shard computes, the next shard's
weights are on their way (forward: s+1; backward: s-1) and the gradients of
the two shards before it travel to their owners: a sum is posted after its
shard's backward, relayed after the next one's and landed after the one after
that. The last shard stays resident across the turn from forward to backward.

With recompute on (the default), forward runs every shard but the last
without building a graph and keeps only the shard's input; backward runs the
shard's forward again with the graph, then its backward.
"""

from __future__ import annotations

import contextlib

import torch

from ray_zep.attention.rope import rope_tables
from ray_zep.attention.varlen import PackedSeqs
from ray_zep.collectives.adaptive import RingZipper
from ray_zep.distributed import Comm
from ray_zep.errors import ConfigError
from ray_zep.model.llama import Transformer
from ray_zep.parallel.axes import WEIGHTS_AXES, WeightsMode
from ray_zep.parallel.pipeline_layout import WeightLayout, model_units
from ray_zep.pipeline.messages import step_traffic
from ray_zep.pipeline.transport import Pending, Transport
from ray_zep.pipeline.weights import ShardedWeights


class WeightPipeline:
    """Device-bound weights and the step that borrows them (collective: build everywhere).

    Args:
        model: the full model, initialised identically on every device; the
            shards other devices own are released.
        comm: this device's process group and topology.
        mode: tawpipe or ring_relay.
        recompute: run each shard's forward again in backward (`parallel.shard_recompute`).
        dtype: the compute dtype: shards and gradients travel in it.
        zipper: `comm.compression`'s per-message choices (None: off).
    """

    def __init__(
        self,
        model: Transformer,
        comm: Comm,
        mode: WeightsMode,
        recompute: bool = True,
        dtype: torch.dtype = torch.float32,
        zipper: RingZipper | None = None,
    ) -> None:
        if model.shape.moe_experts:
            raise ConfigError(
                f"config key model.moe.num_experts={model.shape.moe_experts}: "
                f"parallel.weights={mode.value} passes the weights of dense models; "
                "shard an MoE model with parallel.weights=fsdp or keep it replicated"
            )
        sizes = [
            sum(p.numel() for m in modules for p in m.parameters())
            for _, modules in model_units(model)
        ]
        topology = comm.topology
        nodes, gpus = (topology.nodes, topology.gpus_per_node) if comm.distributed else (1, 1)
        self.layout = WeightLayout.build(WEIGHTS_AXES[mode].passing, sizes, nodes, gpus)
        self.model = model
        self.recompute = recompute
        self.weights = ShardedWeights(model, self.layout, comm.rank, dtype)
        self.transport = Transport(self.layout, comm, zipper)
        element = self.weights.staging.element_size()
        shard_bytes = [n * element for n in self.weights.numel]
        self.step_traffic = step_traffic(self.layout, shard_bytes, topology)
        """Whole-job bytes of one step per link kind (the same every step)."""

    def forward_backward(
        self,
        tokens_T: torch.Tensor,
        positions_T: torch.Tensor,
        seqs: PackedSeqs,
        labels_T: torch.Tensor,
        label_tokens: int,
        autocast: contextlib.AbstractContextManager | None = None,
    ) -> float:
        """Gradients of sum(token losses) / label_tokens in the own shard's `.grad`
        (summed over every device); returns this device's sum of token losses."""
        shape = self.model.shape
        rope = rope_tables(positions_T, shape.head_dim, shape.rope_theta)
        count = self.layout.shards
        weights = self.weights
        pending = self._post_fetch(0)
        saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        x, loss_sum = tokens_T, torch.zeros(())
        for shard in range(count):
            self._arrive(pending)
            ahead = shard + 1 if shard + 1 < count else count - 2
            pending = self._post_fetch(ahead) if ahead >= 0 else None
            inputs = x if shard == 0 else x.detach().requires_grad_(True)
            keep_graph = not self.recompute or shard == count - 1
            last = shard == count - 1
            with autocast or contextlib.nullcontext(), torch.set_grad_enabled(keep_graph):
                out = self._run(shard, inputs, rope, seqs, labels_T if last else None)
            if last:  # the head returned the sum of token losses
                loss_sum = out
                out = loss_sum / max(1, label_tokens)
            saved.append((inputs, out))
            weights.sample()
            if shard < count - 1:
                weights.release(shard)
            x = out
        grad, summing = None, []
        for shard in reversed(range(count)):
            if shard < count - 1:
                self._arrive(pending)
                pending = self._post_fetch(shard - 1) if shard >= 1 else None
            weights.sample()
            inputs, out = saved[shard]
            if shard < count - 1 and self.recompute:
                with autocast or contextlib.nullcontext():
                    out = self._run(shard, inputs, rope, seqs)
            torch.autograd.backward(out, grad)
            grad = inputs.grad if shard > 0 else None
            flat = weights.pack_gradients(shard)
            weights.set_gradients(shard, None)
            weights.release(shard)
            self._advance_sums(summing)
            summing.append(self.transport.post_reduce(shard, flat))
        while summing:
            self._advance_sums(summing)
        return float(loss_sum.detach())

    def _run(
        self, shard: int, x: torch.Tensor, rope, seqs: PackedSeqs, labels_T=None
    ) -> torch.Tensor:
        """The shard's units on `x`; with `labels_T` (the last shard) the head returns
        the sum of token losses (chunked under `model.loss_chunk_tokens`)."""
        for name, modules in self.weights.units[shard]:
            if name == "tok_embeddings":
                x = modules[0](x)
            elif name == "head":
                norm, output = modules
                x = output(norm(x), labels_T, self.model.loss_chunk_tokens)
            else:
                x = modules[0](x, rope, seqs, self.model.attention_fn)
        return x

    def _post_fetch(self, shard: int) -> Pending | None:
        if shard == self.weights.mine:
            flat = self.weights.pack(shard, self.weights.staging)
        else:
            flat = self.weights.staging[: self.weights.numel[shard]]
        return self.transport.post_fetch(shard, flat)

    def _arrive(self, pending: Pending | None) -> None:
        if pending is None:
            return
        flat = self.transport.finish_fetch(pending)
        self.weights.materialize(pending.shard, flat)

    def _advance_sums(self, summing: list[Pending]) -> None:
        """Land the sum relayed last time, relay the one posted last time: each
        gradient sum has two shards' backward to travel."""
        if summing and summing[0].relayed:
            pending = summing.pop(0)
            summed = self.transport.finish_reduce(pending)
            if summed is not None:
                self.weights.set_gradients(pending.shard, summed)
        if summing and not summing[0].relayed:
            self.transport.relay_reduce(summing[0])
