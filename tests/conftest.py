"""Session-wide test plumbing."""

from __future__ import annotations

import pytest

from tests.helpers.procs import close_pools


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Ray tests start clusters of their own: give the idle gloo pools' memory back first."""
    if item.get_closest_marker("ray") is not None:
        close_pools()
