"""Task events of one process sent in batches: one broker message per batch.

``Task.send_event`` publishes one message per event, on a dispatcher it builds for that
event; over the Redis broker kombu also builds a client for every publish. That is about
0.7 ms of a pool child's CPU per event, as much as the rest of a throttled task's
overhead together: right for an event per deferral, too much for one per task
(``task-shadowed``: a limit in shadow mode that would have delayed the task).

:class:`BatchedEvents` gathers such events and publishes them as one message, a list of
events under the routing key ``task.multi``: the form in which a worker's main process
sends its own buffered task events (``celery/events/dispatcher.py``,
``EventDispatcher.flush``), which Celery's event receiver, and so Flower, reads as the
events one by one. The price: an event reaches Flower up to :data:`EVERY_S` late, and
the events of a process that dies (or a pool child that exits) within that time are
lost; they are for people (:mod:`throttle.gathering`).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from celery import Celery
from celery.utils.time import utcoffset

from throttle.gathering import Gathering

logger = logging.getLogger("throttle")

EVERY_S = 1.0
"""The longest an event waits for its batch to be sent, in s."""
BATCH_MAX = 200
"""A batch this long is sent at once (one message stays small)."""


class BatchedEvents(Gathering[list[dict[str, Any]]]):
    """Task events of this process, published together at most every ``every_s`` s (or
    every ``batch_max`` events) in one message (:class:`throttle.gathering.Gathering`). A
    publish that fails loses its batch (logged at DEBUG): never the task."""

    def __init__(self, app: Celery, *, every_s: float = EVERY_S, batch_max: int = BATCH_MAX):
        self.app = app
        self.batch_max = batch_max
        super().__init__(every_s)

    def _reset(self) -> None:
        self._pending: list[dict[str, Any]] = []

    def send(self, type_: str, *, uuid: str, hostname: str | None, **fields: Any) -> None:
        """Add one event of the task ``uuid`` (the worker's ``hostname``, as the event of
        ``Task.send_event`` carries it), sent within ``every_s``."""
        self.send_many(type_, [{"uuid": uuid, "hostname": hostname, **fields}])

    def send_many(self, type_: str, events: list[dict[str, Any]]) -> None:
        """Add events of ``type_``, each the fields of one (``uuid`` and ``hostname``
        among them: :meth:`send`), sent within ``every_s``. Stamped as ``Event`` stamps
        one (``timestamp``), with this process's ``utcoffset`` and ``pid``, and each its
        own tick of the app's clock."""
        offset, pid, clock, now = utcoffset(), os.getpid(), self.app.clock, time.time()
        for event in events:
            event.update(
                type=type_, timestamp=now, utcoffset=offset, pid=pid, clock=clock.forward()
            )
        with self._lock:
            self._pending += events
            full = len(self._pending) >= self.batch_max
            if not full:
                self._arm()
        if full:
            self.flush()

    def _take(self) -> list[dict[str, Any]] | None:
        return self._pending or None

    def _write(self, batch: list[dict[str, Any]]) -> None:
        """Publish ``batch`` as one message."""
        try:
            with self.app.events.default_dispatcher() as dispatcher:
                # EventDispatcher.flush's own message for buffered task events
                dispatcher.producer.publish(
                    batch,
                    routing_key="task.multi",
                    exchange=dispatcher.exchange.name,
                    declare=[dispatcher.exchange],
                    serializer=dispatcher.serializer,
                    headers=dispatcher.headers,
                    delivery_mode=dispatcher.delivery_mode,
                    retry=False,
                )
        except Exception as exc:
            logger.debug("throttle: %d task events lost: %s", len(batch), exc)
