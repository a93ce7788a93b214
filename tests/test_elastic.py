"""Fewer nodes, the same training run: a step on the live nodes trains the configured
global batch in micro-batches (ray_zep.data.regroup) and equals the uninterrupted run;
a run that loses a node and gets it back continues from its checkpoints unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest

from ray_zep import steplog
from ray_zep.config import load_config
from ray_zep.config.sizes import check_live_sizes
from ray_zep.constants import CHECKPOINT_COMPLETE_MARKER
from ray_zep.data.batching import BatchStream
from ray_zep.data.catalog import open_configured_source
from ray_zep.data.regroup import regroup
from ray_zep.errors import ConfigError, TopologyError
from ray_zep.topology import build_topology
from ray_zep.train.checkpoint_dirs import checkpoint_path
from ray_zep.train.ledger import ledger_path, read_ledger, rewind_departed
from ray_zep.train.setup import prepare_run
from ray_zep_workers.elastic import STALE_VIEW_RETRY_S, RoomWatch, placement_wait_s
from tests.helpers.procs import run_ranks
from tests.helpers.training import (
    SMALL_RUN,
    max_relative_error,
    mixed_dataset,
    tokens_per_step,
    train_rank,
)

pytestmark = pytest.mark.dist

STEPS = 6


def _base(data: Path, packing: str) -> list[str]:
    return [*SMALL_RUN, "topology.nodes=2", "topology.gpus_per_node=2",
            "train.tokens_per_rank=64", f"train.steps={STEPS}", "train.checkpoint_every=2",
            f"data.source={data}", f"data.packing={packing}", "data.shuffle=false"]  # fmt: skip


ZEPPELIN = ["parallel.sequence=zeppelin", "parallel.weights=fsdp", "data.max_doc_tokens=128"]
WHOLE = ["parallel.sequence=whole", "parallel.weights=replicated", "parallel.routing=false",
         "parallel.remap=false"]  # fmt: skip
TAWPIPE = [*WHOLE[:1], "parallel.weights=tawpipe", *WHOLE[2:]]
RUNS = {
    "zeppelin+fsdp": ("budget", ZEPPELIN, True),
    "whole+replicated": ("rank", WHOLE, False),
    "whole+tawpipe": ("rank", TAWPIPE, False),
}
"""name: (data.packing, overrides, whether the shrunk group loses a node while it saves
its last checkpoint)."""


def _phases(rank: int, world: int, phases: list[tuple[list[str], int | None, int | None]]):
    """Each (overrides, live nodes, stop after) run on this rank, in turn."""
    return [train_rank(rank, world, o, live_nodes=n, stop_after=stop) for o, n, stop in phases]


@pytest.mark.parametrize("name", list(RUNS))
def test_shrink_and_regrow_trains_like_the_uninterrupted_run(name: str, tmp_path: Path) -> None:
    """2 x 2 for steps 1-2, one node for 3-4, both again for 5-6; then the same run
    without interruption. Losses, parameters and the tokens of every step agree. Where
    the shrunk group loses its node while it saves step 4 (its checkpoint has no
    COMPLETE marker), the grown group goes back to step 2 and trains 3-6."""
    packing, extra, torn = RUNS[name]
    base = [*_base(mixed_dataset(tmp_path / "mixed.parquet"), packing), *extra]
    elastic, whole = [*base, f"train.out_dir={tmp_path / 'elastic'}"], [
        *base, f"train.out_dir={tmp_path / 'whole'}"]  # fmt: skip
    first = run_ranks(_phases, 4, [(elastic, None, 2)])[0][0]
    shrunk = run_ranks(_phases, 2, [(elastic, 1, 4)])[0][0]
    if torn:
        (checkpoint_path(tmp_path / "elastic", 4) / CHECKPOINT_COMPLETE_MARKER).unlink()
    grown, uninterrupted = run_ranks(_phases, 4, [(elastic, None, None), (whole, None, None)])[0]
    losses = first["losses"] | shrunk["losses"] | grown["losses"]
    assert sorted(losses) == list(range(1, STEPS + 1)), losses
    assert sorted(shrunk["losses"]) == [3, 4], "the shrunk run resumed after step 2"
    assert sorted(grown["losses"]) == ([3, 4, 5, 6] if torn else [5, 6]), "resumed elsewhere"
    for step, loss in uninterrupted["losses"].items():
        assert losses[step] == pytest.approx(loss, rel=1e-5), (name, step)
        if step in shrunk["losses"]:
            assert shrunk["losses"][step] == pytest.approx(loss, rel=1e-5), (name, step)
    err, param = max_relative_error(grown["params"], uninterrupted["params"])
    assert err <= 1e-5, f"{name}: {param} relative error {err:.2e}"
    ledger, reference = read_ledger(tmp_path / "elastic"), read_ledger(tmp_path / "whole")
    assert tokens_per_step(ledger) == tokens_per_step(reference), "other samples trained"


def test_a_batch_regroups_into_micro_batches_that_fit_the_live_ranks() -> None:
    config = load_config(None, [*SMALL_RUN, "topology.nodes=4", "topology.gpus_per_node=2",
                                "data.packing=budget", "data.max_doc_tokens=300",
                                "parallel.sequence=zeppelin"])  # fmt: skip
    stream = BatchStream.from_config(open_configured_source(config), config, 8)
    batch = stream.next_batch()
    parts = regroup(batch, config, 8, 2)
    budget = config.train.tokens_per_rank * 2
    assert len(parts) >= 4 and all(p.total_tokens <= budget for p in parts)
    assert [p for part in parts for p in part.pieces] == batch.pieces
    assert sum(p.label_tokens for p in parts) == batch.label_tokens
    assert regroup(batch, config, 8, 8) == [batch]


@pytest.mark.parametrize(
    "extra, least, message",
    [
        ([], 3, r"3 node\(s\) to continue on: must be in 1\.\.topology\.nodes=2"),
        (["parallel.sequence=single"], 1, "runs one process"),
        (
            ["model.preset=tiny_moe", "parallel.ep=4"],
            1,
            r"on 1 node\(s\): config key parallel\.ep=4",
        ),
        (
            ["data.packing=budget", "parallel.sequence=zeppelin"],
            1,
            r"data\.max_doc_tokens=None",
        ),
    ],
)
def test_a_run_that_cannot_continue_on_fewer_nodes_is_refused(extra, least, message) -> None:
    config = load_config(None, ["topology.nodes=2", "topology.gpus_per_node=2", *extra])
    with pytest.raises(ConfigError, match=message):
        check_live_sizes(config, build_topology(config.topology), least)
    if not extra:  # the same config may continue on one node
        check_live_sizes(config, build_topology(config.topology), 1)


@pytest.mark.unit
def test_an_elastic_config_is_checked_for_its_fewest_nodes_when_it_loads(tmp_path) -> None:
    base = ["topology.nodes=2", "topology.gpus_per_node=2", f"train.out_dir={tmp_path}"]
    prepare_run(load_config(None, [*base, "ray.min_nodes=1"]), write_config=False)
    with pytest.raises(ConfigError, match=r"^config key ray\.min_nodes=3: must be at most"):
        prepare_run(load_config(None, [*base, "ray.min_nodes=3"]), write_config=False)
    moe = [*base, "ray.min_nodes=1", "model.preset=tiny_moe", "parallel.ep=4"]
    with pytest.raises(ConfigError, match=r"^config key ray\.min_nodes=1: on 1 node\(s\)"):
        prepare_run(load_config(None, moe), write_config=False)
    with pytest.raises(ConfigError, match=r"ray\.min_nodes=0"):
        load_config(None, [*base, "ray.min_nodes=0"])


@pytest.mark.unit
def test_the_room_watch_stops_a_run_only_after_the_init_timeout() -> None:
    room = [3]
    watch = RoomWatch(lambda: room[0], least=2, timeout_s=10)
    watch.check(now=0)
    room[0] = 1
    watch.check(now=1)  # short since t=1
    watch.check(now=10.5)
    room[0] = 2
    watch.check(now=12)  # back: the clock starts over
    room[0] = 1
    watch.check(now=13)
    with pytest.raises(TopologyError, match=r"ray\.min_nodes=2: .* room for 1 node\(s\)"):
        watch.check(now=23.5, what="training cannot go on after step 4")


@pytest.mark.unit
def test_an_elastic_group_waits_for_its_placement_only_as_long_as_a_stale_size_takes() -> None:
    """A fixed group may wait for an autoscaling cluster's nodes; an elastic one is only
    started at a size the cluster has room for, so a long wait is a stale size."""
    assert placement_wait_s(300, elastic=False) == 300
    assert placement_wait_s(300, elastic=True) == STALE_VIEW_RETRY_S < 300
    assert placement_wait_s(5, elastic=True) == 5


@pytest.mark.unit
def test_a_smaller_group_rewinds_the_ledger_of_ranks_it_no_longer_has(tmp_path: Path) -> None:
    """Six ranks trained steps 1-2 but the checkpoint of step 2 was lost with a node: four
    ranks resume after step 0, so ranks 4 and 5's lines of steps 1-2 must go too."""
    ledger_path(tmp_path, 0).parent.mkdir()
    for rank in range(6):
        for step in (1, 2):
            row = {"step": step, "docs": [rank], "starts": [0], "lengths": [1]}
            steplog.append_row(ledger_path(tmp_path, rank), row)
    rewind_departed(tmp_path, 4, 0)
    assert steplog.read_rows(ledger_path(tmp_path, 3)), "the live ranks rewind their own files"
    assert steplog.read_rows(ledger_path(tmp_path, 5)) == []
