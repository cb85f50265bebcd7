"""The model of lua/concurrency.lua: each holder's lease (expiry, units) and the units
held, per key."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from throttle.memory.prelude import Check, Params, ceil_us


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
        self, key: str, p: Params, now: float, cost: float, r: Check, *, holder: str,
        expiry: float, **_: Any,
    ) -> str:  # fmt: skip
        # ``at`` does not matter: the expiry already counts from the slot (as in the script).
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
