"""Start the pieces of a throttled Celery fleet on this machine: shared by ``make demo``, the
benchmark and the tests, so that all three run the same thing.

* :func:`start_api`: the mock rate-capped API (``workers/mock_api.py``) in a thread;
* :class:`Worker`: one real ``celery worker`` subprocess of ``workers.demo_app`` (prefork);
* :func:`wait_ready`: until every worker answers ``app.control.ping``.

Workers get their settings from the environment (see ``workers/demo_app.py``); nothing here
touches a Redis it did not start, the callers pass the URL of a private one.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workers.mock_api import MockApi, serve

ROOT = Path(__file__).resolve().parent.parent

WORKER_SETTINGS = {
    "task_default_queue": "upstream",
    "task_acks_late": True,
    "task_reject_on_worker_lost": True,
    "worker_prefetch_multiplier": 1,
    "broker_connection_retry_on_startup": True,
    "result_expires": 3600,
}
"""The Celery settings shared by the demo app and the benchmark's baseline apps, so that
every variant runs under the same conditions: late acks, one prefetched task per child."""


@dataclass
class Api:
    """A running mock API."""

    api: MockApi
    url: str
    server: Any

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def start_api(rate: float, burst: float = 1.0) -> Api:
    api = MockApi(rate, burst)
    server = serve(api)
    threading.Thread(target=server.serve_forever, name="mock-api", daemon=True).start()
    host, port = server.server_address[:2]
    return Api(api, f"http://{host}:{port}", server)


@dataclass
class Worker:
    """One ``celery worker`` subprocess (``-P prefork``) consuming ``queues``."""

    name: str
    env: dict[str, str]
    concurrency: int = 4
    queues: str = "upstream"
    app: str = "workers.demo_app"
    log: Path | None = None
    extra: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Worker:
        command = [
            sys.executable, "-m", "celery", "-A", self.app, "worker", "-P", "prefork",
            "-c", str(self.concurrency), "-Q", self.queues, "-n", f"{self.name}@%h",
            "--without-mingle", "--without-gossip", "-l", "INFO", *self.extra,
        ]  # fmt: skip
        if self.log is None:
            self.proc = subprocess.Popen(
                command, cwd=ROOT, env={**os.environ, **self.env},
                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
            )  # fmt: skip
        else:
            with open(self.log, "wb") as out:  # the child keeps its own descriptor
                self.proc = subprocess.Popen(
                    command, cwd=ROOT, env={**os.environ, **self.env},
                    stdout=out, stderr=subprocess.STDOUT,
                )  # fmt: skip
        return self

    @property
    def hostname(self) -> str:
        import socket  # noqa: PLC0415

        return f"{self.name}@{socket.gethostname()}"

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """Warm shutdown (SIGTERM: finish running tasks), then SIGKILL if it hangs."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.proc.wait(10)

    def kill(self) -> None:
        """SIGKILL the worker and its pool children (a crash, not a shutdown)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            import psutil  # noqa: PLC0415

            children = psutil.Process(self.proc.pid).children(recursive=True)
        except Exception:  # psutil missing or the process just ended
            children = []
        self.proc.kill()
        for child in children:
            with contextlib.suppress(Exception):
                child.kill()
        self.proc.wait(10)


def wait_ready(app: Any, workers: list[Worker], timeout_s: float = 60.0) -> None:
    """Block until every worker answers a ping (or raise, with the worker's exit code)."""
    wanted = {w.hostname for w in workers}
    deadline = time.monotonic() + timeout_s
    seen: set[str] = set()
    while time.monotonic() < deadline:
        for w in workers:
            if w.proc is not None and w.proc.poll() is not None:
                raise RuntimeError(f"worker {w.name} exited with code {w.proc.returncode}")
        for reply in app.control.ping(timeout=0.5) or []:
            seen.update(reply)
        if wanted <= seen:
            return
    raise TimeoutError(f"workers not ready after {timeout_s} s: {sorted(wanted - seen)}")


def demo_env(redis_url: str, api_url: str, **extra: str) -> dict[str, str]:
    """The environment of ``workers.demo_app`` for a private Redis and mock API."""
    return {"DEMO_BROKER_URL": redis_url, "MOCK_API_URL": api_url, **extra}
