"""The chunked cross-entropy (`model.loss_chunk_tokens`) against `F.cross_entropy` on the
whole batch's logits: the loss, every gradient, and a training step under each weights
family, where the head's weight is whole (replicated), gathered by FSDP2 or passed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from ray_zep.attention.varlen import PackedSeqs
from ray_zep.config import load_config
from ray_zep.constants import IGNORE_INDEX
from ray_zep.errors import ConfigError
from ray_zep.model.llama import Transformer
from ray_zep.model.loss import chunked_cross_entropy
from ray_zep.model_shapes import build_shape
from tests.helpers.procs import run_ranks
from tests.helpers.training import SMALL_RUN, max_relative_error

# fp32 on CPU: the chunked sums add the same terms in another order; 1e-5 relative
# leaves room for that reordering and nothing else.
REL = 1e-5
TOKENS, DIM, VOCAB = 37, 24, 61


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    h_TD = torch.randn(TOKENS, DIM, generator=gen)
    w_VD = torch.randn(VOCAB, DIM, generator=gen) * 0.3
    labels_T = torch.randint(0, VOCAB, (TOKENS,), generator=gen)
    labels_T[::4] = IGNORE_INDEX  # tokens without a next token add nothing
    return h_TD, w_VD, labels_T


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    diff = (got - want).abs()
    rel = float(diff.max() / want.abs().max())
    assert rel <= REL, f"{what}: max abs {float(diff.max()):.3g}, mean {float(diff.mean()):.3g}"


@pytest.mark.unit
@pytest.mark.parametrize("chunk", [1, 8, 10, 37, 64])
def test_loss_and_gradients_equal_cross_entropy_of_the_whole_logits(chunk: int) -> None:
    h_TD, w_VD, labels_T = _inputs()
    scale = 1 / 29  # the runner divides by the global batch's label tokens
    grads = []
    for fn in (_eager_sum, lambda h, w, y: chunked_cross_entropy(h, w, y, chunk)):
        h, w = h_TD.clone().requires_grad_(True), w_VD.clone().requires_grad_(True)
        loss = fn(h, w, labels_T)
        (loss * scale).backward()
        grads.append((loss.detach(), h.grad, w.grad))
    (want, dh, dw), (got, gh, gw) = grads
    assert got.dtype == torch.float32 and got.shape == ()
    _close(got, want, f"loss, chunk {chunk}")
    _close(gh, dh, f"d hidden, chunk {chunk}")
    _close(gw, dw, f"d weight, chunk {chunk}")
    assert gh[::4].abs().max() == 0, "an ignored token's hidden state gets no gradient"


def _eager_sum(h_TD, w_VD, labels_T) -> torch.Tensor:
    logits_TV = F.linear(h_TD, w_VD).float()
    return F.cross_entropy(logits_TV, labels_T, ignore_index=IGNORE_INDEX, reduction="sum")


@pytest.mark.unit
def test_token_losses_without_a_gradient_and_refusals() -> None:
    h_TD, w_VD, labels_T = _inputs(1)
    want = F.cross_entropy(h_TD @ w_VD.T, labels_T, ignore_index=IGNORE_INDEX, reduction="none")
    got = chunked_cross_entropy(h_TD, w_VD, labels_T, 16, reduction="none")
    _close(got, want, "token losses")
    with pytest.raises(ValueError, match="reduction='none' keeps no gradient"):
        chunked_cross_entropy(h_TD.requires_grad_(True), w_VD, labels_T, 16, reduction="none")
    with pytest.raises(ValueError, match="chunk_tokens=0"):
        chunked_cross_entropy(h_TD, w_VD, labels_T, 0)
    with pytest.raises(ConfigError, match=r"model\.loss_chunk_tokens=-1"):
        load_config(None, ["model.loss_chunk_tokens=-1"])


@pytest.mark.unit
def test_model_loss_through_the_head_equals_the_logits_path() -> None:
    shape = build_shape(load_config(None, ["model.n_layers=1"]).model)
    model = Transformer(shape)
    model.init_weights(torch.Generator().manual_seed(0))
    tokens_T = torch.randint(0, shape.vocab_size, (50,), generator=torch.Generator().manual_seed(1))
    positions_T = torch.cat([torch.arange(30), torch.arange(20)])
    seqs = PackedSeqs.from_lengths([30, 20], torch.device("cpu"))
    labels_T = torch.roll(tokens_T, -1)
    labels_T[[29, 49]] = IGNORE_INDEX
    results = []
    for chunk in (0, 16):
        model.zero_grad()
        model.loss_chunk_tokens = chunk
        loss = model(tokens_T, positions_T, seqs, labels_T=labels_T)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (want, want_grads), (got, got_grads) = results
    _close(got, want, "model loss")
    err, name = max_relative_error(got_grads, want_grads)
    assert err <= REL, f"gradient of {name}: relative error {err:.3g}"
    with torch.no_grad():
        per_token = model(tokens_T, positions_T, seqs, labels_T=labels_T, reduction="none")
    _close(per_token.sum(), want, "token losses of the model")


def _step_with_and_without_chunks(rank: int, world: int, overrides: list[str]) -> dict:
    from ray_zep.data.shards import shard_for
    from ray_zep.topology import build_topology
    from ray_zep.train.checkpoint import Progress
    from ray_zep.train.setup import create_comm
    from ray_zep.train.trainer import RankTrainer
    from tests.helpers.training import make_stream

    results = []
    for chunk in (0, 50):  # 50 divides no rank's token count
        config = load_config(None, [*overrides, f"model.loss_chunk_tokens={chunk}"])
        topology = build_topology(config.topology)
        comm = create_comm(config, topology, 60.0)
        shard = shard_for(make_stream(config, topology, Progress(0, {})).next_batch(), config,
                          topology)[rank]  # fmt: skip
        trainer = RankTrainer(config, comm, torch.device("cpu"))
        stats = trainer.train_step(shard)
        # the rank's own weights (tawpipe has released the others' shards)
        own = dict(trainer.state_module.named_parameters())
        grads = {n: _whole(p.grad) for n, p in own.items() if p.grad is not None}
        state = {n: _whole(p) for n, p in own.items()}
        results.append((stats.loss, grads, state, trainer.model.loss_chunk_tokens))
    (off, off_grads, off_state, zero), (on, on_grads, on_state, fifty) = results
    return {"loss": (off, on), "grads": max_relative_error(on_grads, off_grads),
            "params": max_relative_error(on_state, off_state), "chunks": (zero, fifty),
            "graded": len(off_grads)}  # fmt: skip


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


@pytest.mark.dist
@pytest.mark.parametrize("weights", ["fsdp", "tawpipe"])
def test_a_training_step_with_the_chunked_loss_equals_one_without(tmp_path, weights) -> None:
    # the replicated runner is FSDP's without the hooks; the head's loss is the same call
    world = 2
    overrides = [*SMALL_RUN, "parallel.sequence=whole", f"parallel.weights={weights}",
                 "topology.nodes=1", f"topology.gpus_per_node={world}", "data.shuffle=false",
                 f"train.out_dir={tmp_path}"]  # fmt: skip
    for got in run_ranks(_step_with_and_without_chunks, world, overrides):
        assert got["chunks"] == (0, 50), "model.loss_chunk_tokens reaches the model"
        off, on = got["loss"]
        assert on == pytest.approx(off, rel=REL)
        assert got["graded"] > 0
        err, name = got["grads"]
        assert err <= REL, f"gradient of {name}: relative error {err:.3g}"
        err, name = got["params"]
        # AdamW's first step moves each weight by about lr x sign(gradient): a gradient
        # wrong in sign or size moves its weight visibly
        assert err <= REL, f"parameter {name} after the step: relative error {err:.3g}"
