"""Arguments the command line's families and the benches share: a config with overrides,
comma lists, token counts in the lengths' syntax (k = 1024), and the command as typed."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from ray_zep.config import Config, load_config
from ray_zep.errors import ConfigError


def config_args(parser: argparse.ArgumentParser) -> None:
    """CONFIG (required) and key=value overrides."""
    parser.add_argument("config", help="YAML config, e.g. conf/demo.yaml")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.steps=5")


def optional_config_args(parser: argparse.ArgumentParser) -> None:
    """[CONFIG] and key=value overrides (the defaults when CONFIG is omitted)."""
    parser.add_argument("config", nargs="?", help="YAML config (defaults if omitted)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides")


def optional_config(args: argparse.Namespace) -> Config:
    """Load CONFIG + overrides where CONFIG may be omitted (then it is the first override)."""
    path, overrides = args.config, list(args.overrides)
    if path is not None and "=" in path and not Path(path).exists():
        path, overrides = None, [path, *overrides]
    return load_config(path, overrides)


def cluster_a_config(args: argparse.Namespace) -> Config:
    """The modelled benches' default: the paper's cluster A and the 7b model, under the
    user's overrides."""
    args.overrides = ["topology.preset=cluster_a", "model.preset=7b", *args.overrides]
    return optional_config(args)


def names(text: str | None, default: tuple[str, ...]) -> tuple[str, ...]:
    """A comma list ('a, b'), or `default` when the flag was not given."""
    return default if text is None else tuple(x.strip() for x in text.split(",") if x.strip())


def known(flag: str, given: Iterable[str], choices: Iterable[str]) -> None:
    """Each of `given` is one of `choices`; the first that is not is named, with the choices.

    Raises:
        ConfigError: naming `flag`, the unknown name and the choices.
    """
    allowed = tuple(choices)
    for name in given:
        if name not in allowed:
            raise ConfigError(f"{flag}: {name!r} is not one of {', '.join(allowed)}")


def parse_lengths(text: str, flag: str = "--lengths") -> np.ndarray:
    """'9000,300,64k' -> positive token counts (k = 1024); errors name `flag`."""
    values = []
    for item in text.replace(" ", "").split(","):
        scale = 1024 if item.lower().endswith("k") else 1
        digits = item[:-1] if scale > 1 else item
        if not digits.isdigit() or int(digits) < 1:
            raise ConfigError(
                f"{flag} item {item!r} must be a positive integer (optionally with k), "
                f"e.g. {flag} 9000,300,64k"
            )
        values.append(int(digits) * scale)
    return np.asarray(values, dtype=np.int64)


def counts(text: str, flag: str) -> tuple[int, ...]:
    """`parse_lengths` as plain ints: sizes, sequence lengths, GPU counts."""
    return tuple(int(n) for n in parse_lengths(text, flag))


def factors(text: str, flag: str) -> tuple[float, ...]:
    """'1,1.25,1.5' -> positive numbers; errors name `flag`."""
    out = []
    for item in text.replace(" ", "").split(","):
        try:
            value = float(item)
        except ValueError:
            value = math.nan
        if not value > 0:
            raise ConfigError(f"{flag} item {item!r} must be a positive number, e.g. {flag} 1,1.5")
        out.append(value)
    return tuple(out)


def tokens(text: str | None) -> int | None:
    """A `--tokens` count, in the lengths' syntax: one syntax for every command."""
    if not text:
        return None
    values = parse_lengths(text, "--tokens")
    if len(values) != 1:
        raise ConfigError(f"--tokens {text!r}: one count, e.g. --tokens 256k")
    return int(values[0])


def positive(flag: str, value: float, what: str = "a positive bandwidth") -> float:
    if not value > 0:
        raise ConfigError(f"{flag}={value} must be {what}")
    return value


def at_least(flag: str, value: int, least: int, why: str) -> int:
    if value < least:
        raise ConfigError(f"{flag}={value} must be >= {least} ({why})")
    return value


OUTPUT_FLAGS = ("--out", "--json")
"""Where a command writes: a machine's folders, left out of the command its records keep."""


def command_line(default: str) -> str:
    """The command as the user typed it, for the records, less `OUTPUT_FLAGS` and their
    values; `default` when run as a library."""
    if not sys.argv[1:]:
        return default
    kept, skip = [], False
    for arg in sys.argv[1:]:
        if skip:
            skip = False
        elif arg in OUTPUT_FLAGS:
            skip = True
        elif arg.split("=", 1)[0] not in OUTPUT_FLAGS:
            kept.append(arg)
    return " ".join(["ray-zep", *kept])
