"""The releaser: a thread in every worker that sends parked tasks back to the broker.

Parked tasks (:mod:`throttle.parking`) wait in Redis, not in a worker's memory; the
releaser claims those due by its next poll (on the Redis clock), publishes each at once,
with no ETA, and with its parking token (so that a second copy is dropped,
:class:`throttle.parking.ParkingLot`), then commits the claim. A releaser that dies
between publishing and committing loses nothing: the claim expires and another releaser
publishes the task again; the gate drops the second copy.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence

from celery import Celery

from throttle.celery.arrival import POLL_S, release_poll_s
from throttle.celery.message import H_PARKED, H_PUBLISH, LANE_SUFFIX, parked_signature
from throttle.celery.routing import lane_queue
from throttle.celery.runtime import Throttler
from throttle.errors import BackendError
from throttle.parking import Claimed
from throttle.redis.clock import REFRESH_S, forget_clock, record_clock

logger = logging.getLogger("throttle")

COLD_CHECK_S = 5.0
"""How often the releaser looks for the marker key of ``cold_start: empty``, in s."""
STREAK_REMINDER_S = 60.0
"""While a repeated operation keeps failing, how often (s) a warning says it still does."""


class FailureStreak:
    """Logs a run of failures of one repeated operation once, not once per attempt.

    The first failure is a warning with its traceback; later ones are at debug level, but
    for a reminder every :data:`STREAK_REMINDER_S` seconds (a failure that never ends, such
    as a payload that cannot be decoded, must not go quiet); the first success after a
    failure says how long the streak lasted."""

    def __init__(self, what: str, again: str) -> None:
        self.what, self.again = what, again
        self.since: float | None = None  # monotonic s of the streak's first failure
        self.count = 0
        self.reminded = 0.0

    def failed(self, exc: BaseException) -> None:
        now = time.monotonic()
        self.count += 1
        if self.since is None:
            self.since = self.reminded = now
            logger.warning(
                "throttle: %s (%s); retrying, one message per failure streak",
                self.what, exc, exc_info=True,
            )  # fmt: skip
        elif now - self.reminded >= STREAK_REMINDER_S:
            self.reminded = now
            logger.warning(
                "throttle: %s for %.0f s (%d attempts); last error: %s",
                self.what, now - self.since, self.count, exc,
            )  # fmt: skip
        else:
            logger.debug("throttle: %s (attempt %d)", self.what, self.count, exc_info=True)

    def ended(self) -> None:
        if self.since is not None:
            logger.warning(
                "throttle: %s after %.1f s (%d failed attempts)",
                self.again, time.monotonic() - self.since, self.count,
            )  # fmt: skip
            self.since, self.count = None, 0


class Releaser(threading.Thread):
    """Sends parked tasks back to the broker shortly before their slot (one per worker)."""

    def __init__(
        self, app: Celery, *, worker: str | None = None, poll_s: float = POLL_S, batch: int = 200
    ) -> None:
        super().__init__(name="throttle-releaser", daemon=True)
        self.app = app
        self.worker = worker
        """The worker's name, under which it records its clock (None: not recorded)."""
        # A task must not arrive more than sleep_max before its slot (it would be
        # deferred again): see throttle.celery.arrival.
        self.poll_s = release_poll_s(Throttler.of(app).settings, poll_s)
        self.batch = batch
        self._stop_event = threading.Event()
        self._foreign: set[str] = set()
        """Names of other apps' parked tasks seen (each logged once)."""

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        checked = recorded = time.monotonic()
        failing = FailureStreak(
            "the releaser cannot release parked tasks", "the releaser releases parked tasks again"
        )
        while not self._stop_event.is_set():
            try:
                released = self.release_once()
                throttler = Throttler.of(self.app)
                if released:
                    # A claim written: Redis takes writes again. An empty poll writes
                    # nothing, which a Redis out of memory still answers.
                    throttler.outage(None)
                if time.monotonic() - checked >= COLD_CHECK_S:
                    # Redis may have restarted empty between two tasks, unseen by any gate.
                    checked = time.monotonic()
                    throttler.check_cold_start()
                if self.worker is not None and time.monotonic() - recorded >= REFRESH_S:
                    recorded = time.monotonic()
                    record_clock(
                        throttler.clock, throttler.limiter.keyspace.clocks_key(), self.worker
                    )
                # A round that claimed nothing published nothing: it says the broker is back
                # only if a connection to it now opens.
                if failing.since is not None and (released or self._broker_reachable()):
                    failing.ended()
            except BackendError as exc:
                Throttler.of(self.app).outage(exc)
                released = 0
            except Exception as exc:  # the releaser must outlive a bad payload or a broker blip
                # Usually the broker is away: claimed tasks stay parked (the claim expires
                # and they are claimed again), so nothing is lost, and one line per streak
                # says so rather than a traceback per poll.
                failing.failed(exc)
                released = 0
            if released < self.batch:
                self._stop_event.wait(self.poll_s)
        if self.worker is not None:
            # Stopped cleanly: `celery throttle status` should not list its clock as a
            # worker's (a killed worker's ages out, CLOCKS_SEEN_S).
            with contextlib.suppress(Exception):
                limiter = Throttler.of(self.app).limiter
                forget_clock(limiter.client, limiter.keyspace.clocks_key(), self.worker)

    def _broker_reachable(self) -> bool:
        """Whether the broker accepts a connection now: one attempt, no retries (asked only
        while publishing fails)."""
        try:
            with self.app.connection_for_write() as conn:
                conn.ensure_connection(max_retries=0)
        except Exception:
            return False
        return True

    def release_once(self) -> int:
        """Claim, publish and commit one batch; returns how many were released. A task of
        another app (one whose name this app does not define: apps that share the
        limiter's Redis, prefix and namespace share its parking lot) is left claimed: its
        claim expires and its own app's releaser takes it, where this one's broker would
        discard it as unregistered. The price: such a task can come back up to a claim
        (30 s) late."""
        throttler = Throttler.of(self.app)
        claimed = throttler.parking.claim(lead_s=self.poll_s, batch=self.batch)
        ours = [item for item in claimed if self._ours(item)]
        if ours:
            self.publish(ours)
            throttler.parking.commit(ours)
        return len(ours)

    def _ours(self, item: Claimed) -> bool:
        """Whether this app defines the parked task's name (True when the payload cannot be
        read: :meth:`publish` reports that)."""
        try:
            name = parked_signature(item.payload).get("task")
        except Exception:
            return True
        if not isinstance(name, str) or name in self.app.tasks:
            return True
        if name not in self._foreign:
            self._foreign.add(name)
            logger.warning(
                "throttle: parked tasks of %s, which this app does not define, are left to "
                "the releasers of an app that does (apps sharing the limiter's Redis, "
                "prefix and namespace share its parking lot)", name,
            )  # fmt: skip
        return False

    def publish(self, claimed: Sequence[Claimed]) -> None:
        """Send claimed tasks to the broker now, each with its parking token and publish
        id (they were parked until ``park_lead`` before their slot)."""
        for item in claimed:
            sig = self.app.signature(parked_signature(item.payload))
            queue = sig.options.get("queue")
            if isinstance(queue, str) and queue.endswith(LANE_SUFFIX):  # declared as its queue
                lane_queue(self.app, queue[: -len(LANE_SUFFIX)])
            headers = dict(sig.options.get("headers") or {})
            headers[H_PARKED] = item.token
            headers[H_PUBLISH] = item.publish_id
            sig.apply_async(headers=headers)
