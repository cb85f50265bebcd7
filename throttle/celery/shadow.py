"""Shadow mode: a limit that decides and records, and delays nothing.

A limit in shadow mode (``mode: shadow``, ``settings.mode``, ``celery throttle shadow``)
is split out of a task's rules (:meth:`throttle.celery.runtime.Throttler.rule_set`): the
task never waits for it. Instead, when the task first arrives, :func:`look` acquires the
limit's *shadow twin* for it: the same algorithm and numbers under the name
``NAME.shadow``, a state of its own in Redis, reserving its next slot as the enforced
limit would (a token bucket or GCRA reserves the slot and says how far it is; a window
that is full says when it frees). The wait the twin answers is the wait the limit would
have imposed, counted from the task's send (the ``throttle_sent`` header the producer
writes on the Redis clock, :mod:`throttle.celery.sent`) when the limit would delay it: the
task would have run at its slot, and was waiting since it was sent, queued or not. A task
the limit would not delay counts 0 (its time in the queue is not the limit's). Recorded by
the throttler's observers (a ``throttle_shadow_wait_seconds``
histogram, a ``task-shadowed`` event for Flower, the fleet-wide counts behind ``celery
throttle status``). The twin's state delays nothing: no enforced limit reads it, and no
task waits for it.

What this measures: the delays the limit would impose on the tasks as they arrive now.
Once enforced, delayed tasks come back later, so the arrival process itself changes; for
a backlog that the limit drains at its rate, the two agree. A task re-published by an
enforced limit is not looked at again (only on its first arrival: its message carries no
deferral yet), so each task counts once. The task does not wait for its look: a process
gathers its looks for up to :data:`BATCH_S` and sends them in one round trip, each dated
when its task arrived (:class:`Looks`). Switching a limit to ``enforce`` at run time
(``celery throttle enforce``) makes its real state take over from then on; the twin's is
left to expire.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
import weakref
from collections.abc import Sequence

from throttle.celery.execution import Execution
from throttle.celery.message import H_DEFERRALS, sent_header
from throttle.celery.runtime import Throttler
from throttle.errors import BackendError, ThrottleError
from throttle.gathering import Gathering
from throttle.rules import Rule, Target, kept_in_hand, targets
from throttle.spec import SHADOW_SUFFIX, Limit

logger = logging.getLogger("throttle")

HORIZON_S = 3600.0
"""How far ahead a twin reserves: a wait the limit would impose beyond it counts as this."""


@functools.lru_cache(maxsize=1024)
def shadow_limit(limit: Limit) -> Limit:
    """The shadow twin of ``limit``: its algorithm and numbers, its own state."""
    return dataclasses.replace(limit, name=limit.name + SHADOW_SUFFIX)


BATCH_S = 0.05
"""How long a process gathers shadow looks before it sends them together, in s."""
BATCH_MAX = 100
"""A process sends its shadow looks at once when this many are gathered."""


@dataclasses.dataclass(slots=True)
class _Look:
    """One task's look, gathered: what it asks of each twin, and when."""

    execution: Execution
    names: list[str]
    twins: list[tuple[Limit, str | None, float]]
    asked: float
    """When the task arrived (monotonic s of this process)."""
    queued_s: float
    """How long before ``asked`` it was sent (s, Redis clock)."""


class Looks(Gathering[list[_Look]]):
    """The shadow looks of one process and throttler, gathered for :data:`BATCH_S` (or
    :data:`BATCH_MAX` looks) and sent in one round trip (:meth:`Limiter.acquire_each`), each
    dated when its task arrived so that the twin sees the arrivals' own spacing. The task
    never waits for its look: it runs while the look is gathered, and the gatherer's
    thread sends it. The price: a look reaches its twin up to :data:`BATCH_S` after its task, so
    the twins of several processes take their looks slightly out of order (each counts
    from its own arrival); the looks a process gathered in its last :data:`BATCH_S` are lost
    when it dies."""

    def __init__(self, throttler: Throttler) -> None:
        self.throttler = throttler
        super().__init__(BATCH_S)

    def _reset(self) -> None:
        self._looks: list[_Look] = []

    def add(self, look: _Look) -> None:
        """Gather ``look``; sent within :data:`BATCH_S`, or now when the batch is full."""
        with self._lock:
            self._looks.append(look)
            full = len(self._looks) >= BATCH_MAX
            if not full:
                self._arm()
        if full:
            self.flush()

    def _take(self) -> list[_Look] | None:
        return self._looks or None

    def _write(self, looks: list[_Look]) -> None:
        """Send ``looks`` in one round trip, and report each one's waits to the observers."""
        throttler = self.throttler
        now = time.monotonic()
        asks = [twin for look in looks for twin in look.twins]
        ago = [now - look.asked for look in looks for _ in look.twins]
        try:
            decisions = iter(throttler.limiter.acquire_each(asks, max_wait_s=HORIZON_S, ago_s=ago))
        except BackendError as exc:
            logger.debug("throttle: %d shadow looks failed: %s", len(looks), exc)
            return
        for look in looks:
            waits: list[float] = []
            for _ in look.twins:
                decision = next(decisions)
                if isinstance(decision, ThrottleError):
                    logger.warning(
                        "throttle: shadow look of task %s: %s", look.execution.request.id, decision
                    )
                    continue
                wait = decision.wait_s if decision.allowed else decision.retry_after_s
                if wait > 0:  # its slot is ahead: it would have waited for it since the send
                    wait += look.queued_s
                waits.append(min(max(wait, 0.0), HORIZON_S))
            if len(waits) == len(look.twins):
                throttler.observer.shadowed(look.execution, look.names, waits)


_LOOKS: weakref.WeakKeyDictionary[Throttler, Looks] = weakref.WeakKeyDictionary()
_LOOKS_LOCK = threading.Lock()


def looks_of(throttler: Throttler) -> Looks:
    """The gathered shadow looks of ``throttler`` in this process (:meth:`Looks.flush`
    sends them now)."""
    looks = _LOOKS.get(throttler)
    if looks is None:
        with _LOOKS_LOCK:
            looks = _LOOKS.get(throttler)
            if looks is None:
                looks = _LOOKS[throttler] = Looks(throttler)
    return looks


def look(execution: Execution, rules: Sequence[Rule]) -> tuple[tuple[Rule, Target], ...]:
    """What the limits of ``rules`` (in shadow mode) would have done to this execution:
    the wait each would impose, reported to the throttler's observers once the look is
    sent (:class:`Looks`). Returns each rule with its target (limit, key, cost) for the
    task's ticket, so that an upstream's refusal reported from the body is answered as
    it would be enforced (:func:`throttle.celery.upstream.report_upstream`); evaluated
    for a copy that came back too, which is not looked at again. Never raises, never
    delays the task (an error loses the look, logged, and returns nothing)."""
    if execution.eager:
        return ()  # eager mode: no fleet to shadow, and a refusal raises in the caller
    throttler = execution.throttler
    try:
        found = targets(
            rules, execution.fn, execution.args, execution.kwargs, throttler.rates.current
        )
        found = kept_in_hand(found, throttler.settings.burst_margin_s)  # as enforced
    except Exception as exc:  # a bad key or cost for this task: it would fail enforced
        logger.warning("throttle: shadow look of task %s: %s", execution.request.id, exc)
        return ()
    if H_DEFERRALS not in execution.message_headers:  # looked at when it first arrived
        twins: list[tuple[Limit, str | None, float]] = []
        for limit, key, cost in found:
            twin = shadow_limit(limit)
            twins.append((twin, key, min(cost, twin.capacity)))
        # The look outlives the task's run: execution.request was read (cached) above.
        looks_of(throttler).add(
            _Look(
                execution, [rule.name for rule in rules], twins, time.monotonic(),
                _queued_s(execution),
            )
        )  # fmt: skip
    return tuple(zip(rules, found, strict=True))


def _queued_s(execution: Execution) -> float:
    """How long ago (s) the task was sent: its ``throttle_sent`` header against now, both
    on the Redis clock (0 when it has none, or when the clocks disagree into the future)."""
    sent = sent_header(execution.message_headers)
    if sent is None:
        return 0.0
    return min(max(execution.throttler.clock.now() - sent, 0.0), HORIZON_S)
