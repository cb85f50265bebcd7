"""The Redis clock, read from a worker: every time the throttler keeps is Redis time.

Limits decide on Redis ``TIME`` inside their scripts, but a worker also needs "now" on that
clock outside them: the deadline a task carries from one worker to another, when a parked
task is due. A worker's own wall clock may be off by seconds (a host whose NTP is off), and
a time it wrote into a message would be read by another worker with another error. So
:class:`RedisClock` measures this process's offset to Redis with ``TIME`` round trips
(the one with the shortest round trip wins; the error of the offset is at most half that
round trip), anchors it on the monotonic clock (which a wall-clock step does not move),
and measures again every :data:`REFRESH_S`.

Example::

    clock = RedisClock(client)
    deadline = clock.now() + 60.0       # Redis epoch s: any worker can compare it
    clock.offset_s, clock.error_s       # Redis minus this host's wall clock, and its bound
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from throttle.errors import BackendError
from throttle.redis.client import RedisClient, wrap_errors

__all__ = [
    "REFRESH_S",
    "ClockRecord",
    "RedisClock",
    "forget_clock",
    "read_clocks",
    "record_clock",
]

REFRESH_S = 60.0
"""How often (s) a process measures its offset to the Redis clock again."""
SAMPLES = 3
"""``TIME`` round trips per measurement: the shortest gives the offset."""


class RedisClock:
    """Now on the Redis clock, in epoch s, from this process's monotonic clock.

    Parameters
    ----------
    client:
        The limiter's Redis (a Redis Cluster answers ``TIME`` from one of its nodes).
    wall, monotonic:
        Tests only: this host's wall clock and monotonic clock, in s.
    """

    def __init__(
        self,
        client: RedisClient,
        *,
        wall: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self._wall = wall
        self._monotonic = monotonic
        self._anchor: tuple[float, float] | None = None  # (Redis epoch s, monotonic s)
        self._measured_at = -math.inf  # monotonic s of the last attempt
        self.offset_s = 0.0
        """Redis time minus this host's wall clock, in s, as last measured."""
        self.error_s = 0.0
        """The bound of that offset's error: half the round trip of its ``TIME``, in s."""
        self.measured = False
        """Whether a measurement was made (else the offset is a stand-in 0)."""

    def now(self) -> float:
        """Now on the Redis clock, in epoch s (measuring first when due: :data:`SAMPLES`
        round trips a minute). While Redis is away the last measurement goes on, carried
        by the monotonic clock; with none yet, this host's wall clock stands in (nothing
        is decided on the Redis clock during an outage anyway)."""
        mono = self._monotonic()
        if mono - self._measured_at >= REFRESH_S:
            self._measured_at = mono  # tried now: a Redis that is away is asked again later
            with contextlib.suppress(BackendError):
                self.measure()
        if self._anchor is None:
            return self._wall()
        redis_at, mono_at = self._anchor
        return redis_at + (self._monotonic() - mono_at)

    def from_wall(self, wall_s: float) -> float:
        """A time of this host's wall clock (epoch s) on the Redis clock."""
        self.now()  # measured, and fresh
        return wall_s + self.offset_s

    def measure(self) -> float:
        """Measure the offset now; returns it (Redis minus this host's wall clock, s)."""
        best: tuple[float, float, float, float] | None = None  # rtt, redis, mono, wall
        for _ in range(SAMPLES):
            wall0, mono0 = self._wall(), self._monotonic()
            seconds, micros = wrap_errors(self._time)
            mono1, wall1 = self._monotonic(), self._wall()
            rtt = mono1 - mono0
            redis_s = int(seconds) + int(micros) / 1e6
            if best is None or rtt < best[0]:
                best = (rtt, redis_s, (mono0 + mono1) / 2, (wall0 + wall1) / 2)
        assert best is not None
        rtt, redis_s, mono, wall = best
        self._anchor = (redis_s, mono)
        self._measured_at = mono
        self.measured = True
        self.offset_s = redis_s - wall
        self.error_s = rtt / 2
        return self.offset_s

    def _time(self) -> Any:
        reply = self.client.time()
        if isinstance(reply, dict):  # a Redis Cluster may answer for each node it asked
            reply = next(iter(reply.values()))
        return reply


@dataclass(frozen=True)
class ClockRecord:
    """A worker's clock as it last recorded it in Redis (see :meth:`RedisClock.record`)."""

    worker: str
    offset_s: float
    """Redis time minus the worker's wall clock, in s."""
    error_s: float
    """The bound of that offset's error, in s."""
    age_s: float
    """How long ago (Redis clock) the worker recorded it, in s."""


def record_clock(clock: RedisClock, key: str, worker: str) -> None:
    """Write ``worker``'s offset into the HASH ``key`` (field: the worker's name)."""
    value = f"{clock.offset_s:.6f} {clock.error_s:.6f} {clock.now():.3f}"
    wrap_errors(lambda: clock.client.hset(key, worker, value))


def forget_clock(client: RedisClient, key: str, worker: str) -> None:
    """Drop ``worker``'s record from the HASH ``key`` (a worker that stops cleanly: its
    clock no longer says anything)."""
    wrap_errors(lambda: client.hdel(key, worker))


def read_clocks(client: RedisClient, key: str, *, newer_than_s: float) -> list[ClockRecord]:
    """The workers' clocks recorded in the HASH ``key`` within ``newer_than_s``, by name."""
    raw: dict[Any, Any] = wrap_errors(lambda: client.hgetall(key))
    seconds, micros = wrap_errors(client.time)
    now = int(seconds) + int(micros) / 1e6
    found = []
    for name, value in raw.items():
        try:
            offset, error, at = (float(part) for part in _text(value).split())
        except ValueError:
            continue  # not written by record_clock: ignored
        if now - at <= newer_than_s:
            found.append(ClockRecord(_text(name), offset, error, max(now - at, 0.0)))
    return sorted(found, key=lambda record: record.worker)


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value
