"""Rates changed at run time, stored in Redis, followed by the whole fleet.

An operator lowers a limit during an incident (``RateBook.set("github", "1000/h")``); every
process re-reads the book at most every ``refresh_s`` seconds and uses the new rate from
then on, without a restart. The book is one Redis hash per namespace: limit name -> rate
spec. It holds operator decisions, so it has no TTL; :meth:`RateBook.clear` goes back to
the configured rate.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from throttle.redis.client import RedisClient, wrap_errors
from throttle.redis.keys import KeySpace
from throttle.spec import Limit

__all__ = ["RateBook", "RateBookBase"]


class RateBookBase:
    """The pure part of a rate book, shared by :class:`RateBook` and
    :class:`throttle.aio.RateBook`: the key, the cache and its refresh, reading the stored
    specs; the subclasses only send the commands (blocking or awaited)."""

    def __init__(
        self,
        keyspace: KeySpace,
        *,
        refresh_s: float = 2.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.key = keyspace.rates_key()
        self.refresh_s = refresh_s
        self._monotonic = monotonic
        self._cached: dict[str, str] = {}
        self._read_at = -float("inf")
        # Limits built from the book, by (configured limit, spec): built once per change.
        self._built: dict[tuple[Limit, str], Limit] = {}

    @staticmethod
    def _checked(limit: Limit, rate: str) -> Limit:
        """The limit ``rate`` makes of ``limit``; a bad rate raises ConfigError."""
        return Limit.parse(rate, name=limit.name, algorithm=limit.algorithm, source="rate")

    def _changed(self) -> None:
        """After a write: the next :meth:`current` reads the book afresh."""
        self._read_at = -float("inf")

    def _stale(self) -> float | None:
        """Now, when the cache is due for a re-read; None while it is fresh."""
        now = self._monotonic()
        return now if now - self._read_at >= self.refresh_s else None

    @staticmethod
    def _book(raw: dict[bytes, bytes]) -> dict[str, str]:
        """A reply of HGETALL on the book: limit name -> spec."""
        book = {}
        for name, spec in raw.items():
            try:
                book[name.decode()] = spec.decode()
            except UnicodeDecodeError:
                continue  # written by hand, not by set(): ignored like any bad rate
        return book

    def _read(self, raw: dict[bytes, bytes], now: float) -> None:
        """Cache a reply of HGETALL read at ``now``."""
        self._cached = self._book(raw)
        self._read_at = now

    def _resolve(self, limit: Limit) -> Limit:
        """``limit`` with the cached run-time rate, if one is stored.

        A stored rate that does not parse (written by hand) is ignored: the configured
        limit stays in force rather than failing every task.
        """
        spec = self._cached.get(limit.name)
        if spec is None:
            return limit
        built = self._built.get((limit, spec))
        if built is None:
            try:
                built = Limit.parse(
                    spec,
                    name=limit.name,
                    algorithm=limit.algorithm,
                    fair=limit.fair,
                    weights=dict(limit.weights),
                )
            except ValueError:  # ConfigError: a bad rate written by hand
                return limit
            self._built[(limit, spec)] = built
        return built


class RateBook(RateBookBase):
    """Run-time rates of the limits of one namespace, cached for ``refresh_s`` seconds."""

    def __init__(
        self,
        client: RedisClient,
        keyspace: KeySpace,
        *,
        refresh_s: float = 2.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(keyspace, refresh_s=refresh_s, monotonic=monotonic)
        self.client = client

    def set(self, limit: Limit, rate: str) -> Limit:
        """Store a new rate for ``limit`` (``"10/s"``, ``"1000/h burst 5"``); returns the limit
        the fleet will use. Validated first: a bad rate raises ConfigError, nothing stored."""
        changed = self._checked(limit, rate)
        wrap_errors(lambda: self.client.hset(self.key, limit.name, rate))
        self._changed()
        return changed

    def clear(self, name: str) -> None:
        """Go back to the configured rate of limit ``name``."""
        wrap_errors(lambda: self.client.hdel(self.key, name))
        self._changed()

    def overrides(self) -> dict[str, str]:
        """The stored rates (limit name -> spec), read afresh."""
        return self._book(wrap_errors(lambda: self.client.hgetall(self.key)))

    def current(self, limit: Limit) -> Limit:
        """``limit`` with its run-time rate, if one is stored (re-read every refresh_s).

        A stored rate that does not parse (written by hand) is ignored: the configured
        limit stays in force rather than failing every task.
        """
        now = self._stale()
        if now is not None:
            self._read(wrap_errors(lambda: self.client.hgetall(self.key)), now)
        return self._resolve(limit)
