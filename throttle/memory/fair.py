"""The model of lua/fair.lua: a limit's total schedule and active keys, each key's own."""

from __future__ import annotations

from typing import Any

from throttle.memory.prelude import Check, Params, ceil_us
from throttle.spec import FAIR_NEAR_S


class Fair:
    """lua/fair.lua. ``key`` is the key's state key; the limit's shared HASH and its ZSET
    of active keys are named after it as the key space names them (the name up to its
    last ``:``, and that + ``:a``)."""

    HORIZON_US = FAIR_NEAR_S * 1e6
    """The shortest near horizon (us): how far ahead a slot is reserved and a key's
    schedule may run (``burst + 1`` turns of a slower limit)."""
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
        was = shared.get("T")  # the interval the schedules were written under
        scale = interval / was if was is not None and interval < was else None
        t = shared.get("t", now)
        if scale is not None and t > now:  # a rate raised since: the debt ahead shrinks
            t = now + (t - now) * scale
        t = max(t, now)
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
        if key in self.keys and scale is not None:
            tk = now + (tk - now) * scale if tk > now else tk
            plan = now + (plan - now) * scale if plan > now else plan
        key_interval = interval * total / w
        slot = max(now, t + (cost - burst) * interval)
        near = max(self.HORIZON_US, (burst + 1) * interval)
        due = max(tk, now) + (cost - 1) * key_interval - near
        horizon = min(max_wait, near)
        wait: float = 0
        retry: float = 0
        mode, allowed, after, start = 3, 0, t, plan
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
            "key_interval": key_interval, "start": start, "slot": slot, "interval": interval,
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
        shared.update({"t": t, "W": r["sum"], key: w, "T": r["interval"]})
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
