"""`plan --auto` takes a remap composition's steps from its twin without the remap where
no batch is remapped, and plays them where one is; the simulator pauses the cyclic
collector and leaves it as it found it."""

from __future__ import annotations

import dataclasses
import gc

import pytest

from ray_zep.bench.scale import batch_lengths
from ray_zep.config import load_config
from ray_zep.cycle_collection import paused
from ray_zep.sim.auto import _switched, evaluate_group
from ray_zep.sim.request import request_hardware


def _groups(policy: str):
    """(hardware, on GPU, batches, the remap-off group, the remap-on group): zeppelin + fsdp
    with routing on 16 GPUs of cluster A, two chat batches of 4k tokens a GPU (L = 5,120),
    `parallel.remap_policy=policy`: `when_faster` remaps neither, `always` both."""
    config = load_config(None, ["topology.preset=cluster_a", "topology.nodes=2",
                                "model.preset=7b", "parallel.sequence=zeppelin",
                                "parallel.weights=fsdp", "parallel.routing=true",
                                "train.tokens_per_rank=5120",
                                f"parallel.remap_policy={policy}"])  # fmt: skip
    hardware, on_gpu = request_hardware(config, None)
    batches = [(batch_lengths("chat", 4096 * 16, seed), None) for seed in range(2)]

    def group(remap: bool):
        return _switched(dataclasses.replace(
            config, parallel=dataclasses.replace(config.parallel, remap=remap)))  # fmt: skip

    return hardware, on_gpu, batches, group(False), group(True)


def _seconds(candidates) -> list[list[float]]:
    return [[s.step_seconds for s in c.steps] for c in candidates]


def test_a_remap_group_that_remaps_nothing_takes_its_twins_steps() -> None:
    hardware, on_gpu, batches, off, on = _groups("when_faster")
    twin = evaluate_group(off, hardware, batches, on_gpu)
    played = evaluate_group(on, hardware, batches, on_gpu)
    taken = evaluate_group(on, hardware, batches, on_gpu, twin)
    assert all(c.steps for c in taken)
    assert _seconds(taken) == _seconds(played) == _seconds(twin)
    assert [c.bounds for c in taken] == [c.bounds for c in played]
    assert [c.config for c in taken] == on  # each keeps its own composition
    assert [c.memory_gb for c in taken] == [c.memory_gb for c in played]


def test_a_group_whose_batches_are_remapped_is_played() -> None:
    hardware, on_gpu, batches, off, on = _groups("always")
    twin = evaluate_group(off, hardware, batches, on_gpu)
    taken = evaluate_group(on, hardware, batches, on_gpu, twin)
    played = evaluate_group(on, hardware, batches, on_gpu)
    assert _seconds(taken) == _seconds(played)
    assert _seconds(taken) != _seconds(twin)  # the remap moves tokens: another step


@pytest.mark.parametrize("enabled", [True, False])
def test_paused_collection_restores_the_collector(enabled: bool) -> None:
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        with paused():
            assert not gc.isenabled()
            with paused():
                assert not gc.isenabled()
            assert not gc.isenabled()  # the outer block still holds it
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
