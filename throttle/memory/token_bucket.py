"""The model of lua/token_bucket.lua: tokens and the time they were counted, per key."""

from __future__ import annotations

from typing import Any

from throttle.memory.prelude import Check, Params, ceil_us


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
