"""Pure-Python reference models of the Lua limiters, for property tests.

Each model keeps its state in a dict instead of Redis and performs the same floating-point
operations in the same order as the scripts in lua/, so that a script and its model fed
the same (time, cost) sequence must agree exactly: decisions, remaining, retry_after and
reset. Missing state reads as it does in Lua (a full bucket, an empty window); key expiry
is not modelled because a key only expires once its state reads like a missing key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from throttle.redis.wire import limit_args
from throttle.spec import Limit


def ceil_us(x: float) -> int:
    return 0 if x <= 0 else math.ceil(x)


@dataclass
class Params:
    count: float
    period_us: float
    burst: float

    @classmethod
    def of(cls, limit: Limit) -> Params:
        _, count, period_us, burst = limit_args(limit)  # exactly what the script receives
        return cls(float(count), float(period_us), float(burst))


Check = dict[str, Any]


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

    def commit(self, key: str, p: Params, now: float, cost: float, r: Check, **_: Any) -> str:
        self.state[key] = (r["tokens"] - cost, r["ts"])
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
        r: Check = {"new_tat": new_tat, "allowed": 0, "wait": 0, "retry": 0}
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

    def commit(self, key: str, p: Params, now: float, cost: float, r: Check, **_: Any) -> str:
        self.state[key] = r["new_tat"]
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
        self, key: str, p: Params, now: float, cost: float, r: Check, *, holder: str, expiry: float
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


@dataclass
class Record:
    settled: bool
    costs: tuple[float, ...]
    slot: float
    keys: tuple[str, ...]
    marks: tuple[str, ...]


Summary = tuple[Any, ...]


class ModelLimiter:
    """The acquire/settle operations of lua/acquire.lua and lua/settle.lua, in Python.

    ``targets`` are (limit, state_key) pairs: the caller supplies the key names.
    """

    def __init__(self) -> None:
        self.algos: dict[str, Any] = {
            "tb": TokenBucket(),
            "gcra": Gcra(),
            "fw": FixedWindow(),
            "sw": SlidingWindow(),
            "conc": Concurrency(),
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
        if acq is not None:
            record = self.records.get(acq)
            if record is not None and not record.settled:
                if record.keys != tuple(key for _, key in targets):
                    return ("mismatch",)
                return (True, True, ceil_us(record.slot - now), ceil_us(now - record.slot), ())
        costs = cost if isinstance(cost, list) else [cost] * len(targets)
        checks = []
        for (limit, key), c in zip(targets, costs, strict=True):
            algo = self.algos[limit.code]
            p = Params.of(limit)
            checks.append((algo, key, p, algo.check(key, p, now, c, max_wait_us)))
        allowed = all(r["allowed"] for *_, r in checks)
        wait = max(r["wait"] for *_, r in checks)
        retry = max(max(r["retry"], r["wait"]) for *_, r in checks)
        if allowed:
            slot = now + wait
            marks = tuple(
                algo.commit(key, p, now, c, r, holder=acq or "", expiry=slot + lease_us)
                for (algo, key, p, r), c in zip(checks, costs, strict=True)
            )
            if acq is not None:
                keys = tuple(key for _, key in targets)
                self.records[acq] = Record(False, tuple(costs), slot, keys, marks)
            retry = 0
        else:
            wait = 0
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
        record = self.records.get(acq)
        if record is None:
            return ("unknown", ())
        if record.settled:
            return ("already_settled", ())
        if record.keys != tuple(key for _, key in targets):
            return ("mismatch", ())
        actuals = actual if isinstance(actual, list) else [actual] * len(targets)
        deltas = tuple(
            0.0 if a is None else a - c for a, c in zip(actuals, record.costs, strict=True)
        )
        for (limit, key), mark, delta in zip(targets, record.marks, deltas, strict=True):
            code = limit.code
            if delta != 0 or code == "conc":
                self.algos[code].adjust(key, Params.of(limit), now, delta, mark, acq)
        record.settled = True
        return ("settled", deltas)
