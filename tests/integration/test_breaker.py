"""A limiter Redis that hangs (accepts connections, never answers): each call waits for the
socket timeout. After two calls in a row failed, a process's gates stop asking it for
``PROBE_S`` (``on_redis_down`` applies at once), then one call asks again
(:class:`throttle.celery.outage.Breaker`). Judged on what reached the hung server, not on
how long the calls took."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest
from celery import Celery

from tests.support.eager import close_throttler
from throttle.celery import ThrottledTask, outage, throttled


class Hung:
    """A TCP server that accepts every connection and reads what it is sent, and never
    answers: a Redis stopped with SIGSTOP, as a client sees it."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.received = 0
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            self._open.append(connection)
            threading.Thread(target=self._read, args=(connection,), daemon=True).start()

    def _read(self, connection: socket.socket) -> None:
        while True:
            try:
                data = connection.recv(65536)
            except OSError:
                return
            if not data:
                return
            with self._lock:
                self.received += len(data)

    def close(self) -> None:
        self.listener.close()
        for connection in self._open:
            connection.close()


@pytest.fixture
def hung() -> Iterator[Hung]:
    server = Hung()
    yield server
    server.close()


def test_a_hung_redis_is_not_asked_for_every_task(
    hung: Hung, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = Celery("breaker", set_as_current=False, task_cls=ThrottledTask)
    app.conf.update(
        task_always_eager=True,
        throttle_redis_url=f"redis://127.0.0.1:{hung.port}/0?socket_timeout=0.2",
        throttle_config={"limits": {"api": {"rate": "100/s", "on_redis_down": "allow:60s"}}},
    )

    @app.task(shared=False)
    @throttled("api")
    def call(x: int) -> int:
        return x

    monkeypatch.setattr(outage, "PROBE_S", 3600.0)  # no probe in this part, however slow
    try:
        # The first task asks (the run-time modes, its acquisition), waits for the
        # timeouts, and runs (allow:60s): two calls failed in a row
        assert call.delay(1).get() == 1
        assert call.delay(2).get() == 2
        asked_twice = hung.received
        assert asked_twice > 0
        # The next ones run at once, asking nothing
        assert [call.delay(x).get() for x in range(3, 13)] == list(range(3, 13))
        assert hung.received == asked_twice
        # Once PROBE_S has passed, one asks again
        monkeypatch.setattr(outage, "PROBE_S", 0.0)
        assert call.delay(13).get() == 13
        assert hung.received > asked_twice
    finally:
        close_throttler(app)
