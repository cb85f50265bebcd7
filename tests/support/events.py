"""Celery events on a broker, captured by Celery's own event receiver (what Flower reads)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any


class EventLog:
    """The events of one type on ``app``'s broker (``events``), and the messages that
    carried them (``messages``: each a list of events, or one event), from the moment the
    receiver is subscribed."""

    def __init__(self, app: Any, event_type: str = "task-throttled") -> None:
        self.events: list[dict[str, Any]] = []
        self.messages: list[Any] = []
        self.connection = app.connection_for_read()
        self.receiver = app.events.Receiver(
            self.connection, handlers={event_type: self.events.append}
        )
        receive = self.receiver._receive

        def counted(body: Any, message: Any) -> None:
            self.messages.append(body)
            receive(body, message)

        self.receiver._receive = counted
        ready = threading.Event()
        self.thread = threading.Thread(
            target=self._run, args=(ready,), daemon=True, name="event-log"
        )
        self.thread.start()
        ready.wait(5)
        # Events sent before the receiver subscribed are lost: probe until one arrives.
        with app.events.default_dispatcher() as dispatcher:
            deadline = time.monotonic() + 10
            while not self.events and time.monotonic() < deadline:
                dispatcher.send(event_type, uuid="probe")
                time.sleep(0.1)
        assert self.events, "the event receiver did not start"
        time.sleep(0.2)
        self.events.clear()
        self.messages.clear()

    def _run(self, ready: threading.Event) -> None:
        ready.set()
        with contextlib.suppress(Exception):
            self.receiver.capture(limit=None, timeout=None, wakeup=False)

    def wait_for(
        self,
        n: int,
        timeout_s: float = 10,
        where: Callable[[dict[str, Any]], bool] = lambda event: True,
    ) -> list[dict[str, Any]]:
        """The events that ``where`` selects, once there are ``n`` of them (or after
        ``timeout_s``) and 0.2 s more (no more than ``n``); the receiver stops."""
        deadline = time.monotonic() + timeout_s
        while sum(map(where, self.events)) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # and no more than n
        self.stop()
        return [event for event in self.events if where(event)]

    def stop(self) -> None:
        self.receiver.should_stop = True
        self.thread.join(5)
        self.connection.release()
