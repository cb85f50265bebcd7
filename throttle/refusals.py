"""The record of refusals: every refusal the upstream reported, kept fleet-wide and bounded.

"Why did tenant X get 429s at 14:02?" Each refusal a throttled task reports
(:func:`throttle.upstream.report_upstream`, the upstream hook) is appended to a Redis
STREAM per limit (:meth:`throttle.redis.keys.KeySpace.refusals_key`): when (the entry's id,
on the Redis clock, ms), the key, the task, the HTTP status, the header that decided the
hold and the hold. The stream is capped as it grows: the last ``settings.refusals_max``
entries per limit (``XADD MAXLEN``, exact: refusals are rare, and an approximate cap
keeps at least a whole node of 100 entries), and, with ``settings.refusals_for``, none
older than that (``XTRIM MINID`` when the next refusal of the limit is recorded, Redis
6.2 or newer; a read skips the older ones left until then). One round trip per
refusal, from the worker that saw it; a Redis error loses the entry (logged), never the
task. A refusal is recorded under each limit it speaks for, and ``held`` says whether it
held that limit (or its key) for the fleet, or not (the task came back alone, or the
refusal blamed another of the call's limits: the dimension its headers named). Read it
with ``celery throttle refusals LIMIT`` or :meth:`RefusalBook.read`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from throttle.redis.client import RedisClient, wrap_errors
from throttle.redis.keys import KeySpace

__all__ = ["DEFAULT_REFUSALS_MAX", "Refusal", "RefusalBook", "RefusalBookBase"]

DEFAULT_REFUSALS_MAX = 1000
"""Refusals kept per limit unless ``settings.refusals_max`` says otherwise."""


@dataclass(frozen=True)
class Refusal:
    """One refusal the upstream reported for one limit (and key) of one task."""

    limit: str
    key: str | None
    task_id: str | None
    task: str | None
    """The task's name."""
    status: int | None
    """The HTTP status of the refusal (429, 403, 503...), None when the response had none."""
    header: str
    """The header the hold came from (``Retry-After``, ``X-RateLimit-Reset``...),
    ``default`` for a bare 429, ``""`` when the response named no time."""
    hold_s: float
    """The upstream's time, in s: how long it asked to wait (for this limit: the hold
    placed on it, which a dimension's own reset header may make differ from the other
    limits')."""
    held: bool
    """Whether the refusal held this limit (or its key) for the fleet; False: it did not
    (a refusal the limit's schedule explains, jitter, sends only the refused task back;
    a refusal whose headers blame another dimension holds that dimension's limit)."""
    at: float | None = None
    """When it was recorded, epoch s on the Redis clock (set when read back)."""

    def fields(self) -> dict[str, str]:
        """The entry's fields in the stream (absent: None)."""
        found = {
            "limit": self.limit, "header": self.header, "hold_s": repr(self.hold_s),
            "held": "1" if self.held else "0",
        }  # fmt: skip
        for name in ("key", "task_id", "task", "status"):
            value = getattr(self, name)
            if value is not None:
                found[name] = str(value)
        return found

    @classmethod
    def of_entry(cls, entry_id: bytes, fields: dict[bytes, bytes]) -> Refusal:
        """An entry of the stream as a Refusal (a field missing or malformed, as written
        by hand, reads as unknown)."""
        text = {k.decode(errors="replace"): v.decode(errors="replace") for k, v in fields.items()}
        try:
            at = int(entry_id.split(b"-")[0]) / 1000
        except ValueError:
            at = None
        status = text.get("status")
        try:
            hold_s = float(text.get("hold_s", "0"))
        except ValueError:
            hold_s = 0.0
        return cls(
            limit=text.get("limit", ""),
            key=text.get("key"),
            task_id=text.get("task_id"),
            task=text.get("task"),
            status=int(status) if status is not None and status.isdigit() else None,
            header=text.get("header", ""),
            hold_s=hold_s,
            held=text.get("held") == "1",
            at=at,
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "at": self.at, "limit": self.limit, "key": self.key, "task_id": self.task_id,
            "task": self.task, "status": self.status, "header": self.header,
            "hold_s": self.hold_s, "held": self.held,
        }  # fmt: skip


class RefusalBookBase:
    """What the blocking and the asyncio books share: the streams, the caps, and how a
    page of a stream is read (:class:`RefusalBook`, :class:`throttle.aio.RefusalBook`).

    Parameters
    ----------
    max_entries:
        Refusals kept per limit (exactly: ``MAXLEN``).
    keep_s:
        Refusals older than this (s) are trimmed when the next one is recorded, and never
        read (None: kept until ``max_entries`` pushes them out). Needs Redis 6.2 (``XTRIM
        MINID``).
    clock:
        Now in epoch s on the Redis clock (:meth:`throttle.redis.clock.RedisClock.now`),
        for the age bound.
    """

    def __init__(
        self,
        keyspace: KeySpace,
        *,
        max_entries: int = DEFAULT_REFUSALS_MAX,
        keep_s: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.keyspace = keyspace
        self.max_entries = max_entries
        self.keep_s = keep_s
        self.clock = clock

    def _queue(self, pipe: Any, refusals: Sequence[Refusal]) -> None:
        """Queue on ``pipe`` (blocking or asyncio) the commands that append ``refusals``
        and trim each stream."""
        oldest_ms = self._oldest_ms()
        for refusal in refusals:
            stream = self.keyspace.refusals_key(refusal.limit)
            fields: dict[Any, Any] = refusal.fields()
            pipe.xadd(stream, fields, maxlen=self.max_entries, approximate=False)
            if oldest_ms is not None:
                # exact: the few entries that aged out since the last refusal
                pipe.xtrim(stream, minid=f"{oldest_ms}-0", approximate=False)

    def _oldest_ms(self) -> int | None:
        """The id time (ms, Redis clock) of the oldest entry kept by ``keep_s``, or None."""
        if self.keep_s is None:
            return None
        oldest_ms = int((self.clock() - self.keep_s) * 1000)
        return oldest_ms if oldest_ms > 0 else None

    def _oldest_id(self) -> str:
        """The smallest stream id a read returns: ``-`` (any), or the ``keep_s`` bound."""
        oldest_ms = self._oldest_ms()
        return "-" if oldest_ms is None else f"{oldest_ms}-0"

    @staticmethod
    def _select(
        page: Sequence[tuple[bytes, dict[bytes, bytes]]], key: str | None, count: int
    ) -> list[Refusal]:
        """The first ``count`` entries of ``page`` (of ``key`` only, when given)."""
        found: list[Refusal] = []
        for entry_id, fields in page:
            refusal = Refusal.of_entry(entry_id, fields)
            if key is None or refusal.key == key:
                found.append(refusal)
                if len(found) == count:
                    break
        return found


class RefusalBook(RefusalBookBase):
    """The capped streams of refusals of one namespace (parameters: :class:`RefusalBookBase`)."""

    def __init__(
        self,
        client: RedisClient,
        keyspace: KeySpace,
        *,
        max_entries: int = DEFAULT_REFUSALS_MAX,
        keep_s: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(keyspace, max_entries=max_entries, keep_s=keep_s, clock=clock)
        self.client = client

    def record(self, refusals: Sequence[Refusal]) -> None:
        """Append ``refusals`` (one per limit of the refused call), trimming each stream,
        in one round trip."""
        if not refusals:
            return

        def write() -> None:
            with self.client.pipeline(transaction=False) as pipe:
                self._queue(pipe, refusals)
                pipe.execute()

        wrap_errors(write)

    def read(self, limit: str, *, key: str | None = None, count: int = 100) -> list[Refusal]:
        """The last ``count`` refusals of ``limit`` (of its ``key`` only, when given),
        newest first."""
        stream = self.keyspace.refusals_key(limit)
        # The whole stream, newest first: it is capped (max_entries, a few kB each 100),
        # and a key filter may skip most of it.
        page = wrap_errors(lambda: self.client.xrevrange(stream, "+", self._oldest_id()))
        return self._select(page, key, count)
