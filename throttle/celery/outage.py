"""When the limiter's Redis is away: what one process knows of the outage.

:class:`OutageWatch` notes every failure and every answer of Redis in one process; the
processes of one worker share a marker file, so that the worker logs one warning when an
outage begins and one when it ends. It keeps what the rules' ``on_redis_down`` needs
during the outage (when it began, the fleet's size, the local buckets); the policy itself
is :func:`throttle.celery.redis_down.run_while_down`. When Redis answers again, the
throttler checks whether it lost its data (``Throttler.check_cold_start``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from throttle.config import Settings
from throttle.errors import BackendError, BackendUnavailable
from throttle.fallback import LocalBuckets

logger = logging.getLogger("throttle")

WORKER_ENV = "THROTTLE_WORKER_ID"
"""Set by a worker's main process before its pool forks: its pool children and it share
one outage marker file, so that the worker logs one warning per outage, not one per child."""
POOL_ENV = "THROTTLE_POOL_SIZE"
"""The worker's pool size, for the share of ``on_redis_down: local``."""
MARKER_LOOK_S = 0.1
"""How often a process that has seen no outage looks for another process's outage marker,
in s, while Redis answers: a ``stat`` per call would be the price of every task."""
PING_TIMEOUT_S = 0.5
"""How long ``app.control.ping`` collects replies when ``local`` counts the fleet, in s."""
RECOVERY_S = 1.0
"""How long Redis must answer a process without failing before its outage ends, in s.
Only calls that wrote count as answers (an acquisition admitted, a parked task claimed):
a Redis that refuses writes (out of memory under ``noeviction``) still answers the calls
that write nothing (a denial, an empty poll of the parking lot), and counted, they would
end the outage between two failures, start its clock again (so that ``allow``'s bound
never came) and log both each time."""


class OutageWatch:
    """What one process knows of an outage of the limiter's Redis.

    ``on_recovery`` runs in the process that sees Redis answer first after an outage (it
    checks whether Redis lost its data); ``count_fleet`` returns how many workers the fleet
    has, asked once per outage by ``on_redis_down: local``.
    """

    def __init__(
        self,
        settings: Settings,
        on_recovery: Callable[[], object],
        count_fleet: Callable[[], int],
    ) -> None:
        self.settings = settings
        self.on_recovery = on_recovery
        self.count_fleet = count_fleet
        self.local = LocalBuckets()
        self._since: float | None = None  # epoch s, as this worker saw it
        self._share: int | None = None  # processes of the fleet; 0: could not count
        self._file: tuple[str | None, Path | None] = ("", None)
        self._look_at = -math.inf  # monotonic s: when to look for the marker next
        self._answering: float | None = None  # monotonic s: answered since, no failure
        self._checked = False  # on_recovery ran in this outage

    def note(self, exc: BaseException | None) -> None:
        """Note that Redis failed (``exc``) or answered (``None``): a call that wrote (an
        acquisition admitted, a parked task claimed; see :data:`RECOVERY_S`).

        One warning per outage per worker, not per task nor per pool child: the worker's
        processes share a marker file (named after the worker's main process, see
        :data:`WORKER_ENV`) holding when the outage began. The process that creates it
        warns; the one that removes it, when Redis answers again, says so. An outage
        ends once Redis has answered that process for :data:`RECOVERY_S`, with no failure
        in any process of the worker meanwhile (each touches the file); a process runs
        ``on_recovery`` at its first answer in an outage, without waiting. A successful
        call costs a ``stat`` of that file at most every :data:`MARKER_LOOK_S` (every call
        while this process knows of an outage); a failed one an attempt to create it.
        """
        if exc is not None:
            self._failed(exc)
            return
        now = time.monotonic()
        if self._since is None:
            if now < self._look_at:
                return
            self._look_at = now + MARKER_LOOK_S
            marker = self.file
            if marker is None or not marker.exists():
                self._answering, self._checked = None, False  # no outage in this worker
                return
        if self._answering is None:
            self._answering = now
        if not self._checked:
            # At once, not after RECOVERY_S: a Redis back empty must not hand out the
            # bursts of the cold_start: empty limits meanwhile (SET NX: once in the fleet).
            self._checked = True
            try:
                self.on_recovery()
            except BackendError as exc2:
                logger.debug("throttle: cannot check the marker key: %s", exc2)
        if now - self._answering < RECOVERY_S:
            return
        self._end()

    def _end(self) -> None:
        """End the outage this process knows of, unless a process of the worker met a
        failure within :data:`RECOVERY_S` (Redis has answered this one for that long)."""
        path = self.file
        if path is not None and _failed_lately(path):
            return  # another process of this worker still meets failures
        since = self._read_start(self.since())
        self._since, self._answering, self._checked = None, None, False
        if path is not None:
            try:
                path.unlink()
            except FileNotFoundError:
                return  # another process of this worker said it first
        logger.warning(
            "throttle: Redis is reachable again after %.1f s; limiting resumes",
            time.time() - since,
        )

    def _failed(self, exc: BaseException) -> None:
        # Not ended here when Redis answered a while ago and nothing was asked since:
        # silence is no answer (a Redis out of memory takes a write now and then). A
        # worker idle since its first answer reads its next outage as the same one: its
        # allow bound spent, failing closed sooner, the safe side.
        answered, self._answering = self._answering, None
        path = self.file
        known = self._since is not None and answered is None
        if known and path is not None and not path.exists():
            # This process knew of an outage, has had no answer since, and another
            # process of the worker has ended it meanwhile: the tail of that outage (a
            # connection to the old server failing on its first use), not a new one.
            # Forgotten, without a warning; if Redis is away again, the next failure
            # starts the new outage.
            self._since, self._share, self._checked = None, None, False
            self.local.clear()
            return
        now = time.time()
        started = self._since is None
        if path is not None:
            # Per thread: two threads of one process (a threads pool) must not share it.
            tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}")
            try:
                tmp.write_text(repr(now))
                os.link(tmp, path)  # atomic and exclusive: one process starts the outage
                started = True
            except FileExistsError:
                started = False
                with contextlib.suppress(OSError):
                    os.utime(path)  # the latest failure of the worker: see _failed_lately
            except OSError as exc2:  # no temp dir to share: warn per process instead
                logger.debug("throttle: cannot write %s: %s", path, exc2)
            finally:
                tmp.unlink(missing_ok=True)
        if started:
            since = now
        elif path is not None:
            since = self._read_start(now)
        else:
            since = self.since()
        if since != self._since:
            # A new outage for this process: count the fleet again, fresh buckets.
            self._since = since
            self._share = None
            self._checked = False
            self.local.clear()
        if started:
            logger.warning(
                "throttle: Redis is unreachable (%s); applying on_redis_down until it "
                "answers (one warning per outage and worker)",
                exc,
            )

    @property
    def file(self) -> Path | None:
        """The file the processes of this worker share about an outage; None outside a
        worker (a producer, eager calls: each process warns for itself). Read from the
        environment each time: a throttler may be built before the worker step sets it."""
        worker = os.environ.get(WORKER_ENV)
        if worker != self._file[0]:
            path = None
            if worker:
                name = f"throttle-outage-{self.settings.prefix}-{self.settings.namespace}"
                path = Path(tempfile.gettempdir()) / f"{name}-{worker}"
            self._file = (worker, path)
        return self._file[1]

    def _read_start(self, default: float) -> float:
        """The start written in the outage file (``default`` if it is gone or unreadable:
        another process of the worker may have just said that Redis is back)."""
        if self.file is None:
            return default
        try:
            return float(self.file.read_text() or default)
        except (OSError, ValueError):
            return default

    def since(self) -> float:
        """When the current outage began (epoch s), as this worker saw it."""
        return self._since if self._since is not None else time.time()

    def share(self) -> int | None:
        """The processes among which ``on_redis_down: local`` splits a limit: the fleet's
        workers (``settings.fleet_workers``, else ``count_fleet()`` once per outage) times
        this worker's pool size. None: the fleet could not be counted."""
        if self._share is None:
            workers = self.settings.fleet_workers
            if workers is None:
                workers = self.count_fleet()
            pool = os.environ.get(POOL_ENV, "")
            self._share = workers * (int(pool) if pool.isdigit() and int(pool) > 0 else 1)
            if self._share:
                logger.info("throttle: local fallback shared by %d processes", self._share)
        return self._share or None


PROBE_S = 1.0
"""After :data:`TRIP_AFTER` calls in a row failed, how long a process's gates fail at once
instead of asking Redis, in s; then one call asks again."""
TRIP_AFTER = 2
"""How many calls in a row must fail before a process stops asking Redis for a while."""
SLOW_FAILURE_S = 1.0
"""A call that took this long to fail (a timeout: a Redis that hangs) stops a process
asking at once, in s: a second one would hold it as long again."""


class NotAsked(BackendUnavailable):
    """Redis was not asked: its last calls from this process failed (:class:`Breaker`)."""


class Breaker:
    """Whether a process asks Redis at all, for its gates' acquisitions. A Redis that
    hangs makes each call wait for the socket timeout (5 s), and a Redis Cluster slot in
    migration makes it retry for about 0.4 s: asked for every task, a worker's consumer
    holds its prefetched backlog, unacknowledged, that long per task, past the broker's
    visibility timeout (which then delivers it twice). So after :data:`TRIP_AFTER`
    failures in a row, or one that took :data:`SLOW_FAILURE_S`, calls fail at once
    (:class:`NotAsked`, and ``on_redis_down`` applies) for :data:`PROBE_S`, then one
    asks again. The price: after a short blip that failed two calls, a second of tasks
    goes by ``on_redis_down`` without asking. One per process (its threads share it: a
    race costs at most one more call)."""

    def __init__(self) -> None:
        self._failures = 0
        self._failed_at = -math.inf  # monotonic s

    def check(self) -> float:
        """Raise :class:`NotAsked` while Redis is not to be asked; else return now
        (monotonic s), for :meth:`failed`."""
        now = time.monotonic()
        if self._failures >= TRIP_AFTER:
            ago = now - self._failed_at
            if ago < PROBE_S:
                raise NotAsked(
                    f"Redis is unreachable: {self._failures} calls in a row failed, the "
                    f"last {ago:.1f} s ago (not asked again before {PROBE_S:g} s after it)"
                )
            # This call is the probe: the others of the process are not asked for another
            # PROBE_S while it runs (a hung Redis holds it for the socket timeout, and in a
            # threads or gevent pool every task meanwhile would have asked, and hung, too).
            self._failed_at = now
        return now

    def asking(self) -> Asking:
        """Around a gate's calls to Redis: ``with breaker.asking():`` raises
        :class:`NotAsked` on entry while Redis is not to be asked (:meth:`check`), counts
        a :class:`BackendError` raised inside as a failure (:meth:`failed`), and a block
        that ends otherwise (returning, or raising another error) as answered
        (:meth:`answered`). Also a block that needed no
        call (a task the consumer decided, one drawn from a stock): had it taken the probe
        and left the breaker open, every task after it would have gone by
        ``on_redis_down`` for another :data:`PROBE_S`, and again, while Redis answered."""
        return Asking(self)

    def is_open(self) -> bool:
        """Whether Redis is not to be asked now (as :meth:`check`, without taking the
        probe: for reads that the process mostly answers from a cache)."""
        return self._failures >= TRIP_AFTER and time.monotonic() - self._failed_at < PROBE_S

    def failed(self, asked_at: float) -> None:
        """A call asked at ``asked_at`` (:meth:`check`'s answer) failed (Redis
        unreachable, or answering with an error)."""
        now = time.monotonic()
        self._failures += 1
        if now - asked_at >= SLOW_FAILURE_S:
            self._failures = max(self._failures, TRIP_AFTER)
        self._failed_at = now

    def answered(self) -> None:
        """A call was answered."""
        self._failures = 0


class Asking:
    """:meth:`Breaker.asking`'s context: one use, so that threads sharing the breaker each
    keep when they asked."""

    __slots__ = ("asked_at", "breaker")

    def __init__(self, breaker: Breaker) -> None:
        self.breaker = breaker
        self.asked_at = 0.0

    def __enter__(self) -> None:
        self.asked_at = self.breaker.check()

    def __exit__(self, kind: type[BaseException] | None, exc: object, tb: object) -> None:
        if kind is None or not issubclass(kind, BackendError):
            self.breaker.answered()  # a task that comes back (Retry) was answered too
        elif not issubclass(kind, NotAsked):
            self.breaker.failed(self.asked_at)


def _failed_lately(path: Path) -> bool:
    """Whether a process of this worker met a failure within :data:`RECOVERY_S` (the
    outage file's modification time: each failure touches it)."""
    try:
        return time.time() - path.stat().st_mtime < RECOVERY_S
    except OSError:
        return False


def ping_fleet(app: Any) -> int:
    """How many workers answer a ping through the broker (which needs no Redis of the
    limiter); 0 when the broker is down too."""
    try:
        replies = app.control.ping(timeout=PING_TIMEOUT_S) or []
    except Exception as exc:  # the broker is down too
        logger.warning("throttle: cannot count the fleet for 'local': %s", exc)
        replies = []
    return len(replies)
