"""The learned rates of adaptive limits (:class:`throttle.adaptive.LearnedRates`) on
``redis.asyncio``: the same script, keys, arguments and cache
(:class:`throttle.adaptive.LearnedRatesBase`), the calls awaited. A blocking and an
asyncio book on the same Redis and key space learn one rate."""

from __future__ import annotations

from typing import Any

import redis.asyncio
from redis.commands.core import AsyncScript

from throttle.adaptive import Adaptive, Learned, LearnedRatesBase, learned_limit
from throttle.redis.client import run_script_async
from throttle.redis.keys import KeySpace
from throttle.redis.scripts import operation_source
from throttle.spec import Limit

__all__ = ["LearnedRates"]


class LearnedRates(LearnedRatesBase):
    """The methods of :class:`throttle.adaptive.LearnedRates` that the upstream helpers
    use, awaited; the options are that class's."""

    def __init__(self, client: redis.asyncio.Redis, keyspace: KeySpace, **options: Any) -> None:
        super().__init__(keyspace, **options)
        self.client = client
        self._script: AsyncScript = client.register_script(operation_source("adapt"))

    async def _call(
        self, event: str, limit: Limit, key: str | None, adaptive: Adaptive | None,
        stated: float | None = None, **options: Any,
    ) -> Learned:  # fmt: skip
        keys, args = self._request(event, limit, key, adaptive, stated, **options)
        raw = await run_script_async(self.client, self._script, keys, args)
        return self._remember(limit, key, adaptive, raw)

    async def refused(
        self,
        limit: Limit,
        key: str | None,
        adaptive: Adaptive | None,
        *,
        rate_per_s: float | None = None,
        reserved_s: float = 0.0,
    ) -> Learned:
        """:meth:`throttle.adaptive.LearnedRates.refused`, awaited."""
        options = self._refusal(limit, rate_per_s, reserved_s)
        return await self._call("refuse", limit, key, adaptive, **options)

    async def succeeded(self, limit: Limit, key: str | None, adaptive: Adaptive) -> Learned:
        """:meth:`throttle.adaptive.LearnedRates.succeeded`, awaited."""
        idle = self._idle_success(limit, key)
        return idle if idle is not None else await self._call("success", limit, key, adaptive)

    async def stated(
        self, limit: Limit, key: str | None, adaptive: Adaptive, rate_per_s: float
    ) -> Learned:
        """:meth:`throttle.adaptive.LearnedRates.stated`, awaited."""
        return await self._call("state", limit, key, adaptive, rate_per_s)

    async def read(self, limit: Limit, key: str | None, adaptive: Adaptive) -> Learned:
        """:meth:`throttle.adaptive.LearnedRates.read`, awaited."""
        return await self._call("read", limit, key, adaptive)

    async def current(self, limit: Limit, key: str | None, adaptive: Adaptive) -> Limit:
        """``limit`` at its learned rate (re-read every ``refresh_s``): the limit to
        acquire."""
        rate = self._cached(limit, key, adaptive)
        if rate is None:
            rate = (await self.read(limit, key, adaptive)).rate_per_s
        return learned_limit(limit, rate)
