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
deferral yet), so each task counts once. The task does not wait for its look, nor evaluate it: its
path only records that it arrived; a process gathers the looks for up to :data:`BATCH_S`,
and its gatherer's thread evaluates their keys and costs and sends them in one round trip,
each dated when its task arrived (:class:`Looks`). With one prefetched task per pool
child, the time a child spends on each task bounds a worker's speed: work done off the
task's path is done while the child waits for its next task. Switching a limit to
``enforce`` at run time (``celery throttle enforce``) makes its real state take over from
then on; the twin's is left to expire.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any, cast

from throttle.celery.execution import Execution
from throttle.celery.message import H_DEFERRALS, sent_header
from throttle.celery.observe import Shadowed
from throttle.celery.runtime import Throttler
from throttle.decision import Decision
from throttle.errors import BackendError, ThrottleError
from throttle.gathering import Gathering
from throttle.limiter import Limiter
from throttle.rules import Rule, Target, kept_in_hand, targets
from throttle.spec import SHADOW_SUFFIX, Algorithm, Limit
from throttle.upstream.headers import UpstreamSignal
from throttle.upstream.policy import Target as Answered
from throttle.upstream.policy import apply_signal

logger = logging.getLogger("throttle")

HORIZON_S = 3600.0
"""How far ahead a twin reserves: a wait the limit would impose beyond it counts as this."""


@functools.lru_cache(maxsize=1024)
def shadow_limit(limit: Limit) -> Limit:
    """The shadow twin of ``limit``: its algorithm and numbers, its own state."""
    return dataclasses.replace(limit, name=limit.name + SHADOW_SUFFIX)


@functools.lru_cache(maxsize=1024)
def pacing_twin(limit: Limit) -> Limit | None:
    """For a window or a fair limit, a second twin that keeps its backlog's place: a
    plain GCRA at the window's rate, burst its count, or the fair limit itself made plain
    (its algorithm, rate and burst, one state per key); same name as
    :func:`shadow_limit`, a state of its own under its algorithm's code, which ``reset``
    clears too. None for the other limits, whose twin reserves.

    A window cannot reserve: a look it denies is told when the window frees, the same
    answer for every task of a backlog, and is not counted. A fair limit books nothing
    beyond its near horizon, and tells a key's waiting tasks to come back at most its
    plan's reach ahead (about 3 s). Enforced, a backlog drains at the limit's rate: 50
    tasks at once on a 5/s window wait up to 10 s, 200 of one tenant on a 20/s fair limit
    up to 9 s, where the twin alone answered at most a period, or about 3 s. The pacing
    twin reserves each look's place in that drain, as its key's alone (no key of a fair
    limit runs faster than the whole rate): the look would have waited for the later of
    the two answers (:func:`_would_wait`)."""
    if limit.fair:
        return dataclasses.replace(
            limit, name=limit.name + SHADOW_SUFFIX, fair=False, weights=(), default_weight=1.0
        )
    if limit.algorithm.reserves or limit.algorithm.holds_units:
        return None
    return dataclasses.replace(
        limit, name=limit.name + SHADOW_SUFFIX, algorithm=Algorithm.GCRA, burst=limit.count
    )


def twins_of(limit: Limit) -> tuple[Limit, ...]:
    """The twins a look at ``limit`` acquires, the shadow twin first."""
    pace = pacing_twin(limit)
    twin = shadow_limit(limit)
    return (twin,) if pace is None else (twin, pace)


def _would_wait(limit: Limit, decisions: Sequence[Decision]) -> float:
    """The wait the twins' ``decisions`` (in :func:`twins_of`'s order) say ``limit`` would
    impose: the twin's; for a window, 0 when its twin admits the look (enforced, the task
    would run at once: the window's own count decides, a burst at a window's edge
    included), else the later of the window's opening and the look's place in the
    backlog's drain (the pacing twin's); for a fair limit, the later of the two."""
    waits = [d.wait_s if d.allowed else d.retry_after_s for d in decisions]
    if not limit.fair and len(decisions) > 1 and decisions[0].allowed:
        return waits[0]
    return max(waits)


BATCH_S = 0.05
"""How long a process gathers shadow looks before it sends them together, in s."""
BATCH_MAX = 100
"""A process sends its shadow looks at once when this many are gathered."""
HOLD_AFTER_S = BATCH_S + 0.01
"""How long after an upstream's refusal its hold is placed on the twins, in s: by then
every process has sent the looks it gathered before the refusal (dated before it, a
look sent after the hold would count the hold as its wait)."""


Pairs = tuple[tuple[Rule, Target], ...]
"""Each limit in shadow mode with its target (limit, key, cost) for one execution."""


@dataclasses.dataclass(slots=True, eq=False)
class Shadowing:
    """What the limits in shadow mode of one execution look at, evaluated on first use
    (:meth:`pairs`): by the gatherer's thread, which sends the look, or by the body when it
    reports an upstream's refusal. The task's own path only records that it arrived."""

    execution: Execution
    rules: tuple[Rule, ...]
    _pairs: Pairs | None = None

    def pairs(self) -> Pairs:
        """Each rule with its target, as enforced (the rates in force, the burst margin);
        () when the task's arguments give no key or cost (logged: enforced, the task
        would fail). Two threads evaluating at once find the same answer."""
        if self._pairs is None:
            execution = self.execution
            try:
                found = targets(
                    self.rules, execution.fn, execution.args, execution.kwargs,
                    execution.throttler.rates.current,
                )  # fmt: skip
                found = kept_in_hand(found, execution.throttler.settings.burst_margin_s)
                self._pairs = tuple(zip(self.rules, found, strict=True))
            except Exception as exc:  # a bad key or cost for this task: it would fail enforced
                logger.warning("throttle: shadow look of task %s: %s", execution.request.id, exc)
                self._pairs = ()
        return self._pairs


@dataclasses.dataclass(slots=True)
class _Look:
    """One task's look, gathered: what it arrived with, and when."""

    shadowing: Shadowing
    asked: float
    """When the task arrived (monotonic s of this process)."""
    sent: float | None
    """When it was sent (epoch s, Redis clock: its ``throttle_sent`` header), if known."""


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
        """Evaluate ``looks`` (their keys and costs, off the tasks' path), send them in one
        round trip, and report each one's waits to the observers."""
        throttler = self.throttler
        now, redis_now = time.monotonic(), throttler.clock.now()
        asks: list[tuple[Limit, str | None, float]] = []
        ago: list[float] = []
        looked: list[tuple[_Look, Pairs, float]] = []
        for look in looks:
            pairs = look.shadowing.pairs()
            if not pairs:
                continue
            for _, (limit, key, cost) in pairs:
                for twin in twins_of(limit):
                    asks.append((twin, key, min(cost, twin.capacity)))
                    ago.append(now - look.asked)
            looked.append((look, pairs, _queued_s(look, redis_now - (now - look.asked))))
        if not asks:
            return
        try:
            decisions = iter(throttler.limiter.acquire_each(asks, max_wait_s=HORIZON_S, ago_s=ago))
        except BackendError as exc:
            logger.debug("throttle: %d shadow looks failed: %s", len(looked), exc)
            return
        seen: list[Shadowed] = []
        for look, pairs, queued_s in looked:
            execution = look.shadowing.execution
            waits: list[float] = []
            for _, (limit, _, _) in pairs:
                answers = [next(decisions) for _ in twins_of(limit)]
                failed = [a for a in answers if isinstance(a, ThrottleError)]
                if failed:
                    logger.warning(
                        "throttle: shadow look of task %s: %s", execution.request.id, failed[0]
                    )
                    continue
                wait = _would_wait(limit, cast("list[Decision]", answers))
                if wait > 0:  # its slot is ahead: it would have waited for it since the send
                    wait += queued_s
                waits.append(min(max(wait, 0.0), HORIZON_S))
            if len(waits) == len(pairs):
                seen.append((execution, [rule.name for rule, _ in pairs], waits))
        if seen:
            throttler.observer.shadowed_many(seen)


class _HoldsLater:
    """The limiter as :func:`~throttle.upstream.policy.apply_signal` uses it, whose holds
    are kept to be placed later (:func:`hold_twins`); every other call goes through."""

    def __init__(self, limiter: Limiter) -> None:
        self.limiter = limiter
        self.holds: list[tuple[str, str | None, float]] = []

    def hold(self, limit: str, key: str | None, hold_s: float) -> None:
        self.holds.append((limit, key, hold_s))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.limiter, name)


def hold_twins(throttler: Throttler, signal: UpstreamSignal, twins: Sequence[Answered]) -> None:
    """Answer an upstream's refusal on the twins of the limits in shadow mode as it would
    be answered enforced (:func:`~throttle.upstream.policy.apply_signal`), the holds
    placed :data:`HOLD_AFTER_S` later (for as long as they end when they would have): this
    process's looks are sent first, the other processes' by then."""
    looks_of(throttler).flush()
    later = _HoldsLater(throttler.limiter)
    apply_signal(cast(Limiter, later), None, signal, twins, throttler.learned)
    if later.holds:
        timer = threading.Timer(
            HOLD_AFTER_S, _place, (throttler.limiter, later.holds, time.monotonic())
        )
        timer.daemon = True
        timer.start()


def _place(limiter: Limiter, holds: list[tuple[str, str | None, float]], since: float) -> None:
    late = time.monotonic() - since
    for limit, key, hold_s in holds:
        if hold_s > late:
            try:
                limiter.hold(limit, key, hold_s - late)
            except ThrottleError as exc:  # the hold is lost; the would-be waits are lower
                logger.debug("throttle: holding shadow twin %s: %s", limit, exc)


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


def look(execution: Execution, rules: Sequence[Rule]) -> Shadowing | None:
    """What the limits of ``rules`` (in shadow mode) would have done to this execution:
    the wait each would impose, reported to the throttler's observers once the look is
    sent (:class:`Looks`). Returns the execution's :class:`Shadowing`, whose pairs (each
    rule with its target) the task's ticket keeps so that an upstream's refusal reported
    from the body is answered as it would be enforced
    (:func:`throttle.celery.upstream.report_upstream`); a copy that came back gets one
    too, and is not looked at again. Never raises, never delays the task: the task's
    path records its arrival; the keys and costs are evaluated by the gatherer's thread
    (an error there loses the look, logged). None in eager mode and direct calls."""
    if execution.eager:
        return None  # eager mode: no fleet to shadow, and a refusal raises in the caller
    shadowing = Shadowing(execution, tuple(rules))
    headers = execution.message_headers
    if H_DEFERRALS not in headers:  # looked at when it first arrived
        # The look outlives the task's run: execution.request was read (cached) above.
        looks_of(execution.throttler).add(_Look(shadowing, time.monotonic(), sent_header(headers)))
    return shadowing


def _queued_s(look: _Look, arrived: float) -> float:
    """How long (s) before it ``arrived`` (epoch s, Redis clock) the task was sent: 0 when
    its message carries no ``throttle_sent`` header, or when the clocks disagree into the
    future."""
    if look.sent is None:
        return 0.0
    return min(max(arrived - look.sent, 0.0), HORIZON_S)
