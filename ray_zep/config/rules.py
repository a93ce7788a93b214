"""The one-line form of a refused config value: `config key KEY=VALUE: RULE`."""

from __future__ import annotations

from enum import Enum
from typing import Any

from ray_zep.errors import ConfigError


def require(ok: bool, key: str, value: Any, rule: str) -> None:
    """Refuse `value` of the dotted `key` unless `ok`.

    Raises:
        ConfigError: `config key KEY=VALUE: RULE`, when `ok` is false.
    """
    if not ok:
        raise ConfigError(f"config key {key}={value!r}: {rule}")


def word(value: Any) -> str:
    """A value as a YAML file or an override writes it: an enum by its word, lower case."""
    return value.value if isinstance(value, Enum) else str(value).lower()
