"""The upstream's word, for asyncio code: :func:`throttle.upstream.apply_upstream` awaited,
and a response hook for ``httpx.AsyncClient``.

The response is read by the same parser (:func:`throttle.upstream.parse_upstream`) and what
it asks of the limits is planned by the same function as the blocking helpers'; only the
Redis calls are awaited: a hold of the limit (of its key, when given) for the upstream's
time, and with a rate book, the limit's run-time rate lowered to the upstream's stated
policy when that is slower.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from throttle.aio.limiter import Limiter
from throttle.aio.rates import RateBook
from throttle.errors import Throttled
from throttle.spec import Limit
from throttle.upstream import (
    UpstreamSignal,
    _expect_limit,
    _log_hold,
    _log_rate,
    _plan,
    _read_for,
    _Target,
    logger,
)

__all__ = ["apply_upstream", "upstream_hook"]


async def _apply(
    limiter: Limiter, rates: RateBook | None, signal: UpstreamSignal, targets: Sequence[_Target]
) -> None:
    for target, spec in _plan(signal, targets, rates is not None):
        if signal.hold_s > 0:
            await limiter.hold(target.current.name, target.key, signal.hold_s)
            _log_hold(signal, target)
        if rates is not None and spec is not None:
            await rates.set(target.configured, spec)
            _log_rate(signal, target, spec)


async def apply_upstream(
    limiter: Limiter,
    response: Any,
    limit: Limit,
    key: str | None = None,
    *,
    rates: RateBook | None = None,
    now: float | None = None,
) -> UpstreamSignal | None:
    """Hold ``limit`` (of ``key`` only, when given) for the upstream's time, and with
    ``rates``, lower its run-time rate to the upstream's stated one when slower: what
    :func:`throttle.upstream.apply_upstream` does, awaited.

    ``response`` is an ``httpx.Response`` (anything with ``status_code`` and ``headers``);
    ``limit`` the configured limit. Returns what the response said (None: nothing). Raises
    :class:`~throttle.BackendError` when Redis fails.
    """
    signal = _read_for(limit, response, now)
    if signal is None:
        return None
    current = limit if rates is None else await rates.current(limit)
    await _apply(limiter, rates, signal, [_Target(current, limit, key, True)])
    return signal


async def _release(response: Any) -> None:
    """Read a refused response's (short) body and close it, so that its connection goes
    back to the pool before :class:`Throttled` leaves the request (see
    :func:`throttle.upstream._release`)."""
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
    retry: bool = False,
) -> Callable[[Any], Coroutine[Any, Any, None]]:
    """An async response hook that calls :func:`apply_upstream` on every response::

        hook = upstream_hook(limiter, github, rates=RateBook(redis_client, limiter.keyspace))
        httpx.AsyncClient(event_hooks={"response": [hook]})

    Every process that shares the limiter's Redis (asyncio code, blocking code, Celery
    workers) then holds ``limit`` (of ``key`` only, when given) after the upstream's 429
    or spent quota, and follows a slower stated policy.

    With ``retry=True`` a refused call (429; 403 or 503 with ``Retry-After`` or a spent
    quota) raises :class:`~throttle.Throttled` with the hold as ``retry_after_s`` (and the
    limit's name as ``denied_by``), out of
    the ``await client.get(...)``, after the hold is placed (the response is read and
    closed first): catch it to come back later. Without it, the response is returned as
    usual. Redis errors propagate (:class:`~throttle.BackendError`): unlike the Celery
    hook, nothing here decides for the caller what an outage means.
    """
    _expect_limit(limit)  # now, not on the first response

    async def hook(response: Any) -> None:
        signal = await apply_upstream(limiter, response, limit, key, rates=rates)
        if retry and signal is not None and signal.refused:
            await _release(response)
            raise Throttled(signal.hold_s, [limit.name])

    return hook
