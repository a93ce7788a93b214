"""Keys and values earlier versions took: each is refused with the one that replaces it.

`parallel.strategy` became the two axes `parallel.sequence` and `parallel.weights`;
some weights modes were renamed (`RENAMED_WEIGHTS`). A saved run directory's config may
still name a renamed mode, which `renamed_overrides` brings up to date.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from ray_zep.errors import ConfigError
from ray_zep.parallel.axes import RENAMED_WEIGHTS, Placement, WeightsMode

log = logging.getLogger(__name__)

LEGACY_STRATEGIES = {
    "dp": (Placement.WHOLE, WeightsMode.REPLICATED),
    **{p.value: (p, WeightsMode.REPLICATED) for p in Placement if p is not Placement.WHOLE},
    **{w.value: (Placement.WHOLE, w) for w in WeightsMode if w is not WeightsMode.REPLICATED},
    **{old: (Placement.WHOLE, mode) for old, (mode, _) in RENAMED_WEIGHTS.items()},
}
"""What each value of the former `parallel.strategy` key is in the axes."""


def refuse_legacy_override(key: str, value: str) -> None:
    """Refuse an override `key=value` that sets a replaced key or names a renamed value.

    Raises:
        ConfigError: naming the keys or the value to use instead.
    """
    if key == "parallel.strategy":
        refuse_strategy_key(value)
    if key == "parallel.weights":
        refuse_renamed_weights(value)


def refuse_legacy_section(parallel: Any, overrides: Sequence[str]) -> None:
    """Refuse a YAML file's `parallel` section that sets a replaced key or names a renamed
    weights mode, unless an override sets `parallel.weights` (the command line is the
    later word: the file's value is then dropped from `parallel`).

    Raises:
        ConfigError: naming the keys or the value to use instead.
    """
    if not isinstance(parallel, dict):
        return
    if "strategy" in parallel:
        refuse_strategy_key(parallel["strategy"])
    if str(parallel.get("weights")) in RENAMED_WEIGHTS:
        if any(item.partition("=")[0].strip() == "parallel.weights" for item in overrides):
            parallel.pop("weights")
        else:
            refuse_renamed_weights(parallel["weights"])


def refuse_strategy_key(value: Any) -> None:
    """A config that still sets `parallel.strategy` gets the keys that replace it."""
    sequence, weights = LEGACY_STRATEGIES.get(str(value), (Placement.WHOLE, WeightsMode.REPLICATED))
    raise ConfigError(
        f"config key parallel.strategy={value} was replaced by parallel.sequence and "
        f"parallel.weights: use parallel.sequence={sequence.value} "
        f"parallel.weights={weights.value}"
    )


def refuse_renamed_weights(value: Any) -> None:
    """A config that names a former `parallel.weights` value gets today's name and why."""
    if isinstance(value, str) and value.strip() in RENAMED_WEIGHTS:
        mode, why = RENAMED_WEIGHTS[value.strip()]
        raise ConfigError(
            f"config key parallel.weights={value.strip()} was renamed: use "
            f"parallel.weights={mode.value}, the same executor; {why}"
        )


def renamed_overrides(path: str | Path) -> list[str]:
    """Overrides that bring a run directory's saved config up to today's names.

    A config.yaml an earlier version wrote may name a renamed weights mode; reading
    that run (its checkpoint, `ray-zep export` / `eval`) needs the mode's current name,
    for the executor is the same. Returns [] for anything but such a file.
    """
    try:
        content = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return []
    parallel = content.get("parallel") if isinstance(content, dict) else None
    old = parallel.get("weights") if isinstance(parallel, dict) else None
    if not isinstance(old, str) or old not in RENAMED_WEIGHTS:
        return []
    mode = RENAMED_WEIGHTS[old][0]
    log.info("%s: parallel.weights=%s is now called %s", path, old, mode.value)
    return [f"parallel.weights={mode.value}"]
