"""Where benchmark results go: a JSON record with the machine and command, and a PNG."""

from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path
from typing import Any

import torch


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "gpu": gpu, "torch": torch.__version__}


def write_json(path: Path, command: str, spec: dict, rows: list[dict]) -> Path:
    return write_record(path, command, {"spec": spec, "rows": rows})


def write_record(path: Path, command: str, record: dict[str, Any]) -> Path:
    """`record` with the command, date and machine added, as indented JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    stamped = {
        "command": command,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        **record,
    }
    path.write_text(json.dumps(stamped, indent=1) + "\n")
    return path
