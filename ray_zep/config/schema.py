"""The whole run's schema: one dataclass per section, under `Config`.

The sections live next to their owners: `train`, `model` and `data` in
`ray_zep.config.training`; `parallel`, `topology` and `comm` in
`ray_zep.config.parallelism`; `ray` and `metrics` in `ray_zep.config.runtime`. Each
checks its own keys in `__post_init__`; `Config.__post_init__` checks the rules that
span sections (`ray_zep.config.checks`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ray_zep.config.checks import check_across_sections
from ray_zep.config.parallelism import CommConfig, ParallelConfig, TopologyConfig
from ray_zep.config.runtime import MetricsConfig, RayConfig
from ray_zep.config.training import DataConfig, ModelConfig, TrainConfig


@dataclass
class Config:
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def __post_init__(self) -> None:
        check_across_sections(self.train, self.parallel, self.model, self.data)
