"""The configured data's batches, as training draws them, through the simulator.

`ray-zep bench train` and `ray-zep bench validate` compare a real run with the
simulator on the same batches: the batch stream is rebuilt from the config (the
data actor's, so the same documents, lengths and rank bins) and every batch of
the measured steps is simulated (`ray_zep.sim.step.simulate_batch`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ray_zep.config import Config
from ray_zep.sim.hardware import Hardware
from ray_zep.sim.step import RunModel, StepResult, simulate_batch


@dataclass(frozen=True)
class Replayed:
    """Simulated steps of a run's batches.

    Attributes:
        steps: one result per replayed batch.
    """

    steps: list[StepResult]

    @property
    def seconds(self) -> float:
        return sum(s.step_seconds for s in self.steps)

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.steps)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def step_seconds(self) -> float:
        return self.seconds / max(1, len(self.steps))


def data_batches(config: Config, ranks: int, first: int, count: int) -> list:
    """(lengths, rank bins or None) of batches `first` .. `first + count - 1` of the
    configured data, as the data actor draws them under `config`.

    Raises:
        ZepError subclasses: data that cannot be read.
    """
    from ray_zep.data.batching import BatchStream
    from ray_zep.data.catalog import open_configured_source

    stream = BatchStream.from_config(open_configured_source(config), config, ranks)
    for _ in range(first):
        stream.next_batch()
    return [(b.lengths, b.bins) for b in (stream.next_batch() for _ in range(count))]


def replay(
    config: Config, hardware: Hardware, first: int, count: int, on_gpu: bool = True
) -> Replayed:
    """Simulate batches `first` .. `first + count - 1` of the configured data under `config`.

    Raises:
        ZepError subclasses: data that cannot be read, batches that cannot be placed.
    """
    run = RunModel.create(config, hardware, on_gpu)
    batches = data_batches(config, hardware.devices, first, count)
    return Replayed([simulate_batch(lengths, run, bins) for lengths, bins in batches])
