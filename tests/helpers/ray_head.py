"""A real Ray head on this machine, with token authentication, for `ray job submit` tests.

The head is started with `ray start --head` as an operator would: its job API and
dashboard listen on 127.0.0.1 only, and token authentication is on (Ray 2.60:
`RAY_AUTH_MODE=token`, the token read from `RAY_AUTH_TOKEN_PATH`). Every client
call goes through the `ray` CLI with the same two variables, as README says.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers.procs import free_port

START_TIMEOUT_S = 120.0
CLI_TIMEOUT_S = 120.0


@dataclass
class RayHead:
    root: Path
    """Stands for /tmp on this machine: the head's temp dir is ROOT/ray, where Ray
    records the cluster of the last `ray start` (a driver with RAY_TMPDIR=ROOT finds it)."""
    job_api: str
    """http://127.0.0.1:<dashboard port>"""
    gcs_address: str
    """127.0.0.1:<port>, the address `ray.init` and RAY_ADDRESS take."""
    token_path: Path
    pids: set[int] = field(default_factory=set)

    @property
    def temp_dir(self) -> Path:
        return self.root / "ray"

    def local_env(self) -> dict[str, str]:
        """A client on this machine that names no cluster: Ray's record of the last
        `ray start` leads it to this head (with the token the head requires)."""
        return {**self.client_env(), "RAY_TMPDIR": str(self.root)}

    def client_env(self, with_token: bool = True) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        if with_token:
            env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(self.token_path))
        return env

    def ray(self, *args: str, with_token: bool = True) -> subprocess.CompletedProcess:
        """Run `ray <args>` against this head's job API."""
        return subprocess.run(
            ["ray", *args],
            env={**self.client_env(with_token), "RAY_API_SERVER_ADDRESS": self.job_api},
            capture_output=True,
            text=True,
            timeout=CLI_TIMEOUT_S,
        )

    def submit(self, job_id: str, working_dir: Path, runtime_env: str, entrypoint: list[str]):
        """Start `ray job submit` (which waits for the job and tails its logs)."""
        return subprocess.Popen(
            [
                "ray",
                "job",
                "submit",
                "--address",
                self.job_api,
                "--submission-id",
                job_id,
                "--working-dir",
                str(working_dir),
                "--runtime-env-json",
                runtime_env,
                "--",
                *entrypoint,
            ],
            env=self.client_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def wait_for_end(self, job_id: str, timeout_s: float) -> str:
        """The job's terminal status (SUCCEEDED, FAILED or STOPPED), polled through the job
        SDK every 0.1 s: `ray job submit`'s own log tail returns about 5 s after the job
        ended (it sleeps a second at every end of the log and checks the status between).
        A job `ray job submit` has not yet created answers 404 until it has."""
        ask = (
            "import sys, time; from ray.job_submission import JobSubmissionClient as C\n"
            "client, job = C(sys.argv[1]), sys.argv[2]\n"
            "def status():\n"
            "    try:\n"
            "        return client.get_job_status(job)\n"
            "    except RuntimeError as exc:\n"
            "        if 'status code 404' not in str(exc): raise\n"
            "while (found := status()) is None or not found.is_terminal(): time.sleep(0.1)\n"
            "print(found.value)"
        )
        done = subprocess.run(
            [sys.executable, "-c", ask, self.job_api, job_id],
            env=self.client_env(),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.strip().splitlines()[-1]

    def logs(self, job_id: str) -> str:
        return self.ray("job", "logs", job_id).stdout

    def driver_log(self, job_id: str) -> str:
        """The job driver's log as the head writes it (cheap to poll); empty while it does
        not exist. Checking and then reading races the head, which can move the
        `session_latest` link between the two: only the read decides."""
        path = self.temp_dir / "session_latest" / "logs" / f"job-driver-{job_id}.log"
        try:
            return path.read_text(errors="replace")
        except FileNotFoundError:
            return ""


_SHARED: list[RayHead] = []


def shared_head(num_cpus: int, object_store_mb: int) -> RayHead:
    """The session's one head (started on first use)."""
    if not _SHARED:
        _SHARED.append(start_ray_head(num_cpus, object_store_mb))
    return _SHARED[0]


def stop_shared_head() -> None:
    """Stop the session's head if it runs (its idle processes slow other clusters' starts)."""
    while _SHARED:
        stop_ray_head(_SHARED.pop())


def start_ray_head(num_cpus: int, object_store_mb: int) -> RayHead:
    """Start a head whose job API listens on 127.0.0.1 and requires a token."""
    # Unix socket paths must stay short, so not under pytest's long tmp paths.
    root = Path(tempfile.mkdtemp(prefix="rzh"))
    token_path = root / "auth_token"
    token_path.write_text(secrets.token_hex(32))
    token_path.chmod(0o600)
    gcs_address = f"127.0.0.1:{free_port()}"
    head = RayHead(root, f"http://127.0.0.1:{free_port()}", gcs_address, token_path)
    before = _ray_pids()
    started = subprocess.run(
        [
            "ray",
            "start",
            "--head",
            "--node-ip-address=127.0.0.1",
            f"--port={gcs_address.rsplit(':', 1)[1]}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={head.job_api.rsplit(':', 1)[1]}",
            f"--ray-client-server-port={free_port()}",
            f"--num-cpus={num_cpus}",
            f"--object-store-memory={object_store_mb * 1024 * 1024}",
            f"--temp-dir={head.temp_dir}",
            "--disable-usage-stats",
        ],
        env=head.client_env(),
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT_S,
    )
    head.pids = _ray_pids() - before
    if started.returncode != 0:
        stop_ray_head(head)
        raise RuntimeError(f"ray start failed:\n{started.stdout}\n{started.stderr}")
    return head


def stop_ray_head(head: RayHead) -> None:
    """Stop only this head's processes (never other Ray clusters on the machine)."""
    mine = head.pids | {pid for pid, cmd in process_table().items() if str(head.root) in cmd}
    for pid in mine:  # nothing of a test cluster needs a graceful end
        _signal(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(pid) for pid in mine):
        time.sleep(0.2)
    shutil.rmtree(head.root, ignore_errors=True)


def process_table() -> dict[int, str]:
    """pid -> command line (process title) of every process we can read."""
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                raw = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            table[int(entry.name)] = raw.replace(b"\0", b" ").decode(errors="replace").strip()
    return table


def pids_matching(*needles: str) -> list[int]:
    return sorted(
        pid for pid, cmd in process_table().items() if all(needle in cmd for needle in needles)
    )


def _ray_pids() -> set[int]:
    return {pid for pid, cmd in process_table().items() if "ray" in cmd}


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and "Z" not in _state(pid)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"
