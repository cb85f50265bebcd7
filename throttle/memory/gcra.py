"""The model of lua/gcra.lua: the theoretical arrival time (TAT, us), per key, and the
emission interval it was written under: a rate raised since shortens the debt ahead of now
in proportion, as the script does (a key moved to a faster plan, a rate set or cleared)."""

from __future__ import annotations

from typing import Any

from throttle.memory.prelude import Check, Params, ceil_us


class Gcra:
    def __init__(self) -> None:
        self.state: dict[str, tuple[float, float]] = {}
        """key -> (TAT, the interval T it was written under), both us."""

    def tat(self, key: str, now: float, interval: float) -> float:
        stored = self.state.get(key)
        if stored is None:
            return now
        tat, was = stored
        if interval < was and tat > now:
            # Stored at once, denied or not, as the script does: the debt converted once.
            tat = now + (tat - now) * interval / was
            self.state[key] = (tat, interval)
        return now if tat < now else tat

    def check(self, key: str, p: Params, now: float, cost: float, max_wait: float) -> Check:
        interval = p.period_us / p.count
        tat = self.tat(key, now, interval)
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
        interval = p.period_us / p.count
        if at is not None and at > r["tat"]:
            # cost * period_us / count, not cost * interval: the script's order of the
            # operations (the two may round apart, and the TAT with them)
            new_tat = at + cost * p.period_us / p.count
            r["reset"] = ceil_us(new_tat - now)
            r["remaining"] = max(p.burst - (new_tat - now) / interval, 0.0)
        self.state[key] = (new_tat, interval)
        return ""

    def adjust(self, key: str, p: Params, now: float, delta: float, mark: str, holder: str) -> None:
        interval = p.period_us / p.count
        tat = self.tat(key, now, interval)
        self.state[key] = (max(now, tat + delta * p.period_us / p.count), interval)
