"""The adaptive switcher's cost model and choices (pure: no process group)."""

from __future__ import annotations

import pytest

from ray_zep.collectives.ops import Sizes
from ray_zep.collectives.switcher import Kind, LinearCost, Profile, Switcher
from ray_zep.config import Compression

pytestmark = pytest.mark.unit

KINDS = [k.value for k in Kind]


def profile(beta: float, codec: float = 1e-10, fixed: float = 1e-4) -> Profile:
    """A link of `beta` s/byte and 10 us latency; codec at `codec` s/byte each way."""
    return Profile(
        plain={k: LinearCost(1e-5, beta) for k in KINDS},
        zipped_fixed_s=dict.fromkeys(KINDS, fixed),
        compress_s_per_byte=codec,
        decompress_s_per_byte=codec,
        reduce_s_per_byte=codec,
        world=4,
    )


def test_linear_cost_through_two_points():
    cost = LinearCost.through((1000, 2e-3), (11000, 12e-3))
    assert cost.alpha_s == pytest.approx(1e-3) and cost.beta_s_per_byte == pytest.approx(1e-6)
    assert LinearCost.through((10, 5.0), (20, 1.0)).beta_s_per_byte == 0.0


@pytest.mark.parametrize("kind", list(Kind))
def test_slow_links_and_large_messages_go_zipped(kind):
    slow = Switcher(Compression.AUTO, profile(beta=1e-9, codec=1e-11), refresh_calls=1000)
    slow.observe("s", Sizes(1400, 1000))
    slow.calls["s"] = 1
    assert slow.use_zipped(kind, "s", 1 << 26)
    assert not slow.use_zipped(kind, "s", 64), "the fixed cost dominates a tiny message"


def test_fast_links_and_poor_ratios_stay_plain():
    fast = Switcher(Compression.AUTO, profile(beta=1e-12, codec=1e-10), refresh_calls=1000)
    fast.observe("s", Sizes(1400, 1000))
    fast.calls["s"] = 1
    assert not fast.use_zipped(Kind.ALL_TO_ALL, "s", 1 << 26)
    poor = Switcher(Compression.AUTO, profile(beta=1e-9), refresh_calls=1000)
    poor.observe("s", Sizes(1010, 1000))
    poor.calls["s"] = 1
    assert not poor.use_zipped(Kind.ALL_GATHER, "s", 1 << 26)


def test_a_stream_measures_first_and_then_every_refresh_calls():
    switcher = Switcher(Compression.AUTO, profile(beta=1e-15), refresh_calls=4)
    choices = []
    for _ in range(9):
        choices.append(switcher.use_zipped(Kind.ALL_REDUCE, "g", 1 << 20))
        if choices[-1]:
            switcher.observe("g", Sizes(1100, 1000))
    assert choices == [True, False, False, False, True, False, False, False, True]


def test_modes_off_and_always_ignore_the_model():
    assert not Switcher(Compression.OFF, profile(1e-9)).use_zipped(Kind.ALL_GATHER, "s", 1 << 30)
    assert Switcher(Compression.ALWAYS, profile(1e-15)).use_zipped(Kind.ALL_GATHER, "s", 8)


def test_ratio_estimate_is_smoothed():
    switcher = Switcher(Compression.AUTO)
    switcher.observe("s", Sizes(2000, 1000))
    switcher.observe("s", Sizes(1000, 1000))
    assert switcher.ratios["s"] == pytest.approx(1.5)
    switcher.observe("s", Sizes(0, 0))
    assert switcher.ratios["s"] == pytest.approx(1.5)
