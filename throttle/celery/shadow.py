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
deferral yet), so each task counts once. One more round trip per task, only for tasks that
have a limit in shadow. Switching a limit to ``enforce`` at run time (``celery throttle
enforce``) makes its real state take over from then on; the twin's is left to expire.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Sequence

from throttle.celery.execution import Execution
from throttle.celery.message import H_DEFERRALS, sent_header
from throttle.errors import BackendError
from throttle.rules import Rule, kept_in_hand, targets
from throttle.spec import SHADOW_SUFFIX, Limit

logger = logging.getLogger("throttle")

HORIZON_S = 3600.0
"""How far ahead a twin reserves: a wait the limit would impose beyond it counts as this."""


@functools.lru_cache(maxsize=1024)
def shadow_limit(limit: Limit) -> Limit:
    """The shadow twin of ``limit``: its algorithm and numbers, its own state."""
    return dataclasses.replace(limit, name=limit.name + SHADOW_SUFFIX)


def look(execution: Execution, rules: Sequence[Rule]) -> None:
    """What the limits of ``rules`` (in shadow mode) would have done to this execution:
    the wait each would impose, reported to the throttler's observers. Never raises for
    Redis, never delays the task (an error loses the look, logged)."""
    if H_DEFERRALS in execution.message_headers or execution.eager:
        return  # looked at when it first arrived (eager mode: no fleet to shadow)
    throttler = execution.throttler
    try:
        found = targets(
            rules, execution.fn, execution.args, execution.kwargs, throttler.rates.current
        )
        found = kept_in_hand(found, throttler.settings.burst_margin_s)  # as enforced
        waits: list[float] = []
        queued_s = _queued_s(execution)
        for limit, key, cost in found:
            twin = shadow_limit(limit)
            decision = throttler.limiter.acquire_many(
                [(twin, key, min(cost, twin.capacity))], max_wait_s=HORIZON_S
            )
            wait = decision.wait_s if decision.allowed else decision.retry_after_s
            if wait > 0:  # its slot is ahead: it would have waited for it since the send
                wait += queued_s
            waits.append(min(max(wait, 0.0), HORIZON_S))
    except BackendError as exc:
        logger.debug("throttle: shadow look of task %s failed: %s", execution.request.id, exc)
        return
    except Exception as exc:  # a bad key or cost for this task: it would fail enforced
        logger.warning("throttle: shadow look of task %s: %s", execution.request.id, exc)
        return
    throttler.observer.shadowed(execution, [rule.name for rule in rules], waits)


def _queued_s(execution: Execution) -> float:
    """How long ago (s) the task was sent: its ``throttle_sent`` header against now, both
    on the Redis clock (0 when it has none, or when the clocks disagree into the future)."""
    sent = sent_header(execution.message_headers)
    if sent is None:
        return 0.0
    return min(max(execution.throttler.clock.now() - sent, 0.0), HORIZON_S)
