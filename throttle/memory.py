"""The scripts of ``lua/`` in Python: the in-memory limiter of eager tests.

Each model of an algorithm keeps its state in a dict instead of Redis and performs the same
floating-point operations in the same order as its script in ``lua/``, so that a script and
its model fed the same (time, cost) sequence agree exactly: decisions, remaining,
retry_after and reset. ``tests/integration/test_model.py`` proves it with hypothesis,
against the scripts in a real Redis, for every algorithm and for several limits at once,
through :class:`MemoryLimiter` as well as :class:`ModelLimiter`. Missing state reads as it
does in Lua (a full bucket, an empty window); a state key's expiry is not modelled, because
a key only expires once its state reads like a missing key.

:class:`MemoryRedis` stands in for the Redis server of a :class:`~throttle.limiter.Limiter`:
it answers the limiter's script calls (acquire, settle, peek, hold, holds, and
lua/adapt.lua's learned states: :func:`adapt`) with the replies the scripts would give,
computed by the models, so that :class:`MemoryLimiter` is the
:class:`~throttle.limiter.Limiter` itself (its checks, keys and decoding) over memory. It
serves one process: nothing is shared with another process, and the parking lot's scripts
are refused (an eager task never parks). Users' tests reach it through
:mod:`throttle.testing`.
"""

from __future__ import annotations

import functools
import math
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from throttle.errors import BackendError
from throttle.limiter import Limiter
from throttle.redis.client import RedisClient
from throttle.redis.scripts import ALGORITHM_FILES, operation_source, script_source
from throttle.redis.wire import target_args
from throttle.spec import Limit

__all__ = [
    "Concurrency",
    "Fair",
    "FixedWindow",
    "Gcra",
    "MemoryLimiter",
    "MemoryRedis",
    "ModelLimiter",
    "Params",
    "Record",
    "SlidingWindow",
    "TokenBucket",
    "adapt",
    "ceil_us",
]


def ceil_us(x: float) -> int:
    """A duration in us rounded up to a whole us, never negative (prelude.lua's)."""
    return 0 if x <= 0 else math.ceil(x)


@dataclass
class Params:
    """A limit's numbers as its script reads them from ARGV."""

    count: float
    period_us: float
    burst: float

    @classmethod
    def of(cls, limit: Limit) -> Params:
        # Exactly what the script receives (a fair limit: for a key of weight 1).
        _, count, period_us, burst = target_args(limit, None)
        return cls(float(count), float(period_us), float(burst))


Check = dict[str, Any]
"""What an algorithm's check found: its decision and the state it read, for its commit."""


class Algorithm(Protocol):
    """The three functions of an algorithm file of ``lua/`` (see prelude.lua)."""

    def check(self, key: str, p: Params, now: float, cost: float, max_wait: float) -> Check: ...

    def commit(
        self,
        key: str,
        p: Params,
        now: float,
        cost: float,
        r: Check,
        *,
        holder: str,
        expiry: float,
        at: float | None = None,
    ) -> str:
        """``at``: None = at the limit's own slot; a later time (us): as of that time."""
        ...

    def adjust(
        self, key: str, p: Params, now: float, delta: float, mark: str, holder: str
    ) -> None: ...


class TokenBucket:
    def __init__(self) -> None:
        self.state: dict[str, tuple[float, float]] = {}

    def level(self, key: str, p: Params, now: float) -> tuple[float, float]:
        if key not in self.state:
            return p.burst, now
        tokens, ts = self.state[key]
        if now > ts:
            tokens = tokens + (now - ts) * p.count / p.period_us
            ts = now
        return min(p.burst, tokens), ts

    def check(self, key: str, p: Params, now: float, cost: float, max_wait: float) -> Check:
        tokens, ts = self.level(key, p, now)
        r: Check = {"tokens": tokens, "ts": ts, "allowed": 0, "wait": 0, "retry": 0}
        if tokens >= cost:
            r["allowed"] = 1
        else:
            need = ceil_us((cost - tokens) * p.period_us / p.count)
            if need <= max_wait:
                r["allowed"], r["wait"] = 1, need
            else:
                r["retry"] = need
        after = tokens - cost if r["allowed"] else tokens
        r["remaining"] = max(after, 0.0)
        r["reset"] = ceil_us((p.burst - after) * p.period_us / p.count)
        return r

    def commit(
        self, key: str, p: Params, now: float, cost: float, r: Check, *, at: float | None = None,
        **_: Any,
    ) -> str:  # fmt: skip
        tokens, ts = r["tokens"], r["ts"]
        later = at is not None and at > ts
        if later:
            assert at is not None
            tokens = min(tokens, p.burst - (at - ts) * p.count / p.period_us)
        tokens = tokens - cost
        self.state[key] = (tokens, ts)
        if later:
            r["reset"] = ceil_us((p.burst - tokens) * p.period_us / p.count)
            r["remaining"] = max(tokens, 0.0)
        return ""

    def adjust(self, key: str, p: Params, now: float, delta: float, mark: str, holder: str) -> None:
        tokens, ts = self.level(key, p, now)
        self.state[key] = (min(p.burst, tokens - delta), ts)


class Gcra:
    def __init__(self) -> None:
        self.state: dict[str, float] = {}

    def tat(self, key: str, now: float) -> float:
        tat = self.state.get(key)
        return now if tat is None or tat < now else tat

    def check(self, key: str, p: Params, now: float, cost: float, max_wait: float) -> Check:
        interval = p.period_us / p.count
        tat = self.tat(key, now)
        new_tat = tat + cost * interval
        conform_at = new_tat - p.burst * interval
        r: Check = {"new_tat": new_tat, "tat": tat, "allowed": 0, "wait": 0, "retry": 0}
        after = tat
        if conform_at <= now:
            r["allowed"], after = 1, new_tat
        else:
            need = ceil_us(conform_at - now)
            if need <= max_wait:
                r["allowed"], r["wait"], after = 1, need, new_tat
            else:
                r["retry"] = need
        r["remaining"] = max(p.burst - (after - now) / interval, 0.0)
        r["reset"] = ceil_us(after - now)
        return r

    def commit(
        self, key: str, p: Params, now: float, cost: float, r: Check, *, at: float | None = None,
        **_: Any,
    ) -> str:  # fmt: skip
        new_tat = r["new_tat"]
        if at is not None and at > r["tat"]:
            new_tat = at + cost * p.period_us / p.count
            interval = p.period_us / p.count
            r["reset"] = ceil_us(new_tat - now)
            r["remaining"] = max(p.burst - (new_tat - now) / interval, 0.0)
        self.state[key] = new_tat
        return ""

    def adjust(self, key: str, p: Params, now: float, delta: float, mark: str, holder: str) -> None:
        tat = self.tat(key, now)
        self.state[key] = max(now, tat + delta * p.period_us / p.count)


class FixedWindow:
    def __init__(self) -> None:
        self.state: dict[str, tuple[float, float]] = {}

    def read(self, key: str, p: Params, now: float) -> tuple[float, float]:
        w = float(math.floor(now / p.period_us))
        stored = self.state.get(key)
        if stored is None or stored[0] < w:
            return w, 0.0
        return stored  # the same window, or a later one (the clock stepped back)

    def check(self, key: str, p: Params, now: float, cost: float, max_wait: float) -> Check:
        w, n = self.read(key, p, now)
        window_end = (w + 1) * p.period_us - now
        r: Check = {"w": w, "n": n, "allowed": 0, "wait": 0, "retry": 0}
        r["reset"] = ceil_us(window_end)
        after = n
        if n + cost <= p.count:
            r["allowed"], after = 1, n + cost
        else:
            r["retry"] = ceil_us(window_end)
        r["remaining"] = max(p.count - after, 0.0)
        return r

    def commit(self, key: str, p: Params, now: float, cost: float, r: Check, **_: Any) -> str:
        self.state[key] = (r["w"], r["n"] + cost)
        return repr(r["w"])

    def ends(self, p: Params, r: Check) -> float:
        """When the admission of ``r`` stops holding: the end of its window (us)."""
        return float((r["w"] + 1) * p.period_us)

    def adjust(self, key: str, p: Params, now: float, delta: float, mark: str, holder: str) -> None:
        w, n = self.read(key, p, now)
        if delta < 0 and float(mark) != w:
            return
        self.state[key] = (w, max(n + delta, 0.0))


class SlidingWindow:
    def __init__(self) -> None:
        self.state: dict[str, tuple[float, float, float]] = {}

    def read(self, key: str, p: Params, now: float) -> tuple[float, float, float]:
        w = float(math.floor(now / p.period_us))
        stored = self.state.get(key)
        if stored is None or stored[0] < w - 1:
            return w, 0.0, 0.0
        if stored[0] == w - 1:
            return w, 0.0, stored[1]
        return stored  # the same window, or a later one (the clock stepped back)

    def check(self, key: str, p: Params, now: float, cost: float, max_wait: float) -> Check:
        w, cur, prev = self.read(key, p, now)
        start = w * p.period_us
        est = prev * (1 - max(now - start, 0) / p.period_us) + cur
        r: Check = {"w": w, "cur": cur, "prev": prev, "allowed": 0, "wait": 0, "retry": 0}
        after_cur = cur
        if est + cost <= p.count:
            r["allowed"] = 1
            est = est + cost
            after_cur = cur + cost
        elif cur + cost <= p.count:
            f = 1 - (p.count - cur - cost) / prev
            r["retry"] = ceil_us(start + f * p.period_us - now)
        else:
            f = max(1 - (p.count - cost) / cur, 0.0)
            r["retry"] = ceil_us(start + (1 + f) * p.period_us - now)
        r["remaining"] = max(p.count - est, 0.0)
        if after_cur > 0:
            r["reset"] = ceil_us(start + 2 * p.period_us - now)
        else:
            r["reset"] = ceil_us(start + p.period_us - now)
        return r

    def commit(self, key: str, p: Params, now: float, cost: float, r: Check, **_: Any) -> str:
        self.state[key] = (r["w"], r["cur"] + cost, r["prev"])
        return repr(r["w"])

    def ends(self, p: Params, r: Check) -> float:
        """When the admission of ``r`` stops holding: the end of its window (us)."""
        return float((r["w"] + 1) * p.period_us)

    def adjust(self, key: str, p: Params, now: float, delta: float, mark: str, holder: str) -> None:
        w, cur, prev = self.read(key, p, now)
        paid = float(mark)
        if delta > 0 or paid == w:
            cur = max(cur + delta, 0.0)
        elif paid == w - 1:
            prev = max(prev + delta, 0.0)
        else:
            return
        self.state[key] = (w, cur, prev)


@dataclass
class _Holders:
    leases: dict[str, tuple[float, float]] = field(default_factory=dict)  # holder: expiry, cost
    total: float = 0.0


class Concurrency:
    def __init__(self) -> None:
        self.state: dict[str, _Holders] = {}

    def sweep(self, key: str, now: float) -> _Holders:
        h = self.state.setdefault(key, _Holders())
        # ZRANGEBYSCORE order: by score, then by member (bytes); the order of the
        # floating-point subtractions must match the script's.
        gone = sorted(
            (m for m, (exp, _) in h.leases.items() if exp <= now),
            key=lambda m: (h.leases[m][0], m.encode()),
        )
        if gone:
            for m in gone:
                h.total = h.total - h.leases.pop(m)[1]
            if not h.leases:
                h.total = 0.0
        return h

    def check(self, key: str, p: Params, now: float, cost: float, max_wait: float) -> Check:
        h = self.sweep(key, now)
        r: Check = {"total": h.total, "allowed": 0, "wait": 0, "retry": 0, "reset": 0}
        after = h.total
        if h.total + cost <= p.count:
            r["allowed"], after = 1, h.total + cost
        else:
            first = min(h.leases.values(), key=lambda lease: lease[0])[0]
            r["retry"] = ceil_us(first - now)
        r["remaining"] = max(p.count - after, 0.0)
        return r

    def commit(
        self,
        key: str,
        p: Params,
        now: float,
        cost: float,
        r: Check,
        *,
        holder: str,
        expiry: float,
        at: float | None = None,
    ) -> str:
        h = self.state.setdefault(key, _Holders())
        if cost > 0:
            h.leases[holder] = (expiry, cost)
            h.total = r["total"] + cost
        r["reset"] = ceil_us(max(exp for exp, _ in h.leases.values()) - now) if h.leases else 0
        if not h.leases:
            h.total = 0.0  # the script deletes both keys when nobody holds anything
        return ""

    def adjust(self, key: str, p: Params, now: float, delta: float, mark: str, holder: str) -> None:
        h = self.sweep(key, now)
        if holder not in h.leases:
            return
        held = h.leases.pop(holder)[1]
        h.total = h.total - held
        if h.total < 0 or not h.leases:
            h.total = 0.0


class Fair:
    """lua/fair.lua. ``key`` is the key's state key; the limit's shared HASH and its ZSET
    of active keys are named after it as the key space names them (the name up to its
    last ``:``, and that + ``:a``)."""

    HORIZON_US = 500000.0
    """The near horizon (us): how far ahead a slot is reserved and a key's schedule may run."""
    PLAN_US = 3000000.0
    """How far ahead a key's plan reaches (us) before it starts over."""

    def __init__(self) -> None:
        self.keys: dict[str, tuple[float, float]] = {}  # key -> (tk, plan)
        self.shared: dict[str, dict[str, float]] = {}  # 't', 'W', member -> weight
        self.active: dict[str, dict[str, float]] = {}  # member -> active until (us)

    @staticmethod
    def names(key: str) -> tuple[str, str]:
        shared = key[: key.rindex(":") + 1]
        return shared, shared + ":a"

    def check(self, key: str, p: Params, now: float, cost: float, max_wait: float) -> Check:
        w, interval = p.count, p.period_us / p.count
        burst = p.burst
        shared_name, active_name = self.names(key)
        shared = self.shared.get(shared_name, {})
        active = self.active.get(active_name, {})
        t = max(shared.get("t", now), now)
        total = shared.get("W", 0.0)
        known = shared.get(key)
        gone = sorted(
            (m for m, until in active.items() if until <= now),
            key=lambda m: (active[m], m.encode()),
        )[:100]
        if gone and len(gone) == len(active):
            total, known = 0.0, None
        elif gone:
            for m in gone:
                total = total - shared.get(m, 0.0)
                if m == key:
                    known = None
        if known is not None:
            total = total - known
        total = max(total, 0.0) + w
        tk, plan = self.keys.get(key, (now, now))
        key_interval = interval * total / w
        slot = max(now, t + (cost - burst) * interval)
        near = max(self.HORIZON_US, (burst + 1) * interval)
        due = max(tk, now) + (cost - 1) * key_interval - near
        horizon = min(max_wait, near)
        mode, allowed, wait, retry, after, start = 3, 0, 0, 0, t, plan
        if due <= now and slot - now <= horizon:
            mode, allowed, wait, after = 1, 1, ceil_us(slot - now), t + cost * interval
        elif due > now and slot <= now:
            mode, allowed, after = 2, 1, t + cost * interval
        else:
            mode = 3 if due <= now else 4
            start = max(plan, due, slot - horizon)
            if start > now + max(self.PLAN_US, 4 * cost * key_interval):
                start = max(due, slot - horizon)
            retry = ceil_us(start - now)
        return {
            "allowed": allowed, "wait": wait, "retry": retry,
            "remaining": max(burst - (after - now) / interval, 0.0),
            "reset": ceil_us(after - now),
            "mode": mode, "t": t, "sum": total, "gone": gone, "tk": tk, "plan": plan,
            "key_interval": key_interval, "start": start, "slot": slot,
        }  # fmt: skip

    def _write(
        self, key: str, w: float, now: float, t: float, r: Check, tk: float, plan: float
    ) -> None:
        shared_name, active_name = self.names(key)
        shared = self.shared.setdefault(shared_name, {})
        active = self.active.setdefault(active_name, {})
        for m in r["gone"]:
            active.pop(m, None)
            shared.pop(m, None)
        active[key] = max(tk, plan, now)
        shared.update({"t": t, "W": r["sum"], key: w})
        self.keys[key] = (tk, plan)

    def commit(
        self, key: str, p: Params, now: float, cost: float, r: Check, *, at: float | None = None,
        **_: Any,
    ) -> str:  # fmt: skip
        interval = p.period_us / p.count
        total = max(r["t"], now) + cost * interval
        if at is not None and at > r["t"]:
            total = at + cost * interval
        tk, mark = r["tk"], ""
        if r["mode"] == 1:
            tk = max(tk, r["slot"] if at is None else at) + cost * r["key_interval"]
            mark = f"{r['key_interval']:.17g}"
        self._write(key, p.count, now, total, r, tk, r["plan"])
        return mark

    def deny(self, key: str, p: Params, now: float, cost: float, r: Check) -> None:
        plan = r["start"] + cost * r["key_interval"]
        self._write(key, p.count, now, r["t"], r, r["tk"], plan)

    def adjust(self, key: str, p: Params, now: float, delta: float, mark: str, holder: str) -> None:
        shared = self.shared.get(self.names(key)[0], {})
        if "t" in shared:
            shared["t"] = max(now, max(shared["t"], now) + delta * p.period_us / p.count)
        if key in self.keys and mark != "":
            tk, plan = self.keys[key]
            self.keys[key] = (max(now, max(tk, now) + delta * float(mark)), plan)


@dataclass
class Record:
    """A lease record of acquire.lua: what an acquisition took, for settle and redelivery."""

    settled: bool
    costs: tuple[float, ...]
    slot: float
    keys: tuple[str, ...]
    marks: tuple[str, ...]
    expires_at: float = math.inf
    """When the record expires, in us of the server's clock (:class:`MemoryRedis`)."""


Summary = tuple[Any, ...]
Spec = tuple[str, Params, str]
"""A limit as the scripts see it: its algorithm code, its numbers, its (first) state key."""


def _specs(targets: Sequence[tuple[Limit, str]]) -> list[Spec]:
    # The keys here are state keys, not key values: a fair limit's keys all weigh 1.
    return [(limit.code, Params.of(limit), key) for limit, key in targets]


class ModelLimiter:
    """The acquire/settle operations of lua/acquire.lua and lua/settle.lua, in Python.

    ``targets`` are (limit, state_key) pairs: the caller supplies the key names.
    """

    def __init__(self) -> None:
        self.algos: dict[str, Algorithm] = {
            "tb": TokenBucket(),
            "gcra": Gcra(),
            "fw": FixedWindow(),
            "sw": SlidingWindow(),
            "conc": Concurrency(),
            "fair": Fair(),
        }
        self.records: dict[str, Record] = {}

    def acquire(
        self,
        targets: list[tuple[Limit, str]],
        *,
        now: int,
        cost: float | list[float],
        max_wait_us: int = 0,
        acq: str | None = None,
        lease_us: int = 300_000_000,
    ) -> Summary:
        """-> (allowed, held, wait_us, retry_us, per-limit (allowed, remaining, retry, reset));
        a held acquisition on other keys -> "mismatch"."""
        costs = cost if isinstance(cost, list) else [cost] * len(targets)
        outcome = self.decide(
            _specs(targets), now=now, costs=costs, max_wait_us=max_wait_us, acq=acq,
            record=acq, lease_us=lease_us,
        )  # fmt: skip
        if outcome[0] == "redelivered":
            return (True, True, outcome[1], outcome[2], ())
        return outcome

    def decide(
        self,
        specs: Sequence[Spec],
        *,
        now: float,
        costs: Sequence[float],
        max_wait_us: float = 0,
        acq: str | None = None,
        record: str | None = None,
        lease_us: float = 300_000_000,
        holds: Sequence[float] = (),
    ) -> Summary:
        """acquire.lua on ``specs``, with ``acq`` the acquisition id (the concurrency holder)
        and ``record`` the name of its lease record; ``holds``: each limit's hold, until (us).

        -> ``("mismatch",)``, ``("voided", i, retry_us)`` (limit number i, from 1),
        ``("redelivered", wait_us, retry_us, reserved costs)``, or the decision:
        (allowed, False, wait_us, retry_us, per-limit (allowed, remaining, retry, reset))."""
        holds = tuple(holds) or (0.0,) * len(specs)
        if record is not None:
            held = self.records.get(record)
            if held is not None and not held.settled:
                if held.keys != tuple(key for _, _, key in specs):
                    return ("mismatch",)
                for i, hold in enumerate(holds, start=1):
                    if hold > held.slot and hold > now:
                        return ("voided", i, ceil_us(hold - now))
                return (
                    "redelivered",
                    ceil_us(held.slot - now),
                    ceil_us(now - held.slot),
                    held.costs,
                )
        checks = []
        for (code, p, key), c, hold in zip(specs, costs, holds, strict=True):
            algo = self.algos[code]
            if hold > now:
                # A held limit denies without reading its state.
                r: Check = {"allowed": 0, "wait": 0, "retry": ceil_us(hold - now)}
                r.update(remaining=0.0, reset=0)
            else:
                r = algo.check(key, p, now, c, max_wait_us)
            checks.append((algo, key, p, r))
        allowed = all(r["allowed"] for *_, r in checks)
        wait = max(r["wait"] for *_, r in checks)
        retry = max(max(r["retry"], r["wait"]) for *_, r in checks)
        # The earliest time every limit conforms; a window denies a slot past its window.
        slot = now + wait
        if allowed and wait > 0:
            for algo, _, p, r in checks:
                ends = getattr(algo, "ends", None)
                if ends is not None and slot >= ends(p, r):
                    allowed, r["allowed"], r["retry"] = False, 0, wait
        if allowed:
            marks = tuple(
                algo.commit(
                    key,
                    p,
                    now,
                    c,
                    r,
                    holder=acq or "",
                    expiry=slot + lease_us,
                    at=slot if slot > now + r["wait"] else None,
                )
                for (algo, key, p, r), c in zip(checks, costs, strict=True)
            )
            if record is not None:
                keys = tuple(key for _, _, key in specs)
                self.records[record] = Record(False, tuple(costs), slot, keys, marks)
            retry = 0
        else:
            wait = 0
            for (algo, key, p, r), c in zip(checks, costs, strict=True):
                if not r["allowed"] and "mode" in r and isinstance(algo, Fair):
                    algo.deny(key, p, now, c, r)
        per_limit = tuple(
            (bool(r["allowed"]), r["remaining"], r["retry"], r["reset"]) for *_, r in checks
        )
        return (allowed, False, wait, retry, per_limit)

    def settle(
        self,
        acq: str,
        targets: list[tuple[Limit, str]],
        *,
        now: int,
        actual: float | list[float | None] | None,
    ) -> tuple[str, tuple[float, ...]]:
        actuals = actual if isinstance(actual, list) else [actual] * len(targets)
        return self.finish(acq, acq, _specs(targets), now=now, actuals=actuals)

    def finish(
        self,
        record_name: str,
        holder: str,
        specs: Sequence[Spec],
        *,
        now: float,
        actuals: Sequence[float | None],
    ) -> tuple[str, tuple[float, ...]]:
        """settle.lua: the record ``record_name`` of holder ``holder`` settled at ``actuals``
        (None: as reserved) -> (status, deltas)."""
        record = self.records.get(record_name)
        if record is None:
            return ("unknown", ())
        if record.settled:
            return ("already_settled", ())
        if record.keys != tuple(key for _, _, key in specs):
            return ("mismatch", ())
        deltas = tuple(
            0.0 if a is None else a - c for a, c in zip(actuals, record.costs, strict=True)
        )
        for (code, p, key), mark, delta in zip(specs, record.marks, deltas, strict=True):
            if delta != 0 or code == "conc":
                self.algos[code].adjust(key, p, now, delta, mark, holder)
        record.settled = True
        return ("settled", deltas)


_SETTLE_CODES = {"settled": b"0", "already_settled": b"1", "unknown": b"2", "mismatch": b"3"}
_NKEYS = {"conc": 2, "fair": 3}  # state keys per limit (ALGO[code].nkeys): 1 for the others


_GAP_US = 1_000_000.0


def adapt(state: dict[str, float], now: float, argv: Sequence[str]) -> str:
    """The model of lua/adapt.lua: ``state`` (its HASH's fields as numbers, changed in
    place), ``now`` in us, ``argv`` its ARGV from the event on (ARGV[2:]). Returns its
    reply. The same operations in the same order as the script."""
    event = argv[0]
    ceiling = float(argv[1])
    adaptive = argv[2] == "1"
    floor = min(float(argv[3]), ceiling)
    decrease, recover_us = float(argv[4]), float(argv[5])
    episode_us, persist_count, persist_us = float(argv[6]), float(argv[7]), float(argv[8])
    m, p, s, e = state.get("m"), state.get("p", 0.0), state.get("s"), state.get("e")
    w, c = state.get("w"), state.get("c", 0.0)

    def clamp(rate: float) -> float:
        return max(floor, min(ceiling, rate))

    def learned() -> float:
        if not adaptive or m is None:
            return ceiling
        x = 1 - p / recover_us
        return clamp(m * (1 - (1 - decrease) * x * x * x))

    decreased = persist = 0
    rate = learned()
    writes: dict[str, float] | None = None
    if event == "refuse":
        if w is None or now - w > persist_us:
            w, c = now, 0.0
        c = c + 1
        if c >= persist_count:
            persist = 1
        writes = {"w": w, "c": c}
        if adaptive and (e is None or now >= e):
            m, p, e = rate, 0.0, now + episode_us
            s = e
            rate = clamp(m * decrease)
            decreased = 1
            writes.update(m=m, p=p, e=e, s=s)
    elif event == "success" and adaptive and m is not None:
        if now >= (e or 0):
            gap = now - (now if s is None else s)
            if gap > 0:
                p = p + min(gap, _GAP_US)
                rate = learned()
            s = now
            writes = {"p": p, "s": s}
    elif event == "state" and adaptive:
        m = clamp(float(argv[9]))
        p, s, e = recover_us, now, now
        rate = m
        writes = {"m": m, "p": p, "s": s, "e": e}
    if writes is not None:
        if adaptive:
            writes["r"] = rate
        state.update(writes)
    return f"{rate:.6f} {decreased} {persist} {int(c)}"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


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
        self.spaced: dict[str, float] = {}  # spacing guard key -> next call at (us)
        self.learned: dict[str, dict[str, float]] = {}  # lua/adapt.lua's states

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

    def expire(self, key: str, seconds: Any) -> bool:
        return key in self.hashes  # counts for people: kept for the life of the object

    def pipeline(self, transaction: bool = True) -> _Pipeline:
        return _Pipeline(self)

    def close(self) -> None:
        """Nothing to close (the same call as a redis-py client's)."""

    def clear(self) -> None:
        """Forget every state, hold, lease record and hash: a fresh server."""
        with self.lock:
            self.model = ModelLimiter()
            self.holds.clear()
            self.hashes.clear()
            self.spaced.clear()

    # -- the scripts

    def operation_of(self, source: str) -> tuple[str, str | None]:
        """The operation of a script's source (as composed by throttle.redis.scripts),
        and the algorithm code of a one-limit acquire."""
        known = _known_sources()
        if source not in known:
            raise BackendError("the memory limiter cannot run this script (not one of lua/)")
        return known[source]

    def _now(self, explicit: Any) -> float:
        number = _number(explicit)
        return float(self.clock_us()) if number is None else number

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
            return f"4 {outcome[1]} {outcome[2]}".encode()
        if outcome[0] == "redelivered":
            _, wait, retry, reserved = outcome
            return " ".join(["1", "1", str(wait), str(retry), *map(repr, reserved)]).encode()
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
        status, deltas = self.model.finish(record, holder, specs, now=now, actuals=actuals)
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
        return f"0 {allowed} {now_state['remaining']!r} {retry} {now_state['reset']}".encode()

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
        at = max([now, *(self.spaced.get(key, now) for key in keys)])
        for key, spacing in zip(keys, args[2:], strict=False):
            self.spaced[key] = at + float(_text(spacing))
        return ceil_us(at - now)

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
            known[script_source("acquire_one", frozenset((code,)))] = ("acquire_one", code)
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


class MemoryLimiter(Limiter):
    """A :class:`~throttle.limiter.Limiter` whose Redis is a :class:`MemoryRedis`: the same
    checks, keys, decisions and settlements, computed in this process by the models of the
    scripts (proven equal to them: ``tests/integration/test_model.py``).

    Parameters
    ----------
    prefix, namespace:
        As :class:`~throttle.limiter.Limiter`'s (several limiters may share one ``server``).
    clock_us:
        As :class:`~throttle.limiter.Limiter`'s: "now" in us sent with every call; default
        the server's clock.
    server:
        The store (default a new :class:`MemoryRedis` on this host's wall clock).

    Warning
    -------
    One process only: two processes, or two ``MemoryLimiter`` objects without a shared
    ``server``, each count alone. Lease records and holds live on the server's clock.
    """

    def __init__(
        self,
        *,
        prefix: str = "throttle",
        namespace: str = "default",
        clock_us: Callable[[], int] | None = None,
        server: MemoryRedis | None = None,
    ) -> None:
        self.server = server if server is not None else MemoryRedis()
        # The client type is redis-py's; the memory server answers what the limiter sends.
        client: RedisClient = self.server  # type: ignore[assignment]
        super().__init__(client, prefix=prefix, namespace=namespace, clock_us=clock_us)
