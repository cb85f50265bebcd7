"""What the throttler reports about its decisions, behind one small interface.

The gate, the rescheduling code and the settle step call the hooks of one
:class:`Observer` (the throttler's :attr:`~throttle.celery.runtime.Throttler.observer`):
a fan-out of the reporters below, each plugged in at one place, as dramatiq's middleware
plugs in Prometheus. None of them may fail or lose a task: the fan-out logs and swallows
each reporter's errors.

- :class:`PrometheusReporter`: the worker's Prometheus counters (:mod:`throttle.metrics`;
  nothing while metrics are off).
- :class:`FlowerReporter`: a ``task-throttled`` event per deferral, for Flower (and a
  ``task-shadowed`` event when a limit in shadow mode would have delayed a task).
- :class:`FleetStatsReporter`: the fleet-wide per-minute counts in Redis
  (:class:`throttle.stats.StatsBook`, read by ``celery throttle status``).
- :class:`TaskTrailReporter`: per task, the last deferral or time out, in Redis for a
  while (read by ``celery throttle task ID``).
- :class:`LogReporter`: a log line at INFO per task that waits for its slot or is deferred.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

from celery import Task

from throttle import metrics
from throttle.celery.events import BatchedEvents
from throttle.celery.message import H_DEFERRALS
from throttle.redis.keys import KeySpace
from throttle.rules import Rule, Target
from throttle.stats import StatsBook, Tally

logger = logging.getLogger("throttle")


class Observed(Protocol):
    """What an observer reads of one execution of a task: the hooks are given a
    :class:`throttle.celery.execution.Execution`. (The throttler holds its observers, and
    an execution its throttler: naming that class here would close an import circle.)"""

    @property
    def task(self) -> Task: ...

    @property
    def request(self) -> Any: ...

    @property
    def rules(self) -> tuple[Rule, ...]: ...

    @property
    def targets(self) -> list[Target]:
        """Each rule's (limit in force, key, cost); empty when the gate did not evaluate
        them (``defer_task``)."""

    @property
    def message_headers(self) -> Mapping[str, Any]:
        """The headers of the task's message (the throttler's deferral count among them)."""


Shadowed = tuple[Observed, Sequence[str], Sequence[float]]
"""One shadow look, as :meth:`Observer.shadowed` takes it: the execution, the limits in
shadow mode, the wait each would have imposed (s)."""


class Observer:
    """Hooks on what the throttler decides; each does nothing here. Times in s."""

    def allowed(self, execution: Observed, wait_s: float) -> None:
        """The execution may run after ``wait_s`` (0: at once)."""

    def deferred(
        self, execution: Observed, limits: Sequence[str], how: str, wait_s: float, count: int
    ) -> None:
        """The task comes back in ``wait_s``, re-published (``how``: ``"republish"``) or
        parked (``"park"``), for the ``count``-th time, held by ``limits``."""

    def timed_out(self, execution: Observed, limits: Sequence[str], action: str) -> None:
        """The task passed its deadline: ``action`` is ``"fail"``, ``"dead_letter"`` or
        ``"expired"`` (its ``expires`` came before its slot: revoked)."""

    def settled(self, limits: Sequence[str], deltas: Sequence[float]) -> None:
        """An acquisition was settled: each limit's refund (< 0) or extra charge (> 0)."""

    def redis_error(self, limits: Iterable[str]) -> None:
        """The limiter's Redis failed while serving these limits."""

    def shadowed(self, execution: Observed, limits: Sequence[str], waits: Sequence[float]) -> None:
        """Limits in shadow mode would have delayed the task by ``waits`` (one per limit;
        0: not at all); it runs at once (:mod:`throttle.celery.shadow`)."""

    def shadowed_many(self, looks: Sequence[Shadowed]) -> None:
        """:meth:`shadowed` for each of ``looks``: the shadow looks a process sent together
        (as frequent as the tasks: an observer that can take them at once overrides this)."""
        for execution, limits, waits in looks:
            self.shadowed(execution, limits, waits)


class PrometheusReporter(Observer):
    """The worker's Prometheus counters and histograms (:mod:`throttle.metrics`)."""

    def allowed(self, execution: Observed, wait_s: float) -> None:
        if metrics.counting():  # every admitted task comes here: no list while metrics are off
            metrics.allowed([rule.name for rule in execution.rules], wait_s)

    def deferred(
        self, execution: Observed, limits: Sequence[str], how: str, wait_s: float, count: int
    ) -> None:
        by_gate = bool(execution.targets)  # else defer_task(): the upstream's word
        metrics.deferred(limits, how, wait_s, by_gate=by_gate)
        if not by_gate:
            metrics.upstream_deferred(limits)

    def timed_out(self, execution: Observed, limits: Sequence[str], action: str) -> None:
        metrics.timed_out(limits, action)

    def settled(self, limits: Sequence[str], deltas: Sequence[float]) -> None:
        metrics.settled(limits, deltas)

    def redis_error(self, limits: Iterable[str]) -> None:
        metrics.redis_error(limits)

    def shadowed(self, execution: Observed, limits: Sequence[str], waits: Sequence[float]) -> None:
        metrics.shadowed([(limits, waits)])

    def shadowed_many(self, looks: Sequence[Shadowed]) -> None:
        if metrics.counting():
            metrics.shadowed([(limits, waits) for _, limits, waits in looks])


class FlowerReporter(Observer):
    """A ``task-throttled`` event per deferral: Flower shows the task as THROTTLED and
    counts the events in ``flower_events_total``. A ``task-shadowed`` event per task
    that a limit in shadow mode would have delayed, sent in batches
    (:class:`~throttle.celery.events.BatchedEvents`: as frequent as the tasks, an event
    published each would cost the worker more than the look itself)."""

    def __init__(self) -> None:
        self._batched: BatchedEvents | None = None

    def deferred(
        self, execution: Observed, limits: Sequence[str], how: str, wait_s: float, count: int
    ) -> None:
        # defer_task() (an upstream's word, after the body ran) has no targets.
        targets = {limit.name: (key, cost) for limit, key, cost in execution.targets}
        execution.task.send_event(
            "task-throttled",
            retry=False,  # an event is not worth blocking a pool slot on a broker outage
            # The task's name, though task-received carried it: the worker's main process
            # buffers its task events, so Flower may see this one first, and would count it
            # under an unnamed task.
            name=execution.task.name,
            limits=list(limits),
            keys=[targets.get(name, (None, None))[0] for name in limits],
            costs=[targets.get(name, (None, None))[1] for name in limits],
            wait=round(wait_s, 3),
            slot=round(time.time() + wait_s, 3),
            how=how,
            deferrals=count,
        )

    def shadowed(self, execution: Observed, limits: Sequence[str], waits: Sequence[float]) -> None:
        if max(waits, default=0.0) <= 0:
            return  # a shadow that would not have delayed the task: no event
        task = execution.task
        if self._batched is None:
            self._batched = BatchedEvents(task.app)
        self._batched.send(
            "task-shadowed",
            uuid=execution.request.id,
            hostname=execution.request.hostname,
            name=task.name,
            limits=list(limits),
            waits=[round(wait, 3) for wait in waits],
        )

    def shadowed_many(self, looks: Sequence[Shadowed]) -> None:
        events = [
            {
                "uuid": execution.request.id,
                "hostname": execution.request.hostname,
                "name": execution.task.name,
                "limits": list(limits),
                "waits": [round(wait, 3) for wait in waits],
            }
            for execution, limits, waits in looks
            if max(waits, default=0.0) > 0  # a shadow that would not have delayed: none
        ]
        if events:
            if self._batched is None:
                self._batched = BatchedEvents(looks[0][0].task.app)
            self._batched.send_many("task-shadowed", events)


class FleetStatsReporter(Observer):
    """The fleet-wide counts of denials, parkings and time-outs (:class:`StatsBook`), one
    round trip each; of waits and shadow looks, gathered and written about once a second
    (:class:`Tally`). A failed write counts as a Redis error (``on_error``), and is
    otherwise lost: a count is not worth a task."""

    def __init__(self, stats: StatsBook, on_error: Observer) -> None:
        self.stats = stats
        self.on_error = on_error
        # Waits (at a high rate, most tasks wait a moment for their slot) and shadow looks
        # (every task) come as often as the tasks: one round trip a second, not a task.
        self.tally = Tally(stats, on_error=self._tally_failed)

    # DENIED/MIN counts tasks, each once: at its first deferral, or when it waited for its
    # slot without one (a task deferred and then held for its slot counted already).
    def allowed(self, execution: Observed, wait_s: float) -> None:
        if wait_s >= WAIT_LOGGED_S and H_DEFERRALS not in execution.message_headers:
            self.tally.add([rule.name for rule in execution.rules], "waited")

    def deferred(
        self, execution: Observed, limits: Sequence[str], how: str, wait_s: float, count: int
    ) -> None:
        events: tuple[str, ...] = ("denied",) if count <= 1 else ()
        if how == "park":
            events += ("parked",)  # every parking: the parking lot's own traffic
        if events:
            self._record(limits, events)

    def timed_out(self, execution: Observed, limits: Sequence[str], action: str) -> None:
        self._record(limits, ("timeout",))

    def shadowed(self, execution: Observed, limits: Sequence[str], waits: Sequence[float]) -> None:
        self.tally.add_shadow([(limits, waits)])

    def shadowed_many(self, looks: Sequence[Shadowed]) -> None:
        self.tally.add_shadow([(limits, waits) for _, limits, waits in looks])

    def _tally_failed(self, limits: list[str], exc: Exception) -> None:
        self.on_error.redis_error(limits)
        logger.debug("throttle: cannot record waits or shadow looks in the fleet stats: %s", exc)

    def _record(self, limits: Sequence[str], events: Sequence[str]) -> None:
        try:
            self.stats.record_events(limits, events)
        except Exception as exc:  # BackendError, or anything else
            self.on_error.redis_error(limits)
            logger.debug("throttle: cannot record %s in the fleet stats: %s", events, exc)


WAIT_LOGGED_S = 0.001
"""A task admitted for a slot at least this far ahead (s) waited for it: logged, and counted
as ``waited`` in the fleet stats. Below, it is the time the decision itself took."""


class LogReporter(Observer):
    """A line at INFO on the ``throttle`` logger for each task that waits for its slot (it
    sleeps in the worker) or is deferred (re-published for later, or parked), with the
    limits and the wait: what makes throttling visible in a worker's log. Celery itself then
    logs a deferral as ``Task ... retry: Retry in 1.9s: Throttled(...)``."""

    def allowed(self, execution: Observed, wait_s: float) -> None:
        if wait_s >= WAIT_LOGGED_S:
            logger.info(
                "throttle: %s[%s] waits %.3f s for its slot (limits %s)",
                execution.task.name, execution.request.id, wait_s,
                ", ".join(rule.name for rule in execution.rules),
            )  # fmt: skip

    def deferred(
        self, execution: Observed, limits: Sequence[str], how: str, wait_s: float, count: int
    ) -> None:
        logger.info(
            "throttle: %s[%s] deferred %.3f s by %s (%s, deferral %d)",
            execution.task.name, execution.request.id, wait_s, ", ".join(limits),
            "parked in Redis" if how == "park" else "re-published", count,
        )  # fmt: skip

    def timed_out(self, execution: Observed, limits: Sequence[str], action: str) -> None:
        logger.info(
            "throttle: %s[%s] passed its deadline under %s: %s",
            execution.task.name, execution.request.id, ", ".join(limits), action,
        )  # fmt: skip


TRAIL_AFTER_S = 3600.0
"""How long a task's trail record outlives the time it was due back, in s."""
TRAIL_TIMEOUT_S = 86400.0
"""How long the record of a task's time out lives, in s."""


class TaskTrailReporter(Observer):
    """Per task, the last deferral or time out: a small HASH (``KeySpace.task_key``) with
    ``how`` (``republish``, ``park``, ``fail``, ``dead_letter``, ``expired``), ``limits``
    (JSON list), ``at`` and ``until`` (epoch s on the Redis clock, as :class:`RedisClock`
    estimates it) and ``deferrals``. It expires :data:`TRAIL_AFTER_S` after ``until`` (a
    time out: after :data:`TRAIL_TIMEOUT_S`), so the trail of a busy fleet stays bounded by its
    traffic of that long. One pipelined round trip per deferral; a failed write is lost
    (logged at debug level by :class:`Observers`), never the task."""

    def __init__(self, client: Any, keyspace: KeySpace, now: Callable[[], float]) -> None:
        self.client, self.keyspace, self.now = client, keyspace, now

    def deferred(
        self, execution: Observed, limits: Sequence[str], how: str, wait_s: float, count: int
    ) -> None:
        self._write(execution, how, limits, wait_s, wait_s + TRAIL_AFTER_S, count)

    def timed_out(self, execution: Observed, limits: Sequence[str], action: str) -> None:
        self._write(execution, action, limits, 0.0, TRAIL_TIMEOUT_S, None)

    def _write(
        self,
        execution: Observed,
        how: str,
        limits: Sequence[str],
        wait_s: float,
        ttl_s: float,
        count: int | None,
    ) -> None:
        task_id = execution.request.id
        if not isinstance(task_id, str) or not task_id:
            return
        now = self.now()
        record = {
            "how": how,
            "limits": json.dumps(list(limits)),
            "at": repr(round(now, 6)),
            "until": repr(round(now + wait_s, 6)),
        }
        if count is not None:
            record["deferrals"] = str(count)
        key = self.keyspace.task_key(task_id)
        with self.client.pipeline(transaction=True) as pipe:
            pipe.delete(key)
            pipe.hset(key, mapping=record)
            pipe.pexpire(key, max(round(ttl_s * 1000), 1))
            pipe.execute()


class Observers(Observer):
    """Calls every hook of each observer in turn; an observer's error is logged and
    swallowed, so that reporting never fails a task."""

    def __init__(self, observers: Iterable[Observer] = ()) -> None:
        self.observers: list[Observer] = []
        self._allowed: list[Observer] = []
        """The observers whose ``allowed`` does something: the hook of every admitted
        task, which the others would only slow down."""
        for observer in observers:
            self.add(observer)

    def add(self, observer: Observer) -> None:
        self.observers.append(observer)
        if type(observer).allowed is not Observer.allowed:
            self._allowed.append(observer)

    def allowed(self, execution: Observed, wait_s: float) -> None:
        for observer in self._allowed:
            try:
                observer.allowed(execution, wait_s)
            except Exception as exc:
                logger.debug("throttle: %s failed: %s", type(observer).__name__, exc)

    def deferred(
        self, execution: Observed, limits: Sequence[str], how: str, wait_s: float, count: int
    ) -> None:
        self._each(lambda observer: observer.deferred(execution, limits, how, wait_s, count))

    def timed_out(self, execution: Observed, limits: Sequence[str], action: str) -> None:
        self._each(lambda observer: observer.timed_out(execution, limits, action))

    def settled(self, limits: Sequence[str], deltas: Sequence[float]) -> None:
        self._each(lambda observer: observer.settled(limits, deltas))

    def redis_error(self, limits: Iterable[str]) -> None:
        names = list(limits)  # an iterable is read once per observer
        self._each(lambda observer: observer.redis_error(names))

    def shadowed(self, execution: Observed, limits: Sequence[str], waits: Sequence[float]) -> None:
        self._each(lambda observer: observer.shadowed(execution, limits, waits))

    def shadowed_many(self, looks: Sequence[Shadowed]) -> None:
        self._each(lambda observer: observer.shadowed_many(looks))

    def _each(self, hook: Callable[[Observer], None]) -> None:
        for observer in self.observers:
            try:
                hook(observer)
            except Exception as exc:
                logger.debug("throttle: %s failed: %s", type(observer).__name__, exc)


def default_observers(stats: StatsBook, trail: TaskTrailReporter | None = None) -> Observers:
    """The throttler's reporters: the log, Prometheus, Flower events, fleet-wide stats, and
    the tasks' trail when given."""
    observers = Observers([LogReporter(), PrometheusReporter(), FlowerReporter()])
    observers.add(FleetStatsReporter(stats, on_error=observers))
    if trail is not None:
        observers.add(trail)
    return observers
