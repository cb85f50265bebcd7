"""Start the pieces of a throttled Celery fleet on this machine: shared by ``make demo``, the
benchmark and the tests, so that all three run the same thing.

* :func:`start_api`: the mock rate-capped API (``workers/mock_api.py``) in a thread;
* :class:`Worker`: one real ``celery worker`` subprocess of ``workers.demo_app`` (prefork);
* :func:`wait_ready`: until every worker answers ``app.control.ping``;
* :class:`LocalStack`: the services of ``workers/stack.py`` (the compose stack) as processes
  here, started from the very commands docker-compose.yml runs.

Workers get their settings from the environment (see ``workers/demo_app.py``); nothing here
touches a Redis it did not start, the callers pass the URL of a private one.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workers.mock_api import MockApi, serve
from workers.stack import Addresses, Service, environment, worker_argv

if TYPE_CHECKING:
    from tests.support.servers import RedisServer

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


def start_api(rate: float, burst: float = 1.0, *, retry_after_only: bool = False) -> Api:
    api = MockApi(rate, burst, retry_after_only=retry_after_only)
    server = serve(api)
    threading.Thread(target=server.serve_forever, name="mock-api", daemon=True).start()
    host, port = server.server_address[:2]
    return Api(api, f"http://{host}:{port}", server)


def local_argv(argv: list[str] | tuple[str, ...]) -> list[str]:
    """A stack command as run on this machine: ``python`` is this interpreter (the venv's)."""
    return [sys.executable, *argv[1:]] if argv and argv[0] == "python" else list(argv)


class _Child:
    """A subprocess started from a stack command, its output in ``log`` (or discarded, or
    on our own stdout for a foreground process)."""

    name: str
    env: dict[str, str]
    log: Path | None
    proc: subprocess.Popen[bytes] | None

    def _spawn(self, argv: list[str] | tuple[str, ...], foreground: bool = False) -> None:
        env = {**os.environ, **self.env}
        if foreground:  # our own stdout: a progress bar sees the terminal
            self.proc = subprocess.Popen(local_argv(argv), cwd=ROOT, env=env)
        elif self.log is None:
            self.proc = subprocess.Popen(
                local_argv(argv), cwd=ROOT, env=env,
                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
            )  # fmt: skip
        else:
            with open(self.log, "wb") as out:  # the child keeps its own descriptor
                self.proc = subprocess.Popen(
                    local_argv(argv), cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
                )

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """Warm shutdown (SIGTERM: a worker finishes its running tasks), then SIGKILL."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.proc.wait(10)

    def kill(self) -> None:
        """SIGKILL the process and its children (a crash, not a shutdown)."""
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


@dataclass
class Process(_Child):
    """One service of ``workers/stack.py`` run as a subprocess: ``argv`` as in compose."""

    name: str
    argv: tuple[str, ...]
    env: dict[str, str]
    log: Path | None = None
    proc: subprocess.Popen[bytes] | None = None
    foreground: bool = False

    def start(self) -> Process:
        self._spawn(self.argv, self.foreground)
        return self

    @property
    def hostname(self) -> str:
        """A worker's Celery node name: its ``-n`` with ``%h`` filled in."""
        name = self.argv[self.argv.index("-n") + 1]
        return name.replace("%h", socket.gethostname())


@dataclass
class Worker(_Child):
    """One ``celery worker`` subprocess (``-P prefork``, or ``pool``) consuming ``queues``.

    Its command is :func:`workers.stack.worker_argv`, the one the compose workers run.
    """

    name: str
    env: dict[str, str]
    concurrency: int = 4
    queues: str = "upstream"
    app: str = "workers.demo_app"
    log: Path | None = None
    extra: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    events: bool = False
    pool: str = "prefork"

    @property
    def argv(self) -> list[str]:
        return worker_argv(
            self.name, app=self.app, concurrency=self.concurrency, queues=self.queues,
            events=self.events, extra=tuple(self.extra), pool=self.pool,
        )  # fmt: skip

    def start(self) -> Worker:
        self._spawn(self.argv)
        return self

    @property
    def hostname(self) -> str:
        return f"{self.name}@{socket.gethostname()}"


def wait_ready(app: Any, workers: Sequence[Worker | Process], timeout_s: float = 120.0) -> None:
    """Block until every worker answers a ping (or raise, with the worker's exit code).

    Generous: a worker imports Celery and forks its children in a few seconds on a quiet
    host, but a loaded 2-core one (a CI runner) can take ten times that."""
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


@contextlib.contextmanager
def running(app: Any, workers: Sequence[Worker], *, kill: bool = False) -> Iterator[None]:
    """Start ``workers``, wait until each answers a ping, and stop them on exit (a warm
    shutdown; ``kill``: SIGKILL, for fleets whose tasks are left mid-flight)."""
    try:
        for worker in workers:
            worker.start()
        wait_ready(app, workers)
        yield
    finally:
        for worker in workers:
            if kill:
                worker.kill()
            else:
                worker.stop()


def demo_env(redis_url: str, api_url: str, **extra: str) -> dict[str, str]:
    """The environment of ``workers.demo_app`` for a private Redis and mock API."""
    return {"DEMO_BROKER_URL": redis_url, "MOCK_API_URL": api_url, **extra}


class LocalStack:
    """The services of ``workers/stack.py`` as processes on this machine, on loopback ports.

    Entering starts everything but the producer: a private ``redis-server``, the mock API,
    the workers (until each answers a ping) and Flower (until ``/healthcheck`` answers);
    :meth:`start` then runs any service by name, e.g. ``"producer"``, with the same
    environment. Each process logs to ``logs/<service>.log``. Leaving stops them all,
    workers with a warm shutdown. ``env`` is added to every Python service's environment
    (e.g. another ``THROTTLE_CONFIG``).
    """

    def __init__(
        self, services: dict[str, Service], logs: Path, env: dict[str, str] | None = None
    ) -> None:
        self.services, self.logs, self.extra_env = services, logs, env or {}
        self.redis: RedisServer | None = None
        self.processes: list[Process] = []
        self.env: dict[str, str] = {}
        self.api_url = self.flower_url = ""

    def __enter__(self) -> LocalStack:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _start(self) -> None:
        # Imported here: the worker containers import this module (workers.demo_app reads
        # WORKER_SETTINGS) and their image carries workers/, not tests/.
        from tests.support.servers import RedisServer, free_port  # noqa: PLC0415

        redis_argv = self.services["redis"].argv
        self.redis = RedisServer(redis_argv[1:], executable=redis_argv[0]).start()
        api = self._run("mock-api", {})
        self.api_url = _await_line(api, re.compile(r"mock API on (http://\S+)")).group(1)
        port = free_port()
        self.flower_url = f"http://127.0.0.1:{port}"
        addresses = Addresses(self.redis.url, self.api_url, "127.0.0.1", port, self.flower_url)
        # The temporary directory of this stack's own: the workers' metric files (by
        # default under the temp dir, shared by every worker of the namespace on this
        # host, and summed by Flower) then hold this run's workers only.
        self.env = {**environment(addresses), "TMPDIR": str(self.logs), **self.extra_env}
        workers = [self.start(name) for name in self.services if name.startswith("worker")]
        flower = self.start("flower")
        from celery import Celery  # noqa: PLC0415 (the harness's other users need no Celery)

        pinger = Celery("stack-ping", broker=self.redis.url)
        try:
            wait_ready(pinger, workers)
        finally:
            pinger.close()
        _await_http(flower, f"{self.flower_url}/healthcheck")

    def start(self, name: str, *, foreground: bool = False) -> Process:
        """Start service ``name`` with the stack's environment (its command as in compose);
        a ``foreground`` one writes to our stdout instead of its log."""
        service = self.services[name]
        return self._run(name, self.env if service.python_env else {}, foreground)

    def _run(self, name: str, env: dict[str, str], foreground: bool = False) -> Process:
        service = self.services[name]
        argv = (*service.argv, *service.local_args)
        log = self.logs / f"{name}.log"
        process = Process(name, argv, env, log=log, foreground=foreground).start()
        self.processes.append(process)
        return process

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop()
        self.processes.clear()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None


def _await_line(
    process: Process, pattern: re.Pattern[str], timeout_s: float = 60.0
) -> re.Match[str]:
    """Wait for a line matching ``pattern`` in the process's log (generous, as wait_ready)."""
    assert process.log is not None and process.proc is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = pattern.search(process.log.read_text(errors="replace"))
        if found:
            return found
        if process.proc.poll() is not None:
            break
        time.sleep(0.05)
    tail = process.log.read_text(errors="replace")[-2000:]
    raise RuntimeError(f"{process.name} did not print {pattern.pattern!r}: {tail}")


def _await_http(process: Process, url: str, timeout_s: float = 120.0) -> None:
    """Wait until ``url`` answers 200 (or the process exits; generous, as wait_ready)."""
    assert process.proc is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.proc.poll() is not None:
            raise RuntimeError(f"{process.name} exited with code {process.proc.returncode}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as response:
            if response.status == 200:
                return
        time.sleep(0.1)
    raise TimeoutError(f"{process.name} not answering {url} after {timeout_s} s")
