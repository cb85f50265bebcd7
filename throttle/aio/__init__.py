"""asyncio twins of the limiter and the upstream helpers, on ``redis.asyncio``.

For code that calls APIs with ``httpx.AsyncClient`` (or any asyncio client) outside Celery:

- :class:`Limiter`: :class:`throttle.Limiter`'s methods, awaited; the same scripts, keys,
  checks and :class:`~throttle.Decision` (both build their calls with
  :class:`throttle.limiter.RequestBuilder`).
"""

from throttle.aio.limiter import Limiter

__all__ = ["Limiter"]
