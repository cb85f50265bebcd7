"""Rates changed at run time, stored in Redis, followed by the whole fleet.

An operator lowers a limit during an incident (``RateBook.set("github", "1000/h")``); every
process re-reads the book at most every ``refresh_s`` seconds and uses the new rate from
then on, without a restart. The book is one Redis hash per namespace: limit name -> rate
spec. It holds operator decisions, so it has no TTL; :meth:`RateBook.clear` goes back to
the configured rate.

A second hash holds the rates the upstream states for limits that follow one of its
dimensions (``upstream: tokens``, :meth:`RateBook.follow`): they go down and back up
with the upstream's word, never above the operator's (or the configured) rate, and never
touch the operator's hash. The rate in force is the lower of the two. An operator's
:meth:`RateBook.set` or :meth:`RateBook.clear` drops the upstream's rate of that limit
too: the operator's word is the last.

A third hash holds the operator's rates for single keys of a keyed limit
(:meth:`RateBook.set_key`, ``celery throttle set LIMIT RATE --key KEY``): a negotiated
exception for one tenant. It beats the limit's plan and the rate set for the whole limit
(the upstream's stated rate still wins when slower). A key's rate without ``burst`` is at
most as bursty as the limit it replaces for that key (its plan's, or the limit's own):
the burst is the smaller of its count and that limit's burst, decided when a task of the
key runs, since only the task's arguments name its plan. All three hashes are read in one
round trip every ``refresh_s``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

from throttle.errors import BackendError, ConfigError, RequestError
from throttle.redis.client import RedisClient, wrap_errors
from throttle.redis.keys import KeySpace, decode_hold_field
from throttle.spec import Limit

__all__ = ["MODES", "RATES_CHANGED", "RateBook", "RateBookBase"]

RATES_CHANGED = "!rates"
"""The word an announcement of a rate set at run time carries on the capacity channel
(:meth:`KeySpace.capacity_channel`) besides the limit's name (no limit is named so): a
listening worker re-reads the rates before its waiting tasks ask again."""

MODES = ("enforce", "shadow")
"""The modes of a limit (``Rule.mode``): it delays its tasks, or records what it would."""


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
        self.followed_key = keyspace.followed_rates_key()
        self.key_rates_key = keyspace.key_rates_key()
        self.key_names_key = keyspace.key_names_key()
        self.modes_key = keyspace.modes_key()
        self.channel = keyspace.capacity_channel()
        """Where a rate set is announced: tasks waiting for the limit look again at once
        (a raised rate is capacity), rather than at the time their last denial named."""
        self._keyspace = keyspace
        self.refresh_s = refresh_s
        self._monotonic = monotonic
        self._cached: dict[str, str] = {}
        self._followed: dict[str, str] = {}
        self._keyed: dict[str, str] = {}
        """Per-key rates: field of the key (:meth:`KeySpace.hold_fields`) -> spec."""
        self._modes: dict[str, str] = {}
        """Modes set at run time: limit name -> ``enforce`` or ``shadow``."""
        self._read_at = -float("inf")
        # Limits built from the book, by (configured limit, spec): built once per change.
        self._built: dict[tuple[Limit, str], Limit] = {}
        self._built_keyed: dict[tuple[Limit, str], Limit] = {}

    def _checked_key(self, limit: Limit, key: str, rate: str) -> Limit:
        """The limit a key's ``rate`` makes of ``limit`` (its burst as :meth:`keyed_limit`
        decides it); a bad rate, or a fair limit, raises ConfigError."""
        _is_limit(limit)
        if limit.fair:
            raise ConfigError(
                "a fair limit shares one rate among its keys: a key's share is set by its "
                "weight (weights, or the limit's plans), not by a rate of its own",
                field="key", value=key, limit=limit.name,
            )  # fmt: skip
        if not isinstance(key, str):  # None names the whole limit: set() is for that
            raise RequestError(
                f"a key's rate needs the key, as text (got {key!r}); the whole limit's rate "
                "is set with set()"
            )
        self._keyspace.hold_fields(limit.name, key)  # an empty or non-text key: RequestError
        self._checked(limit, rate)  # a bad rate: ConfigError
        return self.keyed_limit(limit, rate)

    def keyed_limit(self, limit: Limit, rate: str) -> Limit:
        """``limit`` (a key's plan, or the limit's own) at a key's run-time ``rate``:
        without ``burst`` in it, at most as bursty as ``limit``. A rate that does not parse
        (written by hand) gives ``limit``."""
        built = self._built_keyed.get((limit, rate))
        if built is None:
            try:
                built = Limit.parse(rate, name=limit.name, algorithm=limit.algorithm)
                if (
                    "burst" not in rate.lower()
                    and limit.algorithm.reserves
                    and limit.capacity < built.count
                ):
                    built = Limit(
                        limit.name, limit.algorithm, built.count, built.period_s, limit.capacity
                    )
            except ValueError:  # ConfigError: written by hand
                return limit
            if len(self._built_keyed) > 4096:
                self._built_keyed.clear()  # bounded: plans x rates set, rebuilt on demand
            self._built_keyed[(limit, rate)] = built
        return built

    @staticmethod
    def _checked(limit: Limit, rate: str) -> Limit:
        """The limit ``rate`` makes of ``limit``; a bad rate raises ConfigError."""
        _is_limit(limit)
        return Limit.parse(rate, name=limit.name, algorithm=limit.algorithm)

    def _changed(self) -> None:
        """After a write: the next :meth:`current` reads the book afresh."""
        self._read_at = -float("inf")

    def refresh_soon(self) -> None:
        """The next :meth:`current` reads the book afresh (a rate set elsewhere was
        announced)."""
        self._changed()

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

    def _read(
        self,
        raw: dict[bytes, bytes],
        followed: dict[bytes, bytes],
        keyed: dict[bytes, bytes],
        modes: dict[bytes, bytes],
        now: float,
    ) -> None:
        """Cache the replies of HGETALL on the four hashes, read at ``now``."""
        self._cached = self._book(raw)
        self._followed = self._book(followed)
        self._keyed = self._book(keyed)
        self._modes = {name: mode for name, mode in self._book(modes).items() if mode in MODES}
        self._read_at = now

    @classmethod
    def _key_book(
        cls, keyed: dict[bytes, bytes], names: dict[bytes, bytes] | None = None
    ) -> dict[tuple[str, str | None], str]:
        """Replies of HGETALL on the per-key hash and on its long keys' names: (limit,
        key) -> spec (a key too long to keep in a field name, ``#`` + SHA-256, is named
        from ``names`` when it is there)."""
        known = cls._book(names or {})
        book = {}
        for field, spec in cls._book(keyed).items():
            limit, key = decode_hold_field(field)
            book[limit, known.get(field, key)] = spec
        return book

    def _key_field(self, name: str, key: str) -> tuple[str, str | None]:
        """The field of ``key`` of limit ``name`` in the per-key hash, and the key to
        keep in the names hash when the field holds its hash instead (else None)."""
        field = self._keyspace.hold_fields(name, key)[1]
        return field, (key if field.partition(":")[2].startswith("#") else None)

    @classmethod
    def _merged(cls, raw: dict[bytes, bytes], followed: dict[bytes, bytes]) -> dict[str, str]:
        """The spec in force per limit name: the operator's, or the upstream's when slower."""
        book = cls._book(raw)
        for name, spec in cls._book(followed).items():
            if name not in book or _rate_of(spec) < _rate_of(book[name]):
                book[name] = spec
        return book

    def _built_of(self, limit: Limit, spec: str | None) -> Limit:
        """``limit`` with the rate ``spec`` (None, or a spec that does not parse: ``limit``)."""
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
            if limit.default_weight != built.default_weight:  # a fair limit's plan: its weight
                built = dataclasses.replace(built, default_weight=limit.default_weight)
            self._built[(limit, spec)] = built
        return built

    @staticmethod
    def _checked_mode(mode: str | None) -> None:
        if mode is not None and mode not in MODES:
            raise ConfigError(
                "must be 'enforce' or 'shadow' (or None: the limits file's)",
                field="mode",
                value=mode,
            )

    def cached_modes(self) -> Mapping[str, str]:
        """The modes set at run time (limit name -> mode) as last read (no refresh: call
        :meth:`RateBook.modes_in_force` for that): the cache itself, never to be changed."""
        return self._modes

    def ceiling(self, limit: Limit) -> Limit:
        """``limit`` with the operator's cached run-time rate, if one is stored: the
        highest the upstream's stated rate may bring it back to (no refresh: call
        :meth:`RateBook.current` first)."""
        return self._built_of(limit, self._cached.get(limit.name))

    def followed(self, name: str) -> str | None:
        """The cached rate the upstream stated for limit ``name`` (:meth:`RateBook.follow`),
        or None."""
        return self._followed.get(name)

    def _resolve_key(self, limit: Limit, key: str | None) -> Limit:
        """``limit`` (a plan's, or the configured one) in force for ``key``: the key's
        run-time rate if one is stored (the upstream's when that is slower), else
        :meth:`_resolve`."""
        resolved = self._resolve(limit)
        # A fair limit has no rate per key (set_key refuses one: a key's share is its
        # weight), but one can be stored anyway: set while the limit was not fair yet,
        # or through set_key with a Limit built without fair=True. Applied, it made the
        # key a plain limit of its own, outside the shared rate (201 calls in 2 s on a
        # 20/s fair limit): ignored, as a rate written by hand that does not parse is.
        if key is None or not self._keyed or limit.fair:
            return resolved
        spec = self._keyed.get(self._keyspace.hold_fields(limit.name, key)[1])
        if spec is None:
            return resolved
        keyed = self.keyed_limit(limit, spec)
        followed = self._followed.get(limit.name)
        if followed is not None:
            stated = self._built_of(limit, followed)
            if stated is not limit and stated.rate_per_s < keyed.rate_per_s:
                return stated
        return keyed

    def _resolve(self, limit: Limit) -> Limit:
        """``limit`` with the cached run-time rate, if one is stored: the operator's, or
        the upstream's when that is slower.

        A stored rate that does not parse (written by hand) is ignored: the configured
        limit stays in force rather than failing every task.
        """
        ceiling = self.ceiling(limit)
        spec = self._followed.get(limit.name)
        if spec is None:
            return ceiling
        followed = self._built_of(limit, spec)
        if followed is limit:  # written by hand, and it does not parse: not in force
            return ceiling
        return followed if followed.rate_per_s < ceiling.rate_per_s else ceiling


def _rate_of(spec: str) -> float:
    """A stored spec's rate per s (infinite when it does not parse: it is not in force)."""
    try:
        return Limit.parse(spec).rate_per_s
    except ValueError:
        return math.inf


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

        def write() -> None:
            with self.client.pipeline(transaction=False) as pipe:
                pipe.hset(self.key, limit.name, rate)
                pipe.hdel(self.followed_key, limit.name)
                pipe.execute()
            # Tasks waiting for the limit look again now (a raised rate is capacity). Not
            # in the pipeline: a Redis Cluster pipeline refuses PUBLISH.
            self.client.publish(self.channel, f"{RATES_CHANGED} {limit.name}")

        wrap_errors(write)
        self._changed()
        return changed

    def clear(self, name: str) -> None:
        """Go back to the configured rate of limit ``name`` (the upstream's stated rate of
        it too, until the upstream states one again)."""

        def write() -> None:
            with self.client.pipeline(transaction=False) as pipe:
                pipe.hdel(self.key, name)
                pipe.hdel(self.followed_key, name)
                pipe.execute()
            self.client.publish(self.channel, f"{RATES_CHANGED} {name}")

        wrap_errors(write)
        self._changed()

    def set_key(self, limit: Limit, key: str, rate: str) -> Limit:
        """Store a rate for ``key`` of ``limit`` alone (``"250/s"``): the fleet uses it for
        that key within ``refresh_s``, whatever the key's plan. Returns the limit the key
        gets when ``limit`` is its plan (without ``burst`` in ``rate``, at most
        ``limit``'s burst). Validated first: a bad rate, or a fair limit (a key's share of
        it is its weight), raises ConfigError, nothing stored."""
        changed = self._checked_key(limit, key, rate)
        field, long_key = self._key_field(limit.name, key)

        def write() -> None:
            with self.client.pipeline(transaction=False) as pipe:
                pipe.hset(self.key_rates_key, field, rate)
                if long_key is not None:
                    pipe.hset(self.key_names_key, field, long_key)
                pipe.execute()
            self.client.publish(self.channel, f"{RATES_CHANGED} {limit.name}")

        wrap_errors(write)
        self._changed()
        return changed

    def clear_key(self, name: str, key: str) -> bool:
        """Drop the rate stored for ``key`` of limit ``name``: the key goes back to its
        plan's (or the limit's) rate. Returns whether one was stored."""
        field = self._key_field(name, key)[0]

        def write() -> int:
            with self.client.pipeline(transaction=False) as pipe:
                pipe.hdel(self.key_rates_key, field)
                pipe.hdel(self.key_names_key, field)
                removed = int(pipe.execute()[0])
            # The key's own rate was often a lowered one: back to the plan's or the limit's,
            # its tasks waiting in the workers' lines look again now, not at the time the
            # lower rate named (up to line_max).
            self.client.publish(self.channel, f"{RATES_CHANGED} {name}")
            return removed

        removed = wrap_errors(write)
        self._changed()
        return bool(removed)

    def key_overrides(self) -> dict[tuple[str, str | None], str]:
        """The rates stored for single keys, read afresh: (limit name, key) -> spec."""
        keyed = self._fetch()[2]
        names = wrap_errors(lambda: self.client.hgetall(self.key_names_key)) if keyed else None
        return self._key_book(keyed, names)

    def set_mode(self, name: str, mode: str | None) -> None:
        """Switch limit ``name`` to ``mode`` (``enforce``, ``shadow``) for the whole fleet,
        within ``refresh_s``; None: back to the limits file's mode."""
        self._checked_mode(mode)

        def write() -> None:
            if mode is None:
                self.client.hdel(self.modes_key, name)
            else:
                self.client.hset(self.modes_key, name, mode)
            # Tasks waiting for the limit look again now: switched to shadow, they run.
            self.client.publish(self.channel, f"{RATES_CHANGED} {name}")

        wrap_errors(write)
        self._changed()

    def mode(self, name: str) -> str | None:
        """The mode set at run time for limit ``name`` (re-read every refresh_s), or None."""
        return self.modes_in_force().get(name)

    def modes_in_force(self) -> Mapping[str, str]:
        """The modes set at run time (limit name -> mode), re-read every refresh_s: the
        cache itself (read it, never change it)."""
        now = self._stale()
        if now is not None:
            self._refresh(now)
        return self._modes

    def modes(self) -> dict[str, str]:
        """The modes set at run time (limit name -> mode), read afresh."""
        return {k: v for k, v in self._book(self._fetch()[3]).items() if v in MODES}

    def follow(self, limit: Limit, rate: str | None) -> None:
        """Store the rate the upstream states for ``limit`` (None: it states the
        operator's or the configured rate, or faster: drop it). Validated first: a bad rate
        raises ConfigError, nothing stored. The operator's rate is left alone."""
        if rate is None:
            wrap_errors(lambda: self.client.hdel(self.followed_key, limit.name))
        else:
            self._checked(limit, rate)
            wrap_errors(lambda: self.client.hset(self.followed_key, limit.name, rate))
        # A stated rate that rose (or was dropped) is capacity: the tasks waiting for the
        # limit in the workers' lines look again now, as for an operator's set.
        wrap_errors(lambda: self.client.publish(self.channel, f"{RATES_CHANGED} {limit.name}"))
        self._changed()

    def overrides(self) -> dict[str, str]:
        """The stored rates in force (limit name -> spec), read afresh: the operator's, or
        the upstream's stated one when slower."""
        return self._merged(*self._fetch()[:2])

    def followed_rates(self) -> dict[str, str]:
        """The rates the upstream states for the limits that follow it (limit name ->
        spec, :meth:`follow`), read afresh."""
        return self._book(self._fetch()[1])

    def _fetch(
        self,
    ) -> tuple[dict[bytes, bytes], dict[bytes, bytes], dict[bytes, bytes], dict[bytes, bytes]]:
        def read() -> list[Any]:
            with self.client.pipeline(transaction=False) as pipe:
                pipe.hgetall(self.key)
                pipe.hgetall(self.followed_key)
                pipe.hgetall(self.key_rates_key)
                pipe.hgetall(self.modes_key)
                return list(pipe.execute())

        raw, followed, keyed, modes = wrap_errors(read)
        return raw, followed, keyed, modes

    def current(self, limit: Limit, key: str | None = None) -> Limit:
        """``limit`` with its run-time rate, if one is stored (re-read every refresh_s):
        ``key``'s own (:meth:`set_key`) when given and stored, else the limit's.

        A stored rate that does not parse (written by hand) is ignored: the configured
        limit stays in force rather than failing every task.
        """
        now = self._stale()
        if now is not None:
            self._refresh(now)
        return self._resolve_key(limit, key)

    def _refresh(self, now: float) -> None:
        """Read the book again; when Redis fails, keep what was read and try again
        ``refresh_s`` later, not on every call (a hung Redis makes each call wait for
        its socket timeout), and raise."""
        try:
            self._read(*self._fetch(), now)
        except BackendError:
            self._read_at = now
            raise


def _is_limit(limit: object) -> None:
    """Refuse, naming what to pass instead, anything but a :class:`Limit` (its name, say:
    the configured limit is needed to check a new rate against it)."""
    if not isinstance(limit, Limit):
        raise TypeError(
            "a rate is set on the Limit itself, such as "
            f"Throttler.of(app).config.rule({str(limit)!r}).limit (got {limit!r})"
        )
