"""The test clock: scripts run on it instead of Redis TIME (``Limiter(clock_us=...)``)."""

from __future__ import annotations

import redis

EPOCH_US = 1_763_776_800_000_000  # 2025-11-22 02:00 UTC: a realistic Redis TIME in us


class FakeClock:
    """The test clock handed to ``Limiter(clock_us=...)``: microseconds, moved by hand."""

    def __init__(self, now_us: int = EPOCH_US) -> None:
        self.now_us = now_us

    def __call__(self) -> int:
        return self.now_us

    def advance(self, seconds: float) -> None:
        self.now_us += round(seconds * 1e6)


def redis_now_s(client: redis.Redis) -> float:
    """Redis ``TIME`` in seconds: the clock the scripts run on outside the test clock, to
    state a real-time bound in (how long calls took on this host, however loaded)."""
    seconds, micros = client.time()
    return float(seconds) + micros / 1e6
