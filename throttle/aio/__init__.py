"""asyncio twins of the limiter, the rate book and the upstream helpers, on ``redis.asyncio``.

For code that calls APIs with ``httpx.AsyncClient`` (or any asyncio client) outside Celery:

- :class:`Limiter`: :class:`throttle.Limiter`'s methods, awaited; the same scripts, keys,
  checks and :class:`~throttle.Decision` (both build their calls with
  :class:`throttle.limiter.RequestBuilder`).
- :class:`RateBook`: :class:`throttle.rates.RateBook`, awaited (the same Redis hash).
- :class:`LearnedRates`: :class:`throttle.adaptive.LearnedRates`, awaited (the same
  learned states).
- :func:`apply_upstream` and :func:`upstream_hook`: the upstream's 429 and RateLimit
  headers applied to the limits (holds, lowered rates), as
  :func:`throttle.upstream.apply_upstream` does; the hook for
  ``httpx.AsyncClient(event_hooks={"response": [hook]})``.
- :class:`RefusalBook`: :class:`throttle.refusals.RefusalBook`, awaited (the same capped
  streams): pass it to :func:`apply_upstream` or :func:`upstream_hook` as ``refusals=``.

A blocking and an asyncio limiter on the same Redis, prefix and namespace share their
limits, holds and rates. See ``docs/asyncio.md``.
"""

from throttle.aio.adaptive import LearnedRates
from throttle.aio.limiter import Limiter
from throttle.aio.rates import RateBook
from throttle.aio.refusals import RefusalBook
from throttle.aio.upstream import apply_upstream, upstream_hook

__all__ = [
    "LearnedRates",
    "Limiter",
    "RateBook",
    "RefusalBook",
    "apply_upstream",
    "upstream_hook",
]
