"""Private Redis servers for tests, demos and benchmarks.

:class:`RedisServer` starts its own ``redis-server`` on a free loopback port, with no
persistence, and stops it on exit; it never touches a Redis it did not start::

    from throttle.testing import RedisServer

    with RedisServer() as server:
        limiter = Limiter.from_url(server.url)
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import redis

__all__ = ["RedisServer", "free_port", "redis_url_from_env"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class RedisServer:
    """A ``redis-server`` subprocess on a free loopback port.

    Parameters
    ----------
    args:
        Extra ``redis-server`` arguments, e.g. ``("--maxmemory", "10mb")``.
    executable:
        The server binary; found on PATH by default.
    start_timeout_s:
        How long to wait for the server to answer PING, in seconds.
    """

    def __init__(
        self,
        args: tuple[str, ...] = (),
        *,
        executable: str = "redis-server",
        start_timeout_s: float = 10.0,
    ) -> None:
        found = shutil.which(executable)
        if found is None:
            raise FileNotFoundError(
                f"{executable} is not on PATH: `make test` installs it "
                "(apt-get install redis-server)"
            )
        self.executable = found
        self.args = args
        self.start_timeout_s = start_timeout_s
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self, **kwargs: object) -> redis.Redis:
        """A new redis-py client of this server."""
        return redis.Redis(host="127.0.0.1", port=self.port, **kwargs)  # type: ignore[arg-type]

    def start(self) -> RedisServer:
        """Start the server (retrying on another port if one was taken meanwhile)."""
        self._dir = tempfile.TemporaryDirectory(prefix="throttle-redis-")
        for _ in range(5):
            self.port = free_port()
            log = Path(self._dir.name) / f"redis-{self.port}.log"
            self.process = subprocess.Popen(
                [
                    self.executable,
                    "--port", str(self.port),
                    "--bind", "127.0.0.1",
                    "--save", "",
                    "--appendonly", "no",
                    "--dir", self._dir.name,
                    "--logfile", str(log),
                    *self.args,
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )  # fmt: skip
            if self._wait_ready():
                return self
            self._kill()
        detail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        raise RuntimeError(f"redis-server did not start: {detail}")

    def _wait_ready(self) -> bool:
        assert self.process is not None
        deadline = time.monotonic() + self.start_timeout_s
        client = self.client(socket_timeout=1.0)
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    return False
                try:
                    if client.ping():
                        return True
                except redis.ConnectionError:
                    time.sleep(0.02)
            return False
        finally:
            client.close()

    def _kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def stop(self) -> None:
        """Stop the server and remove its directory."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._kill()
        self.process = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def redis_url_from_env() -> str | None:
    """The user's ``THROTTLE_REDIS_URL``, if set (tests and demos then use that server)."""
    return os.environ.get("THROTTLE_REDIS_URL") or None
