"""The record of refusals (:mod:`throttle.refusals`) on ``redis.asyncio``: the same capped
streams, the same entries and caps (:class:`throttle.refusals.RefusalBookBase`), the
commands awaited."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import cast

import redis.asyncio

from throttle.redis.client import wrap_errors_async
from throttle.redis.keys import KeySpace
from throttle.refusals import DEFAULT_REFUSALS_MAX, Refusal, RefusalBookBase

__all__ = ["RefusalBook"]


class RefusalBook(RefusalBookBase):
    """The capped streams of refusals of one namespace: the methods of
    :class:`throttle.refusals.RefusalBook`, awaited. Both books write and read the same
    streams: ``celery throttle refusals`` shows what asyncio code recorded."""

    def __init__(
        self,
        client: redis.asyncio.Redis,
        keyspace: KeySpace,
        *,
        max_entries: int = DEFAULT_REFUSALS_MAX,
        keep_s: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(keyspace, max_entries=max_entries, keep_s=keep_s, clock=clock)
        self.client = client

    async def record(self, refusals: Sequence[Refusal]) -> None:
        """Append ``refusals``, trimming each stream, in one round trip
        (:meth:`throttle.refusals.RefusalBook.record`)."""
        if not refusals:
            return

        async def write() -> None:
            async with self.client.pipeline(transaction=False) as pipe:
                self._queue(pipe, refusals)
                await pipe.execute()

        await wrap_errors_async(write)

    async def read(self, limit: str, *, key: str | None = None, count: int = 100) -> list[Refusal]:
        """The last ``count`` refusals of ``limit`` (of its ``key`` only, when given),
        newest first (:meth:`throttle.refusals.RefusalBook.read`)."""
        stream = self.keyspace.refusals_key(limit)
        oldest = self._oldest_id()
        page = await wrap_errors_async(lambda: self.client.xrevrange(stream, "+", oldest))
        # a client without decode_responses (as the limiter's): ids and fields are bytes
        return self._select(cast("list[tuple[bytes, dict[bytes, bytes]]]", page), key, count)
