"""The model of lua/fixed_window.lua: the window index, its count and the period it counts
in (us), per key."""

from __future__ import annotations

import math
from typing import Any

from throttle.memory.prelude import Check, Params, ceil_us


class FixedWindow:
    def __init__(self) -> None:
        self.state: dict[str, tuple[float, float, float]] = {}

    def read(self, key: str, p: Params, now: float) -> tuple[float, float]:
        w = float(math.floor(now / p.period_us))
        stored = self.state.get(key)
        if stored is None:
            return w, 0.0
        stored_w, n, period_us = stored
        if period_us != p.period_us:  # the period changed: counted while its window runs
            return w, (n if (stored_w + 1) * period_us > now else 0.0)
        if stored_w < w:
            return w, 0.0
        return stored_w, n  # the same window, or a later one (the clock stepped back)

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
        self.state[key] = (r["w"], r["n"] + cost, p.period_us)
        return repr(r["w"])

    def ends(self, p: Params, r: Check) -> float:
        """When the admission of ``r`` stops holding: the end of its window (us)."""
        return float((r["w"] + 1) * p.period_us)

    def adjust(self, key: str, p: Params, now: float, delta: float, mark: str, holder: str) -> None:
        w, n = self.read(key, p, now)
        if delta < 0 and float(mark) != w:
            return
        self.state[key] = (w, max(n + delta, 0.0), p.period_us)
