"""``on_redis_down``: what a task that met an outage of the limiter's Redis does.

:func:`run_while_down` applies the rules' ``on_redis_down`` (:class:`throttle.rules.RedisDown`)
to a task whose limits Redis could not answer: ``allow`` runs it for a bounded time,
``local`` takes from per-process buckets (:mod:`throttle.fallback`) at the limit's rate
divided by the fleet's processes, and ``defer`` (the default) re-publishes it until Redis
may be back (:func:`throttle.celery.reschedule.defer_down`). What one process knows of
the outage (when it began, the fleet's size, the buckets) is the throttler's
:class:`throttle.celery.outage.OutageWatch`.
"""

from __future__ import annotations

import time

from throttle.celery.execution import Execution
from throttle.celery.reschedule import defer_down
from throttle.errors import BackendError
from throttle.rules import RedisDown, Rule, targets

BACKEND_RETRY_S = 5.0
"""How long a task deferred because Redis is unreachable waits before trying again, in s."""
LOCAL_SLACK_S = 0.01
"""What ``local`` adds to ``sleep_max`` for the rounding of a bucket's refill (s): a task
that slept for its tokens finds them on waking, not a hair short of them."""


def run_while_down(execution: Execution, exc: BackendError) -> None:
    """Redis failed: apply each rule's ``on_redis_down``, and return if the task may run
    (there is nothing in Redis to settle). All rules must let it run: ``allow`` within its
    bound, ``local`` when every local bucket admits; any other rule defers it (fail
    closed): re-published until Redis may be back (raises)."""
    throttler = execution.throttler
    watch = throttler.watch
    watch.note(exc)
    throttler.observer.redis_error(rule.name for rule in execution.rules)
    settings = execution.settings
    open_for = time.time() - watch.since()
    local: list[Rule] = []
    for rule in execution.rules:
        if rule.redis_down is RedisDown.LOCAL:
            local.append(rule)
        elif rule.redis_down is not RedisDown.ALLOW or open_for >= (
            settings.fail_open_for_s if rule.fail_open_s is None else rule.fail_open_s
        ):
            defer_down(execution, exc, BACKEND_RETRY_S)
    share = watch.share() if local else 1
    if share is None:
        defer_down(execution, exc, BACKEND_RETRY_S)  # cannot count the fleet
    # The configured rates (a rate changed at run time lives in the Redis that is down).
    wanted = targets(local, execution.fn, execution.args, execution.kwargs)
    # At most sleep_max in all, however many times the tokens are missed: in a threads or
    # gevent pool the process's buckets are shared, so another thread may take the tokens
    # this one slept for. Unbounded, such a task would sleep on past the outage's end and
    # call on a local token next to the calls Redis admits again.
    deadline = time.monotonic() + settings.sleep_max_s + LOCAL_SLACK_S
    while wanted:
        now = time.monotonic()
        wait = watch.local.take(wanted, share, now)
        if wait == 0.0:
            break
        if now + wait > deadline and not execution.eager:
            defer_down(execution, exc, wait)
        time.sleep(wait)
