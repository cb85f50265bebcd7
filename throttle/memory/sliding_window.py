"""The model of lua/sliding_window.lua: the window index, its count, the previous window's
and the period they count in (us), per key."""

from __future__ import annotations

import math
from typing import Any

from throttle.memory.prelude import Check, Params, ceil_us


class SlidingWindow:
    def __init__(self) -> None:
        self.state: dict[str, tuple[float, float, float, float]] = {}

    def read(self, key: str, p: Params, now: float) -> tuple[float, float, float]:
        w = float(math.floor(now / p.period_us))
        stored = self.state.get(key)
        if stored is None:
            return w, 0.0, 0.0
        stored_w, cur, prev, period_us = stored
        if period_us != p.period_us:  # the period changed: counted while its window runs
            return w, (cur if (stored_w + 1) * period_us > now else 0.0), 0.0
        if stored_w < w - 1:
            return w, 0.0, 0.0
        if stored_w == w - 1:
            return w, 0.0, cur
        return stored_w, cur, prev  # the same window, or a later one (the clock stepped back)

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
        self.state[key] = (r["w"], r["cur"] + cost, r["prev"], p.period_us)
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
        self.state[key] = (w, cur, prev, p.period_us)
