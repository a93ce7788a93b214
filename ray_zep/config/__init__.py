"""Run configuration: typed dataclasses are the schema.

Values come from a YAML file and CLI dotlist overrides (`train.steps=5`), merged
over the dataclass defaults with omegaconf in struct mode, so an unknown key or a
value of the wrong type is an error that names the key. Each dataclass checks its
own ranges in `__post_init__`; `Config.__post_init__` checks rules that span
sections.

Public contract (other tools and users rely on these keys): `train.steps`,
`train.seed`, `train.out_dir`, `train.tokens_per_rank`, `parallel.sequence`,
`parallel.weights`, `topology.preset`, `topology.nodes`, `topology.gpus_per_node`,
`model.preset`, `data.source`. Whether the parallel axes compose is decided by
`ray_zep.parallel.axes.refusal` when the config loads.

Modules: `schema` (`Config`) over the sections `training`, `parallelism` and
`runtime`; `checks` (rules across sections); `loader` (YAML and overrides in, plain
data and YAML out); `legacy` (replaced keys and renamed values); `sizes` (rules
against the topology's and model's sizes, which `ray-zep train` and `ray-zep config`
both apply: import it from its module).
"""

from __future__ import annotations

from ray_zep.config.legacy import LEGACY_STRATEGIES, renamed_overrides
from ray_zep.config.loader import (
    PRESET_SIZES,
    YAML_BOOLEAN_WORDS,
    config_from_dict,
    config_to_dict,
    config_to_yaml,
    load_config,
    write_resolved_config,
)
from ray_zep.config.parallelism import CommConfig, ParallelConfig, TopologyConfig
from ray_zep.config.runtime import MetricsConfig, RayConfig
from ray_zep.config.schema import Config
from ray_zep.config.training import (
    DataConfig,
    ModelConfig,
    MoEConfig,
    TrainConfig,
    batch_budget,
)
from ray_zep.options import (  # the enums are part of the schema
    COMPRESSION_STREAMS,
    ActivationCheckpointing,
    Compression,
    Device,
    DkvWire,
    FsdpUnit,
    MoEDispatch,
    MoEPipeline,
    Overlong,
    Packing,
    Precision,
    RemapPolicy,
    ResumeMode,
    ZonePolicy,
)

__all__ = [
    "COMPRESSION_STREAMS",
    "LEGACY_STRATEGIES",
    "PRESET_SIZES",
    "YAML_BOOLEAN_WORDS",
    "ActivationCheckpointing",
    "CommConfig",
    "Compression",
    "Config",
    "DataConfig",
    "Device",
    "DkvWire",
    "FsdpUnit",
    "MetricsConfig",
    "MoEConfig",
    "MoEDispatch",
    "MoEPipeline",
    "ModelConfig",
    "Overlong",
    "Packing",
    "ParallelConfig",
    "Precision",
    "RayConfig",
    "RemapPolicy",
    "ResumeMode",
    "TopologyConfig",
    "TrainConfig",
    "ZonePolicy",
    "batch_budget",
    "config_from_dict",
    "config_to_dict",
    "config_to_yaml",
    "load_config",
    "renamed_overrides",
    "write_resolved_config",
]
