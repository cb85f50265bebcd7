"""The rate book (:class:`throttle.rates.RateBook`) on ``redis.asyncio``: the same hash,
the same cache and parsing (:class:`throttle.rates.RateBookBase`), the commands awaited."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, cast

import redis.asyncio

from throttle.errors import BackendError
from throttle.rates import RATES_CHANGED, RateBookBase
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

        async def write() -> None:
            async with self.client.pipeline(transaction=False) as pipe:
                pipe.hset(self.key, limit.name, rate)
                pipe.hdel(self.followed_key, limit.name)
                await pipe.execute()
            await self._announce(limit.name)

        await wrap_errors_async(write)
        self._changed()
        return changed

    async def clear(self, name: str) -> None:
        """Go back to the configured rate of limit ``name``
        (:meth:`throttle.rates.RateBook.clear`)."""

        async def write() -> None:
            async with self.client.pipeline(transaction=False) as pipe:
                pipe.hdel(self.key, name)
                pipe.hdel(self.followed_key, name)
                await pipe.execute()
            await self._announce(name)

        await wrap_errors_async(write)
        self._changed()

    async def set_key(self, limit: Limit, key: str, rate: str) -> Limit:
        """Store a rate for ``key`` of ``limit`` alone
        (:meth:`throttle.rates.RateBook.set_key`)."""
        changed = self._checked_key(limit, key, rate)
        field, long_key = self._key_field(limit.name, key)

        async def write() -> None:
            async with self.client.pipeline(transaction=False) as pipe:
                pipe.hset(self.key_rates_key, field, rate)
                if long_key is not None:
                    pipe.hset(self.key_names_key, field, long_key)
                await pipe.execute()
            await self._announce(limit.name)

        await wrap_errors_async(write)
        self._changed()
        return changed

    async def clear_key(self, name: str, key: str) -> bool:
        """Drop the rate stored for ``key`` of limit ``name``
        (:meth:`throttle.rates.RateBook.clear_key`)."""
        field = self._key_field(name, key)[0]

        async def write() -> int:
            async with self.client.pipeline(transaction=False) as pipe:
                pipe.hdel(self.key_rates_key, field)
                pipe.hdel(self.key_names_key, field)
                removed = int((await pipe.execute())[0])
            await self._announce(name)
            return removed

        removed = await wrap_errors_async(write)
        self._changed()
        return bool(removed)

    async def _announce(self, name: str) -> None:
        """Announce a rate set for limit ``name`` on the capacity channel, as the blocking
        book does: the tasks waiting for it in the Celery workers' lines look again now (a
        raised rate is capacity), not at the time the old rate named. Not in the
        pipeline: a Redis Cluster pipeline refuses PUBLISH."""
        await self.client.publish(self.channel, f"{RATES_CHANGED} {name}")

    async def key_overrides(self) -> dict[tuple[str, str | None], str]:
        """The rates stored for single keys, read afresh: (limit name, key) -> spec."""
        keyed = (await self._fetch())[2]
        names = None
        if keyed:
            found = await wrap_errors_async(lambda: self.client.hgetall(self.key_names_key))
            names = cast("dict[bytes, bytes]", found)
        return self._key_book(keyed, names)

    async def follow(self, limit: Limit, rate: str | None) -> None:
        """Store the rate the upstream states for ``limit``
        (:meth:`throttle.rates.RateBook.follow`)."""
        if rate is None:
            await wrap_errors_async(lambda: self.client.hdel(self.followed_key, limit.name))
        else:
            self._checked(limit, rate)
            await wrap_errors_async(lambda: self.client.hset(self.followed_key, limit.name, rate))
        await wrap_errors_async(lambda: self._announce(limit.name))
        self._changed()

    async def overrides(self) -> dict[str, str]:
        """The stored rates in force (limit name -> spec), read afresh."""
        return self._merged(*(await self._fetch())[:2])

    async def followed_rates(self) -> dict[str, str]:
        """The rates the upstream states for the limits that follow it, read afresh."""
        return self._book((await self._fetch())[1])

    async def current(self, limit: Limit, key: str | None = None) -> Limit:
        """``limit`` with its run-time rate, if one is stored (re-read every refresh_s):
        ``key``'s own when given and stored, else the limit's."""
        now = self._stale()
        if now is not None:
            try:
                self._read(*await self._fetch(), now)
            except BackendError:  # try again refresh_s later, not on every call
                self._read_at = now
                raise
        return self._resolve_key(limit, key)

    async def _fetch(
        self,
    ) -> tuple[dict[bytes, bytes], dict[bytes, bytes], dict[bytes, bytes], dict[bytes, bytes]]:
        async def read() -> list[Any]:
            async with self.client.pipeline(transaction=False) as pipe:
                pipe.hgetall(self.key)
                pipe.hgetall(self.followed_key)
                pipe.hgetall(self.key_rates_key)
                pipe.hgetall(self.modes_key)
                return list(await pipe.execute())

        raw, followed, keyed, modes = await wrap_errors_async(read)
        return (
            cast("dict[bytes, bytes]", raw),
            cast("dict[bytes, bytes]", followed),
            cast("dict[bytes, bytes]", keyed),
            cast("dict[bytes, bytes]", modes),
        )
