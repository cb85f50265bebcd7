"""A fake Redis server that runs the scripts of ``lua/`` on their models.

:class:`MemoryRedis` stands in for the Redis server of a :class:`~throttle.limiter.Limiter`:
it recognises each script by its source, decodes its KEYS and ARGV as the script would (the
wire format of :mod:`throttle.redis.wire`), and answers the limiter's script calls (acquire,
settle, peek, hold, holds, space, and lua/adapt.lua's learned states) with the replies the
scripts would give, computed by the models (:class:`~throttle.memory.model.ModelLimiter`,
:func:`~throttle.memory.adapt.adapt`); plus the few plain commands the Celery layer sends.
It serves one process: nothing is shared with another process, and the parking lot's
scripts are refused (an eager task never parks).
"""

from __future__ import annotations

import functools
import math
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from throttle.errors import BackendError
from throttle.memory.adapt import adapt
from throttle.memory.model import ModelLimiter, Record, Spec
from throttle.memory.prelude import Params, ceil_us
from throttle.redis.scripts import (
    ALGORITHM_FILES,
    ONE_LIMIT_OPERATIONS,
    operation_source,
    script_source,
)

_SETTLE_CODES = {"settled": b"0", "already_settled": b"1", "unknown": b"2", "mismatch": b"3"}
_NKEYS = {"conc": 2, "fair": 3}  # state keys per limit (ALGO[code].nkeys): 1 for the others


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _lua(number: float) -> str:
    """A number as Lua's ``..`` makes it text ('%.14g'): the scripts' text replies carry
    durations so (exact below 1e14 us, 3 years; to 14 digits beyond)."""
    return f"{number:.14g}"


def _number(value: Any) -> float | None:
    """Lua's ``tonumber`` of an ARGV value (None for '')."""
    text = _text(value)
    return float(text) if text else None


class MemoryScript:
    """A script registered with :class:`MemoryRedis`: called as redis-py's ``Script`` is."""

    def __init__(self, server: MemoryRedis, source: str) -> None:
        self.server = server
        self.script = source
        self.operation, self.code = server.operation_of(source)

    def __call__(self, keys: Sequence[str], args: Sequence[Any], client: Any = None) -> Any:
        with self.server.lock:
            return getattr(self.server, f"_{self.operation}")(self.code, list(keys), list(args))


class MemoryRedis:
    """An in-memory stand-in for the limiter's Redis: the scripts of ``lua/`` computed by
    their models (:class:`ModelLimiter`), the holds, the lease records, and the few plain
    commands the Celery layer sends (``TIME``, the HASH of run-time rates, the stats).

    Parameters
    ----------
    clock_us:
        The server's clock, "now" in us since the epoch (Redis ``TIME``): default this
        host's wall clock. A script given an explicit time (``Limiter(clock_us=...)``)
        decides on that instead, as in Redis; lease records expire on this clock, as Redis
        keys do.

    One process: the state lives in this object (thread-safe: one lock, as Redis runs one
    script at a time). The parking lot's scripts raise :class:`BackendError`: a task that
    waits in memory waits in its caller (eager mode blocks to its slot).
    """

    def __init__(self, *, clock_us: Callable[[], int] | None = None) -> None:
        self.clock_us = clock_us or (lambda: time.time_ns() // 1000)
        self.lock = threading.RLock()
        self.model = ModelLimiter()
        self.holds: dict[str, dict[str, float]] = {}  # holds key -> field -> until (us)
        self.hashes: dict[str, dict[bytes, bytes]] = {}  # plain HASHes (rates, stats, clocks)
        # spacing guard key -> (next call at, last call stamped at, spacing per unit then), us
        self.spaced: dict[str, tuple[float, float, float]] = {}
        self.learned: dict[str, dict[str, float]] = {}  # lua/adapt.lua's states
        # plain strings (the number of a task's newest copy): key -> (value, expires at, us)
        self.strings: dict[str, tuple[bytes, float]] = {}

    # -- what redis-py's client offers, as far as the package uses it

    def register_script(self, source: str) -> MemoryScript:
        return MemoryScript(self, source)

    def time(self) -> tuple[int, int]:
        now = self.clock_us()
        return now // 1_000_000, now % 1_000_000

    def hset(self, key: str, field: Any, value: Any) -> int:
        with self.lock:
            bucket = self.hashes.setdefault(key, {})
            new = _bytes(field) not in bucket
            bucket[_bytes(field)] = _bytes(value)
            return int(new)

    def hdel(self, key: str, *fields: Any) -> int:
        with self.lock:
            bucket = self.hashes.get(key, {})
            return sum(bucket.pop(_bytes(f), None) is not None for f in fields)

    def hgetall(self, key: str) -> dict[bytes, bytes]:
        with self.lock:
            return dict(self.hashes.get(key, {}))

    def hincrby(self, key: str, field: Any, amount: int = 1) -> int:
        with self.lock:
            bucket = self.hashes.setdefault(key, {})
            value = int(bucket.get(_bytes(field), b"0")) + amount
            bucket[_bytes(field)] = str(value).encode()
            return value

    def set(
        self,
        key: str,
        value: Any,
        *,
        px: int | None = None,
        ex: int | None = None,
        nx: bool = False,
    ) -> bool | None:
        """Redis ``SET`` (``PX``, ``EX``, ``NX``), expiring on this server's clock: the
        parking lot records here the newest copy of a task sent back
        (:meth:`throttle.parking.ParkingLot.sent_copy`)."""
        with self.lock:
            now = self.clock_us()
            if nx and self.get(key) is not None:
                return None
            ttl_us = px * 1000 if px is not None else ex * 1_000_000 if ex is not None else None
            self.strings[key] = (_bytes(value), math.inf if ttl_us is None else now + ttl_us)
            return True

    def get(self, key: str) -> bytes | None:
        with self.lock:
            value, until = self.strings.get(key, (None, math.inf))
            if value is not None and until <= self.clock_us():
                del self.strings[key]
                return None
            return value

    def expire(self, key: str, seconds: Any) -> bool:
        return key in self.hashes  # counts for people: kept for the life of the object

    def pipeline(self, transaction: bool = True) -> _Pipeline:
        return _Pipeline(self)

    def close(self) -> None:
        """Nothing to close (the same call as a redis-py client's)."""

    def clear(self) -> None:
        """Forget every state, hold, lease record, hash and learned rate: a fresh server."""
        with self.lock:
            self.model = ModelLimiter()
            self.holds.clear()
            self.hashes.clear()
            self.spaced.clear()
            self.learned.clear()
            self.strings.clear()

    # -- the scripts

    def operation_of(self, source: str) -> tuple[str, str | None]:
        """The operation of a script's source (as composed by throttle.redis.scripts),
        and the algorithm code of a one-limit acquire."""
        known = _known_sources()
        if source not in known:
            raise BackendError("the memory limiter cannot run this script (not one of lua/)")
        return known[source]

    def _now(self, explicit: Any) -> float:
        """prelude.lua's ``clock_us``: the server's clock for '', an explicit time, or (a
        negative one) the server's clock that many us ago."""
        number = _number(explicit)
        if number is None:
            return float(self.clock_us())
        return number if number >= 0 else float(self.clock_us()) + number

    def _record(self, name: str) -> Record | None:
        """The live lease record ``name`` (expired ones are dropped, as Redis would)."""
        record = self.model.records.get(name)
        if record is not None and record.expires_at <= self.clock_us():
            del self.model.records[name]
            return None
        return record

    def _hold_until(self, holds_key: str, whole: Any, own: Any) -> float:
        held = self.holds.get(holds_key, {})
        return max(held.get(_text(whole), 0.0), held.get(_text(own), 0.0))

    def _acquire_one(self, code: str | None, keys: list[str], args: list[Any]) -> bytes:
        assert code is not None
        now = self._now(args[0])
        count, period_us, burst, cost = (float(_text(a)) for a in args[2:6])
        if cost > burst:
            return b"2 1"
        hold = self._hold_until(keys[0], args[6], args[7])
        if hold > now:
            return struct.pack("<ddddd", 0, 0, ceil_us(hold - now), 0, 0)
        p, algo = Params(count, period_us, burst), self.model.algos[code]
        r = algo.check(keys[1], p, now, cost, float(_text(args[1])))
        if r["allowed"]:
            algo.commit(keys[1], p, now, cost, r, holder="", expiry=0.0)
        return struct.pack(
            "<ddddd", r["allowed"], r["wait"], r["retry"], r["remaining"], r["reset"]
        )

    def _acquire_series(self, code: str | None, keys: list[str], args: list[Any]) -> bytes:
        assert code is not None
        base = self._now(args[0])
        count, period_us, burst = (float(_text(a)) for a in args[2:5])
        max_wait = float(_text(args[1]))
        hold = self._hold_until(keys[0], args[5], args[6])
        p, algo = Params(count, period_us, burst), self.model.algos[code]
        out: list[bytes] = []
        for i in range(8, len(args), 2):
            now, cost = base - float(_text(args[i])), float(_text(args[i + 1]))
            if cost > burst:
                out.append(struct.pack("<ddddd", 2, 0, 0, 0, 0))
            elif hold > now:
                out.append(struct.pack("<ddddd", 0, 0, ceil_us(hold - now), 0, 0))
            else:
                r = algo.check(keys[1], p, now, cost, max_wait)
                if r["allowed"]:
                    algo.commit(keys[1], p, now, cost, r, holder="", expiry=0.0)
                out.append(
                    struct.pack(
                        "<ddddd", r["allowed"], r["wait"], r["retry"], r["remaining"], r["reset"]
                    )
                )
        return b"".join(out)

    def _limits(self, keys: list[str], args: list[Any], first: int, n: int) -> list[Spec]:
        """The n limits of ARGV (5 values each from index ``first``: settle.lua's and
        peek.lua's layout) and their state keys from ``keys`` (in order)."""
        specs: list[Spec] = []
        k = 0
        for i in range(n):
            code, count, period_us, burst = (
                _text(a) for a in args[first + 5 * i : first + 5 * i + 4]
            )
            specs.append((code, Params(float(count), float(period_us), float(burst)), keys[k]))
            k += _NKEYS.get(code, 1)
        return specs

    def _acquire(self, code: str | None, keys: list[str], args: list[Any]) -> bytes:
        now = self._now(args[0])
        max_wait, n = float(_text(args[1])), int(_text(args[2]))
        if max_wait < 0:  # a deadline (acquire.lua)
            max_wait = max(-max_wait - now, 0.0)
        acq = _text(args[4 + n]) or None
        lease_us = float(_text(args[5 + n]))
        fields = args[6 + n :]
        # The codes, then each limit's count, period_us, burst and cost packed (acquire.lua).
        numbers = struct.unpack(f"<{4 * n}d", _bytes(args[3 + n]))
        specs: list[Spec] = []
        k = 0
        for i in range(n):
            code = _text(args[3 + i])
            specs.append((code, Params(*numbers[4 * i : 4 * i + 3]), keys[1 + k]))
            k += _NKEYS.get(code, 1)
        costs = list(numbers[3::4])
        # (The script finds an excess cost after the lease record; the Limiter refuses one
        # before it calls, so that order never shows.)
        for i, ((_, p, _), cost) in enumerate(zip(specs, costs, strict=True), start=1):
            if cost > p.burst:
                return f"2 {i}".encode()
        holds = [self._hold_until(keys[0], fields[2 * i], fields[2 * i + 1]) for i in range(n)]
        record = keys[-1] if acq is not None else None
        if record is not None:
            self._record(record)  # an expired record is gone
        outcome = self.model.decide(
            specs, now=now, costs=costs, max_wait_us=max_wait, acq=acq, record=record,
            lease_us=lease_us, holds=holds,
        )  # fmt: skip
        if outcome[0] == "mismatch":
            return b"3"
        if outcome[0] == "voided":
            return f"4 {outcome[1]} {_lua(outcome[2])}".encode()
        if outcome[0] == "redelivered":
            _, wait, retry, reserved = outcome
            return " ".join(["1", "1", _lua(wait), _lua(retry), *map(repr, reserved)]).encode()
        allowed, _, wait, retry, per_limit = outcome
        if allowed and record is not None:
            # PEXPIRE ttl_ms(expiry - now) - 1000, on the server's clock.
            expiry = now + wait + lease_us
            ttl_ms = min(math.ceil(max(expiry - now, 0) / 1000) + 1000, 1e13) - 1000
            self.model.records[record].expires_at = self.clock_us() + ttl_ms * 1000
        out = [struct.pack("<dddd", 0, allowed, wait, retry)]
        out.extend(struct.pack("<dddd", *limit) for limit in per_limit)
        return b"".join(out)

    def _settle(self, code: str | None, keys: list[str], args: list[Any]) -> bytes:
        now = self._now(args[0])
        holder, n = _text(args[1]), int(_text(args[2]))
        record = keys[-1]
        self._record(record)
        specs = self._limits(keys[:-1], args, 3, n)
        actuals = [_number(args[3 + 5 * i + 4]) for i in range(n)]
        unless_found = len(args) > 4 + 6 * n and _text(args[4 + 6 * n]) == "1"
        status, deltas = self.model.finish(
            record, holder, specs, now=now, actuals=actuals, unless_found=unless_found
        )
        return b" ".join([_SETTLE_CODES[status], *(repr(d).encode() for d in deltas)])

    def _peek(self, code: str | None, keys: list[str], args: list[Any]) -> bytes:
        now = self._now(args[0])
        (code, p, key), cost = self._limits(keys[1:], args, 3, 1)[0], float(_text(args[7]))
        algo = self.model.algos[code]
        # Twice, as peek.lua: with no cost for what is there now, with the cost for when.
        now_state = algo.check(key, p, now, 0.0, 0)
        asked = algo.check(key, p, now, cost, 0)
        allowed, retry = asked["allowed"], asked["retry"]
        hold = self._hold_until(keys[0], args[10], args[11])
        if hold > now:
            allowed, retry = 0, max(retry, ceil_us(hold - now))
        remaining, reset = now_state["remaining"], now_state["reset"]
        return f"0 {allowed} {remaining!r} {_lua(retry)} {_lua(reset)}".encode()

    def _hold(self, code: str | None, keys: list[str], args: list[Any]) -> bytes:
        now = self._now(args[0])
        held = self.holds.setdefault(keys[0], {})
        for ended in [f for f, until in held.items() if until <= now]:
            del held[ended]
        field = _text(args[1])
        if _text(args[2]) == "":
            held.pop(field, None)
            return b"0"
        until = now + float(_text(args[2]))
        current = held.get(field)
        if current is not None and current > until:
            until = current
        else:
            held[field] = until
        return b"%d" % int(until - now)

    def _holds(self, code: str | None, keys: list[str], args: list[Any]) -> list[bytes]:
        now = self._now(args[0])
        out = [b"%d" % int(now)]
        for name, until in self.holds.get(keys[0], {}).items():
            if until > now:
                out.extend((name.encode(), b"%d" % int(until)))
        return out

    def _space(self, code: str | None, keys: list[str], args: list[Any]) -> int:
        """lua/space.lua: stamp the call at the latest next-call time of its keys (or now),
        and move each key's next call a spacing past the stamp. (No restart fence: this
        server's state cannot be lost while the limiter that uses it lives.)"""
        now = self._now(args[0])
        n = (len(args) - 2) // 2
        spacings = [float(_text(a)) for a in args[2 : 2 + n]]
        units = [float(_text(a)) for a in args[2 + n : 2 + 2 * n]]
        at = now
        for key, unit_now in zip(keys, units, strict=False):
            kept = self.spaced.get(key)
            if kept is not None:
                next_at, stamped, unit = kept
                if unit_now < unit:  # a rate raised since: the wait shrinks in proportion
                    next_at = stamped + (next_at - stamped) * unit_now / unit
                at = max(at, next_at)
        for key, spacing, unit_now in zip(keys, spacings, units, strict=False):
            self.spaced[key] = (at + spacing, at, unit_now)
        return int(ceil_us(at - now))  # a Lua number replied: an integer reply

    def _accept_parked(self, code: str | None, keys: list[str], args: list[Any]) -> int:
        # SET NX, or the same publish id again: a copy released once runs (never parked
        # here, so never asked outside tests of the layer).
        bucket = self.hashes.setdefault(keys[0], {})
        return int(bucket.setdefault(b"id", _bytes(args[0])) == _bytes(args[0]))

    def _unsupported(self, code: str | None, keys: list[str], args: list[Any]) -> Any:
        raise BackendError(
            "the memory limiter has no parking lot: a task that waits in memory waits in "
            "its caller (eager mode), never parked"
        )

    _park = _claim_parked = _commit_parked = _purge_parked = _unsupported

    def _adapt(self, code: str | None, keys: list[str], args: list[Any]) -> bytes:
        state = self.learned.setdefault(keys[0], {})
        return adapt(state, self._now(args[0]), [_text(a) for a in args[1:]]).encode()


class _Pipeline:
    """The pipelines of :class:`throttle.stats.StatsBook`, ``ParkingLot.counts`` and the
    rate book."""

    def __init__(self, server: MemoryRedis) -> None:
        self.server = server
        self.calls: list[Callable[[], Any]] = []

    def __enter__(self) -> _Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.calls.clear()

    def hincrby(self, key: str, field: Any, amount: int = 1) -> None:
        self.calls.append(lambda: self.server.hincrby(key, field, amount))

    def expire(self, key: str, seconds: Any) -> None:
        self.calls.append(lambda: self.server.expire(key, seconds))

    def hgetall(self, key: str) -> None:
        self.calls.append(lambda: self.server.hgetall(key))

    def hset(self, key: str, field: Any, value: Any) -> None:
        self.calls.append(lambda: self.server.hset(key, field, value))

    def hdel(self, key: str, *fields: Any) -> None:
        self.calls.append(lambda: self.server.hdel(key, *fields))

    def zcard(self, key: str) -> None:
        self.calls.append(lambda: 0)  # nothing is ever parked

    def publish(self, channel: str, message: Any) -> None:
        self.calls.append(lambda: 0)  # nobody listens: one process waits in its caller

    def execute(self) -> list[Any]:
        with self.server.lock:
            results = [call() for call in self.calls]
        self.calls.clear()
        return results


def _bytes(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


@functools.cache
def _known_sources() -> dict[str, tuple[str, str | None]]:
    """Every script source the package composes -> (operation, code of a one-limit acquire)."""
    known: dict[str, tuple[str, str | None]] = {}
    codes = sorted(ALGORITHM_FILES)
    for code in codes:
        if code not in ("conc", "fair"):
            for operation in ONE_LIMIT_OPERATIONS:
                known[script_source(operation, frozenset((code,)))] = (operation, code)
        known[script_source("peek", frozenset((code,)))] = ("peek", None)
    for mask in range(1, 2 ** len(codes)):
        chosen = frozenset(c for i, c in enumerate(codes) if mask >> i & 1)
        known[script_source("acquire", chosen)] = ("acquire", None)
        known[script_source("settle", chosen)] = ("settle", None)
    for operation in (
        "hold",
        "holds",
        "park",
        "claim_parked",
        "commit_parked",
        "accept_parked",
        "purge_parked",
        "space",
        "adapt",
    ):
        known[operation_source(operation)] = (operation, None)
    return known
