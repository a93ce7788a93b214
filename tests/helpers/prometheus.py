"""A real Prometheus server (Debian's `prometheus` package) on loopback, for tests.

`.ci/run` installs the package and sets RAY_ZEP_REQUIRE_PROMETHEUS=1, so there a
missing server fails the test instead of skipping it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.procs import free_port

SCRAPE_INTERVAL = "250ms"
READY_TIMEOUT_S = 60.0


def prometheus_binary() -> str:
    """Path of the `prometheus` binary, or skip (fail where CI requires it)."""
    found = shutil.which("prometheus")
    if found:
        return found
    reason = "needs Debian's prometheus package (apt-get install prometheus)"
    if os.environ.get("RAY_ZEP_REQUIRE_PROMETHEUS") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


@dataclass
class PrometheusServer:
    process: subprocess.Popen
    url: str

    def query_range(self, query: str, start: float, end: float) -> list[dict]:
        """Series of a range query, as Grafana asks it ($__rate_interval etc. not used)."""
        params = urllib.parse.urlencode({"query": query, "start": start, "end": end, "step": 0.25})
        with urllib.request.urlopen(f"{self.url}/api/v1/query_range?{params}", timeout=30) as r:
            answer = json.load(r)
        assert answer["status"] == "success", answer
        return answer["data"]["result"]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()


def start_prometheus(binary: str, target_port: int, data_dir: Path) -> PrometheusServer:
    """Serve on 127.0.0.1, scraping 127.0.0.1:`target_port` every 250 ms."""
    data_dir.mkdir(parents=True, exist_ok=True)
    config = data_dir / "prometheus.yml"
    config.write_text(
        "global:\n"
        f"  scrape_interval: {SCRAPE_INTERVAL}\n"
        f"  scrape_timeout: {SCRAPE_INTERVAL}\n"
        "scrape_configs:\n"
        "  - job_name: ray_zep\n"
        "    static_configs:\n"
        f"      - targets: ['127.0.0.1:{target_port}']\n"
    )
    address = f"127.0.0.1:{free_port()}"
    process = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={data_dir / 'tsdb'}",
            f"--web.listen-address={address}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=(data_dir / "prometheus.log").open("w"),
    )
    server = PrometheusServer(process, f"http://{address}")
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        try:
            with urllib.request.urlopen(f"{server.url}/-/ready", timeout=5) as answer:
                if answer.status == 200:
                    return server
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            server.stop()
            log = (data_dir / "prometheus.log").read_text()[-2000:]
            raise RuntimeError(f"prometheus did not become ready:\n{log}")
        time.sleep(0.2)


def has_finite_sample(series: list[dict]) -> bool:
    return any(math.isfinite(float(value)) for s in series for _, value in s["values"])
