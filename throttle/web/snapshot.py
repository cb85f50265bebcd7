"""What the limits page shows, read every few seconds: ``celery throttle status``'s
collection, plus what a page can draw and a table cannot.

Each :meth:`Sampler.sample` takes one snapshot:

* every limit's row of :func:`throttle.cli.status.collect_status` (the rate in force and
  the configured one, tokens, next slot, holds, the learned rate, tasks running, the
  deferrals and time-outs per minute of the last minutes);
* tasks **waiting** per limit: held by a worker, from ``inspect().scheduled()`` (held for
  a near slot, or until the ETA of a deferral that was re-published) and from the
  workers' ``throttle_waiting`` command (in their lines, waiting for capacity); and
  **parked** per limit, from the parking lot in Redis; both also per key value for the
  busiest keys (:data:`TOP_KEYS`);
* **admitted per second** of each limit since the previous snapshot: from the workers'
  Prometheus counters (``throttle_decisions_total{decision="allowed"}``) when they are on
  this host (``settings.metrics``; the same files Flower sums), else estimated from the
  level of a limit without a key (its tokens, less the slots it handed out ahead): exact
  while it binds at both snapshots, which is when the chart matters; an undercount when
  it fills up and is drained between two snapshots. The snapshot says which
  (``admitted_source``).

The sampler keeps the last :data:`HISTORY` snapshots' admitted rates for the chart. It
reads Redis and asks the workers (``inspect``), so it runs in one background thread of the
server, never once per page view: a hundred open pages cost the fleet what one does.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Mapping
from typing import Any

from throttle import metrics
from throttle.celery.exporter import worker_dirs
from throttle.celery.message import LANE_SUFFIX, parked_signature, queue_of
from throttle.celery.runtime import Throttler, declared_by
from throttle.cli.base import known_limits
from throttle.cli.parked import bring_back
from throttle.cli.status import collect_status
from throttle.errors import ThrottleError
from throttle.redis.client import wrap_errors
from throttle.rules import key_for, key_problem, named_arguments
from throttle.spec import Limit

__all__ = ["HISTORY", "TOP_KEYS", "Sampler"]

TOP_KEYS = 5
"""Per limit, the page lists waiting and parked tasks for this many keys (the busiest)."""
HISTORY = 150
"""Snapshots kept for the chart: five minutes at the default interval of 2 s."""
ADMITTED = "throttle_decisions_total"


class Sampler:
    """Takes snapshots of a fleet's limits and keeps the latest and the chart's history.

    Parameters
    ----------
    app:
        The Celery app (``celery -A``), its task modules imported.
    throttler:
        Its :class:`Throttler` (the limits file, the limiter's Redis).
    timeout_s:
        How long each ``inspect`` call waits for the workers' replies (two per snapshot:
        running and scheduled tasks); 0: the workers are not asked.
    minutes:
        The deferrals per minute are averaged over this many whole minutes.
    """

    def __init__(
        self, app: Any, throttler: Throttler, *, timeout_s: float = 0.5, minutes: int = 5
    ) -> None:
        self.app = app
        self.throttler = throttler
        self.timeout_s = timeout_s
        self.minutes = minutes
        self._lock = threading.Lock()
        self._latest: dict[str, Any] | None = None
        self._latest_started = -math.inf
        """When the kept snapshot was begun (monotonic s)."""
        self._history: collections.deque[dict[str, Any]] = collections.deque(maxlen=HISTORY)
        self._previous: tuple[float, dict[str, float] | None, dict[str, float]] | None = None
        """(monotonic s, admitted counters per limit, level per limit) of the last sample."""

    def names(self) -> list[str]:
        """The limits the page knows (the file's and the tasks' inline ones), as
        ``celery throttle`` knows them: what pause and resume may name."""
        return list(known_limits(self.app, self.throttler))

    def key_problem(self, limit: str, key: str) -> str | None:
        """Why ``key`` is no key of ``limit``'s tasks (:func:`throttle.rules.key_problem`),
        or None: a pause of it would pause nothing."""
        return key_problem(known_limits(self.app, self.throttler)[limit].rule, key)

    def pause(self, limit: str, key: str | None) -> None:
        """``celery throttle pause LIMIT [KEY]``: hold it until resumed."""
        self.throttler.limiter.hold(limit, key, None)

    def resume(self, limit: str, key: str | None) -> None:
        """``celery throttle resume LIMIT [KEY]``: lift its hold, and bring the tasks
        parked under it back at once (:func:`throttle.cli.parked.bring_back`)."""
        self.throttler.limiter.unhold(limit, key)
        bring_back(self.app, self.throttler, limit)

    def latest(self) -> dict[str, Any] | None:
        """The last snapshot with the chart's history (None before the first)."""
        with self._lock:
            if self._latest is None:
                return None
            return {**self._latest, "history": list(self._history)}

    def sample(self) -> dict[str, Any]:
        """Take a snapshot now and keep it; a Redis error is kept as the snapshot's
        ``error`` (the page shows it, the last good numbers stay in the history)."""
        taken, started = time.time(), time.monotonic()
        try:
            data = self._collect()
        except ThrottleError as exc:
            data = {"error": str(exc)}
        data["taken"] = taken
        with self._lock:
            if started < self._latest_started:
                # Begun before the snapshot kept (the page's loop, overtaken by the snapshot
                # a pause or resume takes at once): older, not kept, or the page would show
                # the limit unpaused again until the next one.
                return data
            self._latest_started = started
            self._latest = data
            if "error" not in data:
                self._history.append(
                    {
                        "t": round(taken, 3),
                        "admitted": {row["name"]: row["admitted_per_s"] for row in data["limits"]},
                        "rate": {row["name"]: row["rate_per_s"] for row in data["limits"]},
                    }
                )
        return data

    # -- collection ---------------------------------------------------------------------

    def _collect(self) -> dict[str, Any]:
        app, throttler = self.app, self.throttler
        data = collect_status(app, throttler, self.timeout_s, self.minutes)
        known = known_limits(app, throttler)
        waiting = self._waiting()
        parked = self._parked()
        now = time.monotonic()
        counters = self._counters()
        levels: dict[str, float] = {}
        previous = self._previous
        for row in data["limits"]:
            name = row["name"]
            limit = throttler.rates.current(known[name].rule.limit)
            rate = limit.rate_per_s
            if row["learned_per_s"] is not None:
                rate = min(rate, row["learned_per_s"])
            row["rate_per_s"] = None if limit.algorithm.holds_units else round(rate, 6)
            # Not asked (timeout 0): unknown, as in_flight is.
            row["waiting"] = None if waiting is None else _by_key(waiting.get(name, {}))
            row["parked"] = _by_key(parked.get(name, {}))
            if row["tokens"] is not None and row["next_slot_s"] is not None:
                # The bucket's level: below 0 by the slots already handed out ahead.
                levels[name] = row["tokens"] - row["next_slot_s"] * rate
            row["admitted_per_s"], row["admitted_source"] = _admitted(
                name, limit, rate, now, counters, levels.get(name), previous
            )
        self._previous = (now, counters, levels)
        data["control"] = None  # the server fills it in
        return data

    def _counters(self) -> dict[str, float] | None:
        """Tasks admitted so far per limit, summed over this host's workers' counter files
        (a limit that admitted nothing yet is absent); None when there are none to read:
        metrics off, prometheus_client missing, or no worker counts on this host."""
        if not self.throttler.settings.metrics or not metrics.available():
            return None
        directories = [directory for _, directory in worker_dirs(self.app)]
        if not directories:
            return None
        return metrics.counter_totals(directories, ADMITTED, decision="allowed")

    def _waiting(self) -> dict[str, collections.Counter[str | None]] | None:
        """Tasks the workers hold (for a near slot, an ETA, or in their lines), per limit
        and key; None when the workers are not asked (``timeout`` 0)."""
        found: dict[str, collections.Counter[str | None]] = {}
        if self.timeout_s <= 0:
            return None
        # A connection of its own for each broadcast, closed after: kombu's reply consumer
        # on the app's shared one was seen to keep draining past the timeout from this
        # thread, and a second broadcast on the first one's connection heard no reply.
        with self.app.connection_for_write() as connection:
            inspect = self.app.control.inspect(timeout=self.timeout_s, connection=connection)
            replies = list((inspect.scheduled() or {}).values())
        # and the tasks waiting unreserved in the workers' lines (throttle.celery.waiting)
        with self.app.connection_for_write() as connection:
            for reply in (
                self.app.control.broadcast(
                    "throttle_waiting", reply=True, timeout=self.timeout_s, connection=connection
                )
                or ()
            ):
                replies.extend(reply.values() if isinstance(reply, Mapping) else ())
        for entries in replies:
            if not isinstance(entries, list):
                continue  # a worker without the command answers {"error": ...}
            for entry in entries:
                request = entry.get("request") if isinstance(entry, Mapping) else None
                if not isinstance(request, Mapping):
                    continue
                queue = queue_of(request.get("delivery_info"))
                self._count(found, request.get("name"), request.get("args"),
                            request.get("kwargs"), queue)  # fmt: skip
        return found

    def _parked(self) -> dict[str, collections.Counter[str | None]]:
        """Tasks parked in Redis, per limit and key (one that cannot be read is left out:
        ``celery throttle parked`` shows it)."""
        found: dict[str, collections.Counter[str | None]] = {}
        for one in wrap_errors(lambda: list(self.throttler.parking.scan())):
            try:
                sig = parked_signature(one.payload)
            except Exception:
                continue
            options = sig.get("options")
            queue = options.get("queue") if isinstance(options, dict) else None
            if isinstance(queue, str) and queue.endswith(LANE_SUFFIX):
                queue = queue[: -len(LANE_SUFFIX)]  # its lane counts as the queue
            self._count(found, sig.get("task"), sig.get("args"), sig.get("kwargs"),
                        queue if isinstance(queue, str) else None)  # fmt: skip
        return found

    def _count(
        self,
        into: dict[str, collections.Counter[str | None]],
        name: object,
        args: object,
        kwargs: object,
        queue: str | None,
    ) -> None:
        task = self.app.tasks.get(name) if isinstance(name, str) else None
        if task is None:
            return
        positional = tuple(args) if isinstance(args, list | tuple) else ()
        keywords = dict(kwargs) if isinstance(kwargs, dict) else {}
        named: dict[str, Any] | None = None
        for rule in self.throttler.rules(task, declared_by(task), queue):
            key = None
            if rule.key is not None:
                if named is None:
                    named = named_arguments(task.run, positional, keywords)
                try:
                    key = key_for(rule, named, positional, keywords)
                except Exception:  # the arguments do not give a key: counted as unknown
                    key = "?"
            into.setdefault(rule.name, collections.Counter())[key] += 1


def _by_key(counts: Mapping[str | None, int]) -> dict[str, Any]:
    """A limit's count, and for a keyed limit its busiest keys."""
    keys = [(key, n) for key, n in counts.items() if key is not None]
    keys.sort(key=lambda item: (-item[1], item[0]))
    return {
        "total": sum(counts.values()),
        "keys": [{"key": key, "count": n} for key, n in keys[:TOP_KEYS]],
        "more_keys": max(len(keys) - TOP_KEYS, 0),
    }


def _admitted(
    name: str,
    limit: Limit,
    rate_per_s: float,
    now: float,
    counters: Mapping[str, float] | None,
    level: float | None,
    previous: tuple[float, Mapping[str, float] | None, Mapping[str, float]] | None,
) -> tuple[float | None, str | None]:
    """Tasks admitted per s since the last snapshot, and from what: ``counters`` (the
    workers' own count) or ``tokens`` (estimated from the ``level`` of a limit without a
    key: its tokens less the slots handed out ahead, now and at the last snapshot);
    (None, None) for the first snapshot, or when neither can tell."""
    if previous is None:
        return None, None
    then, old_counters, old_levels = previous
    elapsed = now - then
    if elapsed <= 0:
        return None, None
    if counters is not None and old_counters is not None:
        # A restarted worker starts from 0: its drop is not a negative rate.
        admitted = counters.get(name, 0.0) - old_counters.get(name, 0.0)
        return round(max(admitted, 0.0) / elapsed, 3), "counters"
    if level is None or name not in old_levels or limit.algorithm.holds_units:
        return None, None
    if not math.isfinite(rate_per_s):
        return None, None
    refilled = old_levels[name] + rate_per_s * elapsed
    if old_levels[name] >= 1 or level >= 1:
        # Not binding at both ends: the refill beyond the burst was not there to spend (an
        # undercount when the bucket filled up and was drained within the interval).
        refilled = min(limit.capacity, refilled)
    return round(max(refilled - level, 0.0) / elapsed, 3), "tokens"
