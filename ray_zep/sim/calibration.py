"""What `ray-zep bench calibrate` measured, as the simulator plays it.

`calibration.json` holds one device's `ComputeRates` and, on a CPU virtual cluster,
its links (a message and an all-gather step among the ranks, the message latency
by the compute between messages) and the shares of a core each rank got while
they were measured (`ray_zep.core_share`). `Calibration.hardware` turns it into the
`Hardware` a simulation of that cluster runs on; `ray_zep.bench.calibrate` measures
and writes it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ray_zep.config import TopologyConfig
from ray_zep.core_share import ShareProbe
from ray_zep.costmodel import ComputeRates
from ray_zep.errors import ConfigError
from ray_zep.model_shapes import ModelShape
from ray_zep.sim.events import CorePool
from ray_zep.sim.hardware import Hardware
from ray_zep.topology import build_topology

_LINK_KEYS = ("link_latency_s", "link_bandwidth", "step_latency_s", "step_bandwidth")
_SHARE_KEYS = ("core_share", "alone_step_s", "job_share", "run_share")


def _optional_float(record: dict, key: str, path: str | Path) -> float | None:
    """`record[key]` as a float, None where absent or null.

    Raises:
        ConfigError: the value is not a number.
    """
    value = record.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(
            f"--calibration {path}: {key} must be a number or null, not {value!r}; "
            "run `ray-zep bench calibrate` again"
        )
    return float(value)


@dataclass
class Calibration:
    """What `ray-zep bench calibrate` measured.

    Attributes:
        rates: one device's rates (one single-threaded process on CPU).
        link_latency_s, link_bandwidth: a message between two ranks of the virtual
            cluster (None on a GPU), measured at `core_share`.
        step_latency_s, step_bandwidth: one step of an all-gather among them.
        latency_curve: (seconds of compute between two messages, a message's latency)
            in rising compute, measured like `link_latency_s` after shorter compute
            bursts too (`ray_zep.bench.calibrate_links.latency_curve`); empty: not
            measured (every message at `link_latency_s`).
        ranks: processes the links were measured with.
        cores: cores of this machine.
        core_share: share of a core each of those ranks got while the links and the
            ring step were measured (`ray_zep.core_share`: the model's step
            alone over its seconds in every rank at once; cores / ranks when not
            measured).
        ring_step_s: what a ring step of the attention engine costs besides its kernel
            and its transfers, at `core_share` (`ray_zep.bench.calibrate_ring`).
        alone_step_s: the model's training step in one process alone, the reference
            of every probe of the share (`ShareProbe`; None: not measured).
        job_share: what share of the compute rate a rank keeps inside a training job
            (measured by `ray_zep_workers.bench_calibrate` on steps through Ray: the raylet, the
            driver and the data actor share the same cores; None: not measured): the
            median of `job_shares`, the pairs of job runs that measured it.
        run_share: share of a core each rank gets in the run being predicted (probed
            around it); None: `core_share`.
        measurements: every timed point.

    On a CPU virtual cluster every cost is CPU time: one measured in a process alone
    (kernels, a kernel call) takes 1 / share as long in a run whose ranks get `share`
    of a core each, and one measured among the ranks at `core_share` (messages, the
    ring step, which carry the compute's sharing already) takes `core_share / share`
    as long.
    """

    rates: ComputeRates
    link_latency_s: float | None = None
    link_bandwidth: float | None = None
    step_latency_s: float | None = None
    step_bandwidth: float | None = None
    latency_curve: tuple[tuple[float, float], ...] = ()
    ranks: int = 1
    cores: int = 1
    core_share: float | None = None
    ring_step_s: float = 0.0
    alone_step_s: float | None = None
    job_share: float | None = None
    job_shares: tuple[float, ...] = ()
    run_share: float | None = None
    measurements: list = field(default_factory=list)

    def save(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {**asdict(self.rates), **{k: v for k, v in asdict(self).items() if k != "rates"}}
        path.write_text(json.dumps(record, indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        """A `calibration.json` written by `save` (measurements are not read back)."""
        rates = ComputeRates.load(path)
        record = json.loads(Path(path).read_text())
        links = {k: _optional_float(record, k, path) for k in _LINK_KEYS}
        shares = {k: _optional_float(record, k, path) for k in _SHARE_KEYS}
        try:
            sizes = {k: int(record.get(k, 1)) for k in ("ranks", "cores")}
            shares["job_shares"] = tuple(float(s) for s in record.get("job_shares", ()))
            curve = tuple((float(c), float(s)) for c, s in record.get("latency_curve", ()))
            ring_step_s = float(record.get("ring_step_s", 0.0))
        except (ValueError, TypeError) as exc:
            raise ConfigError(
                f"--calibration {path}: ranks, cores, job_shares, latency_curve (pairs of "
                f"seconds) or ring_step_s is malformed ({exc}); run `ray-zep bench "
                "calibrate` again"
            ) from exc
        return cls(rates, **links, **sizes, **shares, latency_curve=curve,
                   ring_step_s=ring_step_s)  # fmt: skip

    @property
    def virtual(self) -> bool:
        """A CPU virtual cluster's calibration (its links measured)."""
        return self.link_bandwidth is not None

    def share(self, world: int) -> float:
        """Share of a core each of `world` ranks gets while all compute: probed for the
        calibrated rank count (around the run, else at calibration), cores / ranks
        otherwise; 1 for a GPU's calibration."""
        if not self.virtual:
            return 1.0
        measured = self.run_share if self.run_share is not None else self.core_share
        if measured is not None and world == self.ranks:
            return min(1.0, measured)
        return min(1.0, self.cores / world)

    def share_probe(self, shape: ModelShape) -> ShareProbe:
        """The probe of the share each rank gets around a run of a model of `shape`.

        Raises:
            ConfigError: the calibration did not time the model's step alone (written
                by an older ray_zep, or not on a virtual cluster).
        """
        if self.alone_step_s is None:
            raise ConfigError(
                "the calibration has no alone_step_s to probe the core share against: "
                "run `ray-zep bench calibrate` again"
            )
        return ShareProbe(shape, self.ranks, self.alone_step_s)

    def _factors(self, world: int) -> tuple[float, float]:
        """(share of a core that compute measured alone gets inside the job, slowdown of
        costs measured among the ranks)."""
        calibrated = world == self.ranks
        job = self.job_share if self.job_share and calibrated else 1.0
        share = self.share(world) * job
        measured_at = self.core_share if self.core_share is not None else share
        return share, measured_at / share

    def job_rates(self, world: int) -> ComputeRates:
        """The rates of one of `world` ranks inside a training job (class docstring): the
        kernels and a kernel call at the rank's share of a core (times `job_share`), the
        ring step's costs measured among the ranks rescaled to it; the fixed costs
        measured through the job (`step_overhead_s`, `fsdp_unit_overhead_s`) stay."""
        share, among = self._factors(world)
        note = f"x{self.share(world):.2f} for {world} ranks on {self.cores} cores"
        if share != self.share(world):
            note += f", x{share / self.share(world):.2f} with every rank computing in the job"
        rates = self.rates.scaled(share, note)
        if not self.virtual:
            return rates
        return dataclasses.replace(
            rates,
            call_overhead_s=self.rates.call_overhead_s / share + self.ring_step_s * among,
            ring_row_seconds=self.rates.ring_row_seconds * among,
        )

    def hardware(self, topology: TopologyConfig) -> Hardware:
        """The virtual cluster of `topology` as measured: every link at the measured message
        latency and bandwidth (the attention engine's ring messages at the latency of the
        compute between them, `latency_curve`), each rank's compute at its share of the
        cores (class docstring), the ranks sharing the cores (`CorePool`): a rank
        computes faster while others wait."""
        cluster = build_topology(topology)
        share, among = self._factors(cluster.world_size)
        bandwidth = (self.link_bandwidth or 1e9) / among
        latency = (self.link_latency_s or 0.0) * among
        links = dataclasses.replace(
            topology,
            intra_node_gbytes_per_s=bandwidth / 1e9,
            nic_gbits_per_s=bandwidth * 8 / 1e9,
            intra_node_latency_us=latency * 1e6,
            inter_node_latency_us=latency * 1e6,
        )
        cluster = build_topology(links)
        step = None
        if self.step_latency_s is not None and self.step_bandwidth:
            step = (self.step_latency_s * among, self.step_bandwidth / among)
        pool = CorePool(cluster.world_size, share) if self.virtual else None
        curve = tuple((c * among, s * among) for c, s in self.latency_curve)
        return Hardware(cluster, self.job_rates(cluster.world_size), step, pool, curve)
