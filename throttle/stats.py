"""Fleet-wide counts of what the throttler turned away, per limit and minute, in Redis.

Every worker adds its deferrals, parks and timeouts to one HASH per minute (field
``EVENT:LIMIT`` -> count, in the namespace's hash tag, expiring after about an hour), so
that ``celery throttle status`` can say "limit github: 12.5 denied/min" for the whole fleet
without scraping every worker::

    book = StatsBook(client, KeySpace())
    book.record(["github"], "denied")           # one pipelined round trip
    book.per_minute(5)    # {"github": {"denied": 2.4, "parked": 0.0, "timeout": 0.0, ...}}

Events:

* ``denied``: a task was deferred by the limit (re-published for later, or parked);
* ``parked``: of those, the ones whose wait was parked in Redis (counted in ``denied`` too);
* ``timeout``: a task's throttle deadline passed before its slot (failed or dead-lettered);
* ``waited``: a task was admitted for a slot a moment ahead and slept to it in the worker
  (a wait up to ``settings.sleep_max``, not deferred); as frequent as the tasks at a high
  rate, so a worker gathers these and writes them about once a second (:class:`Tally`).

Limits in shadow mode (:mod:`throttle.celery.shadow`) add, per task they look at, one to
``shadow:LIMIT`` and, when they would have delayed it, one to ``shadow_w:BUCKET:LIMIT``,
a bucket of the would-be wait (bucket ``i`` holds waits up to 1 ms x 1.1**i: a quantile read
back is within 5 % of the true one). :meth:`StatsBook.shadow` reads them back: how many
tasks each limit would have delayed, and by how much at p50 and p95. A worker gathers
these, as it does ``waited``, and writes them about once a second (:class:`Tally`).

The minute is taken in the recording process, not by a script from Redis ``TIME`` (a
script building its own key name would break Redis Cluster's rule that scripts declare
their keys): workers and the CLI pass their :class:`throttle.redis.clock.RedisClock`, so
the minute is the Redis clock's as the process measured it, whatever its own clock says.
These are counts for people; no limit is ever decided from them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence

from throttle.errors import RequestError
from throttle.gathering import Gathering
from throttle.redis.client import RedisClient, wrap_errors
from throttle.redis.keys import KeySpace

__all__ = ["EVENTS", "MAX_MINUTES", "SHADOW_MIN_S", "StatsBook", "Tally"]

EVENTS = ("denied", "parked", "timeout", "waited")
"""The events counted, in the order :meth:`StatsBook.per_minute` lists them."""
MAX_MINUTES = 60
"""The most whole minutes :meth:`StatsBook.per_minute` averages over (the buckets live
about an hour)."""
SHADOW_MIN_S = 0.001
"""A would-be wait of a limit in shadow mode shorter than this (s) is no delay."""
_SHADOW_GROWTH = 1.1
TTL_S = (MAX_MINUTES + 2) * 60
"""How long a minute's bucket lives after its last write, in s: long enough for the oldest
minute of ``per_minute(MAX_MINUTES)``."""


class StatsBook:
    """Per-minute counts of throttle events for a whole fleet, per limit.

    Parameters
    ----------
    client:
        A redis-py client (the limiter's).
    keyspace:
        Where the buckets live (:meth:`KeySpace.stats_key`).
    clock:
        "Now" in epoch seconds (default :func:`time.time`); tests pass their own.
    """

    def __init__(
        self,
        client: RedisClient,
        keyspace: KeySpace,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.client = client
        self.keyspace = keyspace
        self._clock = clock

    def record(self, limits: Iterable[str], event: str, n: int = 1) -> None:
        """Add ``n`` ``event`` s (see :data:`EVENTS`) to each of ``limits`` in this minute.

        One pipelined round trip; nothing at all for no limits or ``n == 0``. Raises
        :class:`BackendError` when Redis fails (callers on a task's path catch it: a count
        is never worth a task).
        """
        self.record_events(limits, (event,), n)

    def record_events(self, limits: Iterable[str], events: Iterable[str], n: int = 1) -> None:
        """:meth:`record` of several events in the same round trip (a park is ``denied`` and
        ``parked``)."""
        fields = event_fields(limits, events)
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise RequestError(f"a stats count must be an integer >= 0 (got {n!r})")
        if n:
            minute = self.minute()
            self.add_counts({(minute, field): n for field in fields})

    def add_counts(self, counts: dict[tuple[int, str], int]) -> None:
        """Add counts already keyed by minute and field (``(minute, "EVENT:LIMIT") -> n``,
        as :class:`Tally` gathers them). One pipelined round trip."""
        if not counts:
            return

        def send() -> None:
            with self.client.pipeline(transaction=False) as pipe:
                minutes = set()
                for (minute, field), n in counts.items():
                    pipe.hincrby(self.keyspace.stats_key(minute), field, n)
                    minutes.add(minute)
                for minute in minutes:
                    pipe.expire(self.keyspace.stats_key(minute), TTL_S)
                pipe.execute()

        wrap_errors(send)

    def minute(self) -> int:
        """The current minute (minutes since the epoch, on this book's clock)."""
        return int(self._clock() // 60)

    def record_shadow(self, limits: Sequence[str], waits: Sequence[float]) -> None:
        """Count one task looked at by each of ``limits`` (in shadow mode), and the wait
        each would have imposed on it (s). One pipelined round trip."""
        minute = self.minute()
        self.add_counts({(minute, field): 1 for field in shadow_fields(limits, waits)})

    def shadow(self, minutes: int = 5) -> dict[str, dict[str, float | int | None]]:
        """What the limits in shadow mode would have done over the last ``minutes``
        minutes, the current one included: limit -> ``tasks`` (looked at), ``delayed``
        (of those, would have waited), ``p50_s`` and ``p95_s`` (the would-be wait of the
        delayed ones; None when none was). One pipelined round trip."""
        if isinstance(minutes, bool) or not isinstance(minutes, int) or not 1 <= minutes <= 60:
            raise RequestError(f"minutes must be an integer from 1 to 60 (got {minutes!r})")
        now = int(self._clock() // 60)
        keys = [self.keyspace.stats_key(minute) for minute in range(now - minutes + 1, now + 1)]

        def read() -> list[dict[bytes, bytes]]:
            with self.client.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.hgetall(key)
                replies: list[dict[bytes, bytes]] = pipe.execute()
                return replies

        tasks: dict[str, int] = {}
        buckets: dict[str, dict[int, int]] = {}
        for reply in wrap_errors(read):
            for field, value in reply.items():
                event, _, rest = _text(field).partition(":")
                if event == "shadow":
                    tasks[rest] = tasks.get(rest, 0) + int(value)
                elif event == "shadow_w":
                    index, _, limit = rest.partition(":")
                    if index.isdigit():
                        counts = buckets.setdefault(limit, {})
                        counts[int(index)] = counts.get(int(index), 0) + int(value)
        found: dict[str, dict[str, float | int | None]] = {}
        for limit in sorted(tasks.keys() | buckets.keys()):
            counts = buckets.get(limit, {})
            delayed = sum(counts.values())
            found[limit] = {
                "tasks": tasks.get(limit, 0),
                "delayed": delayed,
                "p50_s": _quantile(counts, 0.5),
                "p95_s": _quantile(counts, 0.95),
            }
        return found

    def per_minute(self, minutes: int = 1) -> dict[str, dict[str, float]]:
        """Counts per minute, averaged over the last ``minutes`` whole minutes (the current,
        unfinished minute is left out): limit -> event -> count per minute.

        Every limit with any count in that span is listed with all of :data:`EVENTS`
        (0.0 where none); limits with none are absent. One pipelined round trip.
        """
        if (
            isinstance(minutes, bool)
            or not isinstance(minutes, int)
            or not 1 <= minutes <= MAX_MINUTES
        ):
            raise RequestError(
                f"minutes must be an integer from 1 to {MAX_MINUTES} (got {minutes!r})"
            )
        now = int(self._clock() // 60)
        keys = [self.keyspace.stats_key(minute) for minute in range(now - minutes, now)]

        def read() -> list[dict[bytes, bytes]]:
            with self.client.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.hgetall(key)
                replies: list[dict[bytes, bytes]] = pipe.execute()
                return replies

        totals: dict[str, dict[str, float]] = {}
        for bucket in wrap_errors(read):
            for field, value in bucket.items():
                event, _, limit = _text(field).partition(":")
                if event not in EVENTS:
                    continue  # not ours (a future event type): ignore, do not fail
                counts = totals.setdefault(limit, dict.fromkeys(EVENTS, 0.0))
                counts[event] += float(value)
        return {
            limit: {event: count / minutes for event, count in counts.items()}
            for limit, counts in totals.items()
        }


def _bucket(wait_s: float) -> int:
    """The bucket of a would-be wait of at least :data:`SHADOW_MIN_S`: ``i`` holds waits
    in (1 ms x 1.1**(i-1), 1 ms x 1.1**i]."""
    return max(math.ceil(math.log(wait_s / SHADOW_MIN_S, _SHADOW_GROWTH) - 1e-9), 0)


def _quantile(counts: dict[int, int], q: float) -> float | None:
    """The ``q`` quantile of the waits counted per bucket, interpolated geometrically
    inside its bucket (s, rounded to 1 ms); None without any."""
    total = sum(counts.values())
    if total == 0:
        return None
    rank, seen = q * total, 0
    for index in sorted(counts):
        if seen + counts[index] >= rank:
            inside = (rank - seen) / counts[index]
            low = SHADOW_MIN_S * _SHADOW_GROWTH ** max(index - 1, 0)
            high = SHADOW_MIN_S * _SHADOW_GROWTH**index
            return round(float(low * (high / low) ** inside), 3)
        seen += counts[index]
    return None  # unreachable: the ranks add up to the total


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else value


def event_fields(limits: Iterable[str], events: Iterable[str]) -> list[str]:
    """The fields (``EVENT:LIMIT``) that ``events`` of each of ``limits`` add to (a limit
    listed twice counts once); a RequestError for an event not in :data:`EVENTS`."""
    events = tuple(events)
    for event in events:
        if event not in EVENTS:
            raise RequestError(
                f"unknown stats event {event!r}; expected one of {', '.join(EVENTS)}"
            )
    return [f"{event}:{name}" for name in dict.fromkeys(limits) for event in events]


def shadow_fields(limits: Sequence[str], waits: Sequence[float]) -> list[str]:
    """The fields one task looked at by ``limits`` in shadow mode adds one to: each
    limit's ``shadow:LIMIT``, and ``shadow_w:BUCKET:LIMIT`` where it would have waited
    (``waits``, s)."""
    fields = []
    for name, wait in zip(limits, waits, strict=True):
        fields.append(_shadow_field(-1, name))
        if wait >= SHADOW_MIN_S:
            fields.append(_shadow_field(_bucket(wait), name))
    return fields


_FIELDS: dict[tuple[int, str], str] = {}
"""The shadow fields already formatted, by (bucket, limit name): as frequent as the
tasks, each is formatted once."""


def _shadow_field(bucket: int, name: str) -> str:
    """``shadow:NAME`` (``bucket`` -1) or ``shadow_w:BUCKET:NAME``."""
    field = _FIELDS.get((bucket, name))
    if field is None:
        if len(_FIELDS) >= 65536:  # limit names change rarely: this bounds a misuse
            _FIELDS.clear()
        field = f"shadow:{name}" if bucket < 0 else f"shadow_w:{bucket}:{name}"
        _FIELDS[(bucket, name)] = field
    return field


TALLY_EVERY_S = 1.0
"""How long a :class:`Tally` gathers counts before it writes them, in s."""


class Tally(Gathering[tuple[dict[tuple[int, str], int], list[str]]]):
    """Counts of one process, gathered and added to a :class:`StatsBook` at most every
    ``every_s`` seconds in one pipelined round trip, instead of one round trip per event
    (:class:`throttle.gathering.Gathering`).

    For events as frequent as the tasks themselves (``waited``: at a high rate, most tasks
    wait a moment for their slot), where a round trip each would cost the worker as much
    as the throttling. The price: a count reaches Redis up to ``every_s`` late, and the
    counts of a process that dies (or a pool child that exits) within ``every_s`` of them
    are lost; they are counts for people.

    ``on_error(limits, exc)`` is called (in the gatherer's thread) when a write fails; the
    counts of that write are dropped.
    """

    def __init__(
        self,
        book: StatsBook,
        *,
        every_s: float = TALLY_EVERY_S,
        on_error: Callable[[list[str], Exception], None] | None = None,
    ) -> None:
        self.book = book
        self.on_error = on_error
        super().__init__(every_s)

    def _reset(self) -> None:
        self._counts: dict[tuple[int, str], int] = {}
        self._limits: set[str] = set()

    def add(self, limits: Iterable[str], event: str) -> None:
        """Count one ``event`` (see :data:`EVENTS`) for each of ``limits`` (a limit listed
        twice counts once); written within ``every_s``."""
        names = list(dict.fromkeys(limits))
        self._count(names, event_fields(names, (event,)))

    def add_shadow(self, looks: Sequence[tuple[Sequence[str], Sequence[float]]]) -> None:
        """:meth:`StatsBook.record_shadow` for each task's ``(limits, waits)``, written
        within ``every_s``."""
        names: dict[str, None] = {}
        fields: list[str] = []
        for limits, waits in looks:
            names.update(dict.fromkeys(limits))
            fields += shadow_fields(limits, waits)
        self._count(list(names), fields)

    def _count(self, limits: list[str], fields: Iterable[str]) -> None:
        if not limits:
            return
        minute = self.book.minute()
        with self._lock:
            counts = self._counts
            for field in fields:
                counts[(minute, field)] = counts.get((minute, field), 0) + 1
            self._limits.update(limits)
            self._arm()

    def _take(self) -> tuple[dict[tuple[int, str], int], list[str]] | None:
        return (self._counts, sorted(self._limits)) if self._counts else None

    def _write(self, gathered: tuple[dict[tuple[int, str], int], list[str]]) -> None:
        """One round trip for every count gathered."""
        counts, limits = gathered
        try:
            self.book.add_counts(counts)
        except Exception as exc:
            if self.on_error is None:
                raise
            self.on_error(limits, exc)
