"""Hypothesis cases for the small-ring searches checked against scans of every rank
(`tests/test_load_index.py`, `tests/test_co_rings.py`): loads, token counts, member work
and the level in whole numbers, so that every sum is exact and a search and its scan
agree to the last tie."""

from __future__ import annotations

from hypothesis import strategies as st


def ring_search_cases(ring_tags: list) -> dict:
    """`given` keyword strategies: `cells` (load, tokens, one of `ring_tags`) per rank, 4 to
    48 of them, on nodes of 2 or 4 `gpus`; a ring of `n` tokens; `member` work at each of 3
    sizes; the `level`."""
    return dict(
        cells=st.lists(
            st.tuples(st.integers(0, 6), st.integers(0, 8), st.sampled_from(ring_tags)),
            min_size=4,
            max_size=48,
        ),
        gpus=st.sampled_from([2, 4]),
        n=st.integers(1, 16),
        member=st.lists(st.integers(0, 4), min_size=3, max_size=3),
        level=st.integers(0, 12),
    )
