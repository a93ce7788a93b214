"""The driver's metrics: a Prometheus endpoint and `<train.out_dir>/metrics.jsonl`.

Both are fed from the events rank 0 sends after every step, and so are the trackers
(`metrics.tensorboard`, `metrics.wandb`): one row, every sink. metrics.jsonl gets
one JSON object per step with at least `step`, `loss`, `tokens`,
`step_seconds`; when a run resumes from step k, lines after step k (steps that
will be trained again) are removed first, so the file always tells one history.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server

from ray_zep import metrics as m
from ray_zep import steplog
from ray_zep.constants import METRICS_FILE_NAME
from ray_zep.errors import ConfigError
from ray_zep.host_usage import HostUsage
from ray_zep.tracking import Tracker, row_scalars

log = logging.getLogger(__name__)

RESIZE_LOST = "node_lost"
RESIZE_RETURNED = "nodes_returned"
RESIZE_REASONS = (RESIZE_LOST, RESIZE_RETURNED)


class MetricsExporter:
    """Serves metrics on `host`:`port` (0: any free port, -1: off) and appends metrics.jsonl."""

    def __init__(
        self,
        run_dir: Path,
        port: int,
        host: str = "127.0.0.1",
        peak_flops: float | None = None,
        trackers: Sequence[Tracker] = (),
    ) -> None:
        self.trackers = list(trackers)
        """TensorBoard / W&B: each gets every row's scalars (`ray_zep.tracking`)."""
        self.registry = CollectorRegistry()
        self.metrics = m.create_metrics(self.registry)
        self.jsonl_path = run_dir / METRICS_FILE_NAME
        self.port: int | None = None
        self.peak_flops = peak_flops
        """One GPU's peak FLOP/s for MFU (None: no MFU)."""
        self.ranks = 1
        """Ranks training now (MFU divides by them)."""
        self.nodes: int | None = None
        """Topology nodes training now (None until the workers start)."""
        for reason in RESIZE_REASONS:  # every reason answers a query from the start, as 0
            self.metrics[m.RESIZES.name].labels(reason=reason)
        self.address: tuple[str, int] | None = None
        self._server = None
        if port >= 0:
            try:
                self._server, _ = start_http_server(port, addr=host, registry=self.registry)
            except OSError as exc:
                raise ConfigError(
                    f"config keys metrics.host={host} metrics.port={port}: cannot serve "
                    f"metrics ({exc.strerror}); choose a local address and a free port, "
                    "0 for any, or -1 to turn the endpoint off"
                ) from None
            self.port = self._server.server_port
            self.address = self._server.server_address[:2]
            """(address, port) the endpoint listens on."""
            log.info("Prometheus metrics on http://%s:%d/metrics", host, self.port)

    def set_ranks(self, ranks: int) -> None:
        """The job's configured ranks (and, until the workers say otherwise, the live ones)."""
        self.ranks = ranks
        self.metrics[m.RANKS.name].set(ranks)
        self.metrics[m.WORLD_SIZE.name].set(ranks)

    def on_restart(self) -> None:
        """The workers started again from a checkpoint (Ray Train's failure handling)."""
        self.metrics[m.RESTARTS.name].inc()

    def on_resize(self, reason: str) -> None:
        """An elastic run's worker group came back with another size (a RESIZE_REASONS)."""
        self.metrics[m.RESIZES.name].labels(reason=reason).inc()

    def on_start(self, step: int, nodes: int | None = None, world_size: int | None = None) -> None:
        """Training (re)starts after `step` on `nodes` nodes of `world_size` ranks: drop
        jsonl lines of later steps."""
        steplog.rewind(self.jsonl_path, step)
        self._track(lambda tracker: tracker.start(step))
        if nodes is not None:
            self.nodes = nodes
            self.metrics[m.LIVE_NODES.name].set(nodes)
        if world_size is not None:
            self.ranks = world_size
            self.metrics[m.WORLD_SIZE.name].set(world_size)

    def on_step(
        self, event: dict[str, Any], processes: dict[str, HostUsage] | None = None
    ) -> dict[str, Any]:
        """Record one step; returns the row written to metrics.jsonl.

        Args:
            event: rank 0's step event.
            processes: the host usage of the processes beside the ranks (`driver`,
                `data`), as last sampled; the ranks' own come with the event.
        """
        seconds = max(event["step_seconds"], 1e-9)
        rank_tokens, rank_flops = event["rank_tokens"], event.get("rank_flops", [])
        mean = sum(rank_tokens) / max(1, len(rank_tokens))
        mean_flops = sum(rank_flops) / max(1, len(rank_flops))
        row = {
            "step": event["step"],
            "loss": event["loss"],
            "tokens": event["tokens"],
            "label_tokens": event["label_tokens"],
            "step_seconds": seconds,
            "tokens_per_second": event["tokens"] / seconds,
            "data_seconds": event["data_seconds"],
            "lr": event["lr"],
            "grad_norm": event["grad_norm"],
            "rank_tokens": rank_tokens,
            "rank_token_imbalance": max(rank_tokens) / mean if mean else 1.0,
            "rank_flops": rank_flops,
            "rank_flop_imbalance": max(rank_flops) / mean_flops if mean_flops else 1.0,
            "comm_bytes": event["comm_bytes"],
            "nic_bytes": event.get("nic_bytes", []),
            "compression": event.get("compression", {}),
            "zone_tokens": event.get("zone_tokens", {}),
            "model_flops_per_second": event.get("model_flops", 0.0) / seconds,
            "memory": event.get("memory", {}),
            "world_size": self.ranks,
            "nodes": self.nodes,
            "time": time.time(),
        }
        host, processes = event.get("host", {}), processes or {}
        for figure in ("rss_bytes", "open_fds"):
            row[figure] = {name: getattr(use, figure) for name, use in processes.items()}
            row[figure]["ranks"] = host.get(figure, [])
        if event.get("switcher"):  # the first step with comm.compression=auto
            row["switcher"] = event["switcher"]
        if self.peak_flops:
            row["mfu"] = row["model_flops_per_second"] / (self.ranks * self.peak_flops)
        self._update_prometheus(row)
        self._record(row)
        return row

    def on_eval(self, event: dict[str, Any]) -> dict[str, Any]:
        """Record one evaluation (`train.eval_every`); returns the row written to
        metrics.jsonl (it has no `step_seconds`: readers of step rows skip it)."""
        row = {
            "step": event["step"],
            "eval_loss": event["loss"],
            "eval_label_tokens": event["label_tokens"],
            "eval_documents": event["documents"],
            "eval_seconds": event["seconds"],
            "time": time.time(),
        }
        self.metrics[m.EVAL_LOSS.name].set(row["eval_loss"])
        self._record(row)
        return row

    def on_checkpoint(self, step: int) -> None:
        self.metrics[m.CHECKPOINTS.name].inc()
        self.metrics[m.CHECKPOINT_STEP.name].set(step)

    def _record(self, row: dict[str, Any]) -> None:
        """One row, every sink: metrics.jsonl and the trackers."""
        steplog.append_row(self.jsonl_path, row)
        scalars = row_scalars(row)
        self._track(lambda tracker: tracker.log(row["step"], scalars))

    def _track(self, call: Callable[[Tracker], None]) -> None:
        """`call` on every tracker; one that fails is dropped with a warning (metrics.jsonl
        and the endpoint go on: a tracker is not worth a training run)."""
        for tracker in list(self.trackers):
            try:
                call(tracker)
            except Exception as exc:
                self.trackers.remove(tracker)
                log.warning(
                    "metrics.%s stops recording: %s: %s", tracker.name, type(exc).__name__, exc
                )

    def close(self) -> None:
        self._track(lambda tracker: tracker.close())
        self.trackers.clear()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def _update_prometheus(self, row: dict[str, Any]) -> None:
        get = self.metrics.__getitem__
        get(m.TOKENS.name).inc(row["tokens"])
        get(m.STEPS.name).inc()
        get(m.STEP.name).set(row["step"])
        get(m.TOKENS_PER_SECOND.name).set(row["tokens_per_second"])
        get(m.STEP_SECONDS.name).set(row["step_seconds"])
        get(m.STEP_DURATION.name).observe(row["step_seconds"])
        get(m.DATA_WAIT_SECONDS.name).set(row["data_seconds"])
        get(m.LOSS.name).set(row["loss"])
        get(m.LEARNING_RATE.name).set(row["lr"])
        get(m.GRAD_NORM.name).set(row["grad_norm"])
        get(m.RANK_TOKEN_IMBALANCE.name).set(row["rank_token_imbalance"])
        for stream, sizes in row["compression"].items():
            raw, wire = sizes["raw_bytes"], sizes["wire_bytes"]
            get(m.COMPRESSION_RAW_BYTES.name).labels(stream=stream).inc(raw)
            get(m.COMPRESSION_WIRE_BYTES.name).labels(stream=stream).inc(wire)
            if wire:
                get(m.COMPRESSION_RATIO.name).labels(stream=stream).set(raw / wire)
        get(m.MODEL_FLOPS_PER_SECOND.name).set(row["model_flops_per_second"])
        if "mfu" in row:
            get(m.MFU.name).set(row["mfu"])
        for kind in ("modelled", "measured"):
            peak = max(row["memory"].get(kind) or [0.0])
            if peak > 0:  # ranks measure on some steps only (CPU: metrics.memory_every)
                get(m.RANK_MEMORY.name).labels(kind=kind).set(peak)
        for figure, spec in (("rss_bytes", m.PROCESS_RESIDENT_BYTES),
                             ("open_fds", m.PROCESS_OPEN_FDS)):  # fmt: skip
            for process, value in row[figure].items():
                if process == "ranks":
                    process, value = "rank_max", max(value, default=0)
                get(spec.name).labels(process=process).set(value)
        for zone, tokens in row["zone_tokens"].items():
            get(m.ZONE_TOKENS.name).labels(zone=zone).inc(tokens)
        for link, nbytes in row["comm_bytes"].items():
            get(m.COMM_BYTES.name).labels(link=link).inc(nbytes)
        for node, nics in enumerate(row["nic_bytes"]):
            for nic, nbytes in enumerate(nics):
                get(m.NIC_BYTES.name).labels(node=str(node), nic=str(nic)).inc(nbytes)
