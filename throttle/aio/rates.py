"""The rate book (:class:`throttle.rates.RateBook`) on ``redis.asyncio``: the same hash,
the same cache and parsing (:class:`throttle.rates.RateBookBase`), the commands awaited."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import cast

import redis.asyncio

from throttle.rates import RateBookBase
from throttle.redis.client import wrap_errors_async
from throttle.redis.keys import KeySpace
from throttle.spec import Limit

__all__ = ["RateBook"]


class RateBook(RateBookBase):
    """Run-time rates of the limits of one namespace, cached for ``refresh_s`` seconds: the
    methods of :class:`throttle.rates.RateBook`, awaited. Both books read and write the same
    Redis hash: a rate set by one is followed by the other (and by the Celery workers)."""

    def __init__(
        self,
        client: redis.asyncio.Redis,
        keyspace: KeySpace,
        *,
        refresh_s: float = 2.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(keyspace, refresh_s=refresh_s, monotonic=monotonic)
        self.client = client

    async def set(self, limit: Limit, rate: str) -> Limit:
        """Store a new rate for ``limit``: :meth:`throttle.rates.RateBook.set`."""
        changed = self._checked(limit, rate)
        await wrap_errors_async(lambda: self.client.hset(self.key, limit.name, rate))
        self._changed()
        return changed

    async def clear(self, name: str) -> None:
        """Go back to the configured rate of limit ``name``."""
        await wrap_errors_async(lambda: self.client.hdel(self.key, name))
        self._changed()

    async def overrides(self) -> dict[str, str]:
        """The stored rates (limit name -> spec), read afresh."""
        return self._book(await self._hgetall())

    async def current(self, limit: Limit) -> Limit:
        """``limit`` with its run-time rate, if one is stored (re-read every refresh_s)."""
        now = self._stale()
        if now is not None:
            self._read(await self._hgetall(), now)
        return self._resolve(limit)

    async def _hgetall(self) -> dict[bytes, bytes]:
        raw = await wrap_errors_async(lambda: self.client.hgetall(self.key))
        return cast("dict[bytes, bytes]", raw)
