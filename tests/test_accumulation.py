"""Gradient accumulation (`train.micro_batches`): one step over two global batches is one
step over their union, in loss, gradients and parameters."""

from __future__ import annotations

import pytest
import torch

from ray_zep.config import load_config
from ray_zep.data.batching import GlobalBatch
from ray_zep.data.shards import shard_for
from ray_zep.errors import ConfigError
from ray_zep.topology import build_topology
from ray_zep.train.checkpoint import Progress
from ray_zep.train.setup import create_comm
from ray_zep.train.trainer import RankTrainer
from tests.helpers.procs import run_ranks
from tests.helpers.training import SMALL_RUN, make_stream, max_relative_error

pytestmark = pytest.mark.dist

RUN = [*SMALL_RUN, "parallel.sequence=single", "data.shuffle=false"]


def _union_against_micro_batches(rank: int, world: int, out: str) -> dict:
    config = load_config(None, [*RUN, f"train.out_dir={out}"])
    topology = build_topology(config.topology)
    comm = create_comm(config, topology, 60.0)
    stream = make_stream(config, topology, Progress(0, {}))
    first, second = stream.next_batch(), stream.next_batch()
    union = GlobalBatch(0, first.pieces + second.pieces, first.tokens + second.tokens, None,
                        second.cursor_after)  # fmt: skip
    shards = [shard_for(b, config, topology)[0] for b in (first, second)]
    cpu = torch.device("cpu")
    one, two = RankTrainer(config, comm, cpu), RankTrainer(config, comm, cpu)
    whole = one.train_step(shard_for(union, config, topology)[0])
    grads_whole = {n: p.grad.clone() for n, p in one.model.named_parameters()}
    split = two.train_step(shards)
    grads_split = {n: p.grad.clone() for n, p in two.model.named_parameters()}
    return {
        "loss": (whole.loss, split.loss),
        "tokens": (whole.tokens, split.tokens, whole.label_tokens, split.label_tokens),
        "grads": max_relative_error(grads_split, grads_whole),
        "params": max_relative_error(dict(two.model.state_dict()), dict(one.model.state_dict())),
        "lengths": (len(first.pieces), len(second.pieces)),
    }


def test_two_micro_batches_train_as_their_union(tmp_path) -> None:
    got = run_ranks(_union_against_micro_batches, 1, str(tmp_path))[0]
    assert min(got["lengths"]) >= 1
    whole, split = got["loss"]
    assert split == pytest.approx(whole, rel=1e-6)
    assert got["tokens"][0] == got["tokens"][1] and got["tokens"][2] == got["tokens"][3]
    assert got["grads"][0] <= 1e-5, got["grads"]
    assert got["params"][0] <= 1e-5, got["params"]


def test_micro_batches_below_one_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"train\.micro_batches=0"):
        load_config(None, ["train.micro_batches=0"])
