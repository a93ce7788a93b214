"""Loading a Config: the dataclass defaults, a YAML file and `key=value` overrides,
merged with omegaconf in struct mode, so an unknown key or a value of the wrong type is
an error that names the key; and the way back, a Config as plain data or YAML.

YAML reads `off` / `on` as booleans, which are given back as words where the schema
expects an enum; keys and values earlier versions took are refused with today's
(`ray_zep.config.legacy`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import typing
from collections.abc import Sequence
from enum import Enum
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from ray_zep import constants
from ray_zep.config.legacy import refuse_legacy_override, refuse_legacy_section
from ray_zep.config.schema import Config
from ray_zep.errors import ConfigError

log = logging.getLogger(__name__)

PRESET_SIZES = ("gpus_per_node", "nics_per_node")
"""Topology keys a named preset fixes (see `ray_zep.topology.build_topology`)."""

YAML_BOOLEAN_WORDS = {False: ("off", "no", "false"), True: ("on", "yes", "true")}


@functools.cache
def _schema() -> Any:
    """The defaults as OmegaConf's typed tree, built once per process: building it costs
    most of a load (about 10 ms), and `OmegaConf.merge` copies its first argument, so
    every load still starts from an untouched tree."""
    return OmegaConf.structured(Config)


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Merge the defaults, a YAML file and `key=value` overrides into a Config.

    Args:
        path: YAML file, or None for the defaults alone.
        overrides: CLI dotlist items such as `train.steps=5`.

    Returns:
        The validated Config.

    Raises:
        ConfigError: the file is missing or not YAML, an override is malformed,
            a key is unknown, a value has the wrong type or is out of range, or
            `parallel.weights` names a renamed mode (`RENAMED_WEIGHTS`).
    """
    layers = [_schema()]
    if path is not None:
        layers.append(_load_yaml(Path(path), overrides))
    _check_overrides(overrides)
    try:
        dotlist = OmegaConf.to_container(OmegaConf.from_dotlist(list(overrides)))
        layers.append(OmegaConf.create(_enum_members(dotlist, Config)))
        merged = OmegaConf.merge(*layers)
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    except OmegaConfBaseException as exc:
        raise _config_error(exc) from None


def _check_overrides(overrides: Sequence[str]) -> None:
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r} must look like key=value, e.g. train.steps=5")
        key, value = (part.strip() for part in item.split("=", 1))
        refuse_legacy_override(key, value)


def _config_error(exc: OmegaConfBaseException) -> ConfigError:
    """omegaconf's error as one line naming the key (and what the key takes)."""
    if isinstance(exc, ConfigKeyError):
        return ConfigError(f"unknown config key '{exc.full_key}'{_suggestion(exc)}")
    key = str(getattr(exc, "full_key", "?"))
    detail = str(getattr(exc, "msg", exc)).splitlines()[0]
    field_type = _schema_type(key.split("."))
    if isinstance(field_type, type) and issubclass(field_type, Enum):
        allowed = " | ".join(member.value for member in field_type)
        detail = f"{detail.split(',')[0]}, expected {allowed}"
    return ConfigError(f"config key {key}: {detail}")


def _preset_sizes_win(content: Any, overrides: Sequence[str], path: Path) -> Any:
    """A named `topology.preset` given as an override replaces the sizes the file pins
    (the command line is the later word); sizes given as overrides too still meet the
    preset's check."""
    given = {k.strip(): v for k, _, v in (item.partition("=") for item in overrides)}
    preset = given.get("topology.preset", "").strip()
    topology = content.get("topology") if isinstance(content, dict) else None
    if not preset or preset == "virtual" or not isinstance(topology, dict):
        return content
    for key in PRESET_SIZES:
        if key in topology and f"topology.{key}" not in given:
            log.info(
                "topology.preset=%s fixes topology.%s: %s's value %s is not used",
                preset, key, path, topology.pop(key),
            )  # fmt: skip
    return content


def _load_yaml(path: Path, overrides: Sequence[str] = ()) -> Any:
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        content = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        first = str(exc).splitlines()[0]
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {first}") from None
    if content is None:
        content = {}
    if not isinstance(content, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections")
    refuse_legacy_section(content.get("parallel"), overrides)
    content = _preset_sizes_win(content, overrides, path)
    return OmegaConf.create(_enum_members(content, Config))


def _enum_members(data: Any, schema: Any) -> Any:
    """Where the schema expects an enum, its member in place of the word naming it.
    omegaconf before 2.4 takes an enum's member names alone (`FSDP`), not their values
    (`fsdp`, what the docs and configs write); a member is taken by every version. YAML
    reads `off` / `on` (and no / yes) as booleans: where the enum has such a member
    (`comm.compression=off`), the word comes back first. A word naming no member stays, for
    omegaconf's error."""
    if not isinstance(data, dict) or not dataclasses.is_dataclass(schema):
        return data
    hints = typing.get_type_hints(schema)
    fixed = {}
    for key, value in data.items():
        field_type = hints.get(key)
        if isinstance(field_type, type) and issubclass(field_type, Enum):
            fixed[key] = _member(field_type, value)
        else:
            fixed[key] = _enum_members(value, field_type)
    return fixed


def _member(enum: type[Enum], value: Any) -> Any:
    """`enum`'s member whose value `value` is (or names, as a YAML boolean), else `value`."""
    by_value = {member.value: member for member in enum}
    if isinstance(value, bool):
        value = next((w for w in YAML_BOOLEAN_WORDS[value] if w in by_value), value)
    return by_value.get(value, value) if isinstance(value, str) else value


def _schema_type(parts: list[str]) -> Any:
    """The declared type at a dotted key path of the schema, or None if unknown."""
    schema: Any = Config
    for part in parts:
        if not dataclasses.is_dataclass(schema):
            return None
        hints = typing.get_type_hints(schema)
        if part not in hints:
            return None
        schema = hints[part]
    return schema


def _suggestion(exc: ConfigKeyError) -> str:
    parts = str(exc.full_key).split(".")
    section = _schema_type(parts[:-1])
    if not dataclasses.is_dataclass(section):
        return ""
    known = ", ".join(f.name for f in dataclasses.fields(section))
    return f"; {'.'.join(parts[:-1]) or 'the top level'} takes: {known}"


def config_to_dict(config: Config) -> dict[str, Any]:
    """The config as plain data (enums by value), to write out or ship to workers."""

    def plain(value: Any) -> Any:
        if dataclasses.is_dataclass(value):
            return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return value.value if isinstance(value, Enum) else value

    return plain(config)


def config_to_yaml(config: Config) -> str:
    """The config as YAML, loadable by `load_config`."""
    return yaml.safe_dump(config_to_dict(config), sort_keys=False)


def config_from_dict(data: dict[str, Any]) -> Config:
    """Inverse of `config_to_dict`."""
    members = _enum_members(data, Config)
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), members))  # type: ignore


def write_resolved_config(config: Config, run_dir: Path) -> Path:
    """Write the resolved config into the run directory and return its path."""
    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir / constants.RESOLVED_CONFIG_FILE_NAME
    out.write_text(config_to_yaml(config))
    return out
