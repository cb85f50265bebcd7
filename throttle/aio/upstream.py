"""The upstream's word, for asyncio code: :func:`throttle.upstream.apply_upstream` awaited,
and a response hook for ``httpx.AsyncClient``.

The response is read by the same parser (:func:`throttle.upstream.parse_upstream`) and what
it asks of the limits is planned by the same function as the blocking helpers'; only the
Redis calls are awaited: a hold of the limit (of its key, when given) for the upstream's
time, and with a rate book, the limit's run-time rate lowered to the upstream's stated
policy when that is slower.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from throttle.adaptive import Adaptive
from throttle.aio.adaptive import LearnedRates
from throttle.aio.limiter import Limiter
from throttle.aio.rates import RateBook
from throttle.aio.refusals import RefusalBook
from throttle.errors import Throttled
from throttle.spec import Limit
from throttle.upstream.headers import DEFAULT_HOLD_S, UpstreamSignal, read_response, wants_body
from throttle.upstream.policy import (
    Target,
    expect_dimension,
    expect_limit,
    judge,
    log_follow,
    log_hold,
    log_rate,
    plan,
    refusal_entry,
    stated_for,
    wants_reserved,
)

__all__ = ["apply_upstream", "upstream_hook"]

logger = logging.getLogger("throttle")


async def _answer(
    limiter: Limiter, learned: LearnedRates, signal: UpstreamSignal, target: Target
) -> bool:
    reserved_s = 0.0
    if wants_reserved(target):
        reserved_s = (await limiter.peek(target.current, target.key)).reset_after_s
    answer = await learned.refused(
        target.ceiling or target.configured, target.key, target.adaptive,
        rate_per_s=target.current.rate_per_s, reserved_s=reserved_s,
    )  # fmt: skip
    return judge(signal, target, answer)


async def _learn(learned: LearnedRates, signal: UpstreamSignal | None, target: Target) -> None:
    if target.adaptive is None:
        return
    ceiling = target.ceiling or target.configured
    stated = stated_for(signal, target)
    if stated is not None:
        await learned.stated(ceiling, target.key, target.adaptive, stated)
    else:
        await learned.succeeded(ceiling, target.key, target.adaptive)


async def _apply(
    limiter: Limiter,
    rates: RateBook | None,
    signal: UpstreamSignal,
    targets: Sequence[Target],
    learned: LearnedRates | None = None,
) -> bool:
    """:func:`throttle.upstream.policy.apply_signal`, awaited: whether it held any target."""
    held = False
    for step in plan(signal, targets, rates):
        target, seen = step.target, step.signal
        hold = seen.hold_s > 0
        if learned is not None:
            if seen.refused:
                hold = await _answer(limiter, learned, seen, target) and hold
            else:
                await _learn(learned, seen, target)
        if hold:
            await limiter.hold(target.current.name, target.key, seen.hold_s)
            log_hold(seen, target)
            held = True
        if rates is not None and step.lowered is not None:
            await rates.set(target.configured, step.lowered)
            log_rate(seen, target, step.lowered)
        if rates is not None and step.follow:
            await rates.follow(target.configured, step.followed)
            log_follow(seen, target, step.followed)
    return held


async def apply_upstream(
    limiter: Limiter,
    response: Any,
    limit: Limit,
    key: str | None = None,
    *,
    rates: RateBook | None = None,
    learned: LearnedRates | None = None,
    adaptive: Adaptive | None = None,
    dimension: str | None = None,
    cost: float = 1.0,
    now: float | None = None,
    refusals: RefusalBook | None = None,
) -> UpstreamSignal | None:
    """Hold ``limit`` (of ``key`` only, when given) for the upstream's time, and with
    ``rates``, lower its run-time rate to the upstream's stated one when slower: what
    :func:`throttle.upstream.apply_upstream` does, awaited. With ``learned``
    (:class:`throttle.aio.LearnedRates`), a refusal is answered in proportion, and with
    ``adaptive`` the limit learns its rate (``await learned.current(limit, key,
    adaptive)`` is then the limit to acquire).

    ``response`` is an ``httpx.Response`` (anything with ``status_code`` and ``headers``);
    ``limit`` the configured limit; ``dimension`` and ``cost`` as for
    :func:`throttle.upstream.apply_upstream`. Returns what the response said (None:
    nothing). Raises :class:`~throttle.BackendError` when Redis fails.

    ``refusals`` (a :class:`throttle.aio.RefusalBook`): a refusal is kept in the fleet's
    record of refusals too (``celery throttle refusals``), without a task id, one more
    round trip per refusal.
    """
    expect_limit(limit)
    dimension = expect_dimension(dimension)
    ceiling = limit if rates is None else await rates.current(limit)
    current = ceiling
    if learned is not None and adaptive is not None:
        current = await learned.current(ceiling, key, adaptive)
    # Learning needs the book: without one, the limit is answered as a plain one (its
    # run-time rate lowered to a slower stated policy, which plan() leaves to learning).
    learning = adaptive if learned is not None else None
    target = Target(current, limit, key, True, learning, ceiling, dimension, cost)
    if wants_body(response):  # a GitHub 403: its message tells a secondary limit
        await _read_body(response)
    signal = read_response(response, now=now)
    if signal is None:
        if learned is not None:
            await _learn(learned, None, target)
        return None
    held = await _apply(limiter, rates, signal, [target], learned)
    if refusals is not None and signal.refused:
        await refusals.record([refusal_entry(response, signal, limit, key, held)])
    return signal


async def _read_body(response: Any) -> None:
    """Read an async response's body, so that :func:`read_response` can look at it."""
    try:
        if getattr(response, "is_stream_consumed", True) is False:
            await response.aread()
    except Exception as exc:  # best effort: unread, the 403 reads as a plain one
        logger.debug("throttle: could not read an upstream response: %s", exc)


async def _release(response: Any) -> None:
    """Read a refused response's (short) body and close it, so that its connection goes
    back to the pool before :class:`Throttled` leaves the request (see
    :func:`throttle.celery.upstream.report_upstream`)."""
    try:
        if getattr(response, "is_stream_consumed", True) is False:
            await response.aread()
        close = getattr(response, "aclose", None)
        if callable(close):
            await close()
    except Exception as exc:  # best effort
        logger.debug("throttle: could not release an upstream response: %s", exc)


def upstream_hook(
    limiter: Limiter,
    limit: Limit,
    key: str | None = None,
    *,
    rates: RateBook | None = None,
    learned: LearnedRates | None = None,
    adaptive: Adaptive | None = None,
    dimension: str | None = None,
    retry: bool = False,
    refusals: RefusalBook | None = None,
) -> Callable[[Any], Coroutine[Any, Any, None]]:
    """An async response hook that calls :func:`apply_upstream` on every response::

        hook = upstream_hook(limiter, github, rates=RateBook(redis_client, limiter.keyspace))
        httpx.AsyncClient(event_hooks={"response": [hook]})

    Every process that shares the limiter's Redis (asyncio code, blocking code, Celery
    workers) then holds ``limit`` (of ``key`` only, when given) after the upstream's 429
    or spent quota, and follows a slower stated policy. With ``learned``, a refusal is
    answered in proportion (a hold only when refusals persist, the quota is spent or the
    limit is faster than the stated policy), and with ``adaptive`` the limit learns its
    rate: acquire ``await learned.current(limit, key, adaptive)`` then. With
    ``dimension`` (``"tokens"``...), the limit follows that dimension of the provider's
    headers only (:func:`throttle.upstream.apply_upstream`). With ``refusals`` (a
    :class:`throttle.aio.RefusalBook`), every refusal is kept in the fleet's record
    (``celery throttle refusals``).

    With ``retry=True`` a refused call (429; 403 or 503 with ``Retry-After`` or a spent
    quota) raises :class:`~throttle.Throttled` with the hold as ``retry_after_s`` (and the
    limit's name as ``denied_by``), out of
    the ``await client.get(...)``, after the hold is placed (the response is read and
    closed first): catch it to come back later. ``Stripe-Should-Retry`` decides over the
    status: ``false`` raises :class:`~throttle.UpstreamFinal` (do not call again),
    ``true`` on any error raises :class:`~throttle.Throttled` (of
    :data:`~throttle.upstream.DEFAULT_HOLD_S` when it is no refusal). Without
    ``retry``, the response is returned as usual. Redis errors propagate
    (:class:`~throttle.BackendError`): unlike the Celery hook, nothing here decides for
    the caller what an outage means.
    """
    expect_limit(limit)  # now, not on the first response
    expect_dimension(dimension)

    async def hook(response: Any) -> None:
        signal = await apply_upstream(
            limiter, response, limit, key, rates=rates, learned=learned, adaptive=adaptive,
            dimension=dimension, refusals=refusals,
        )  # fmt: skip
        if retry and signal is not None and signal.final:
            await _release(response)
            raise signal.final_error(getattr(response, "status_code", None))
        if retry and signal is not None and signal.comes_back:
            await _release(response)
            hold_s = signal.hold_s if signal.refused else DEFAULT_HOLD_S
            raise Throttled(hold_s, [limit.name])

    return hook
