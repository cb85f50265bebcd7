"""The local fallback while Redis is down: a token bucket in one process's memory.

``on_redis_down: local`` keeps a limit roughly in force during an outage: each worker
process admits at ``rate / share`` with a capacity of ``burst / share`` (at least one call),
where ``share`` is the number of processes of the fleet that may run the limit's tasks.
Nothing here knows Redis or Celery; the Celery layer counts the processes and decides
what to do with a denial::

    from throttle.fallback import LocalBuckets

    buckets = LocalBuckets()
    wait_s = buckets.take([(limit, None, 1.0)], share=8, now=time.monotonic())
    if wait_s == 0.0: ...  # admitted; else nothing was taken, come back in wait_s

Warning: the bound holds only while ``share`` is right. A fleet that grew since the count
is over-admitted (by the ratio of the two sizes), one that shrank runs under its rate; and
the processes' buckets start full, so an outage may begin with up to one burst (as the
limit's own burst, split across the processes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from throttle.spec import Limit

__all__ = ["LocalBucket", "LocalBuckets"]


@dataclass
class LocalBucket:
    """A token bucket: ``capacity`` tokens, refilled at ``rate_per_s``, on a monotonic clock
    (seconds). Answers the two questions of a bucket: may I, and how long until I may."""

    rate_per_s: float
    capacity: float
    tokens: float
    at: float

    def wait_s(self, cost: float, now: float) -> float:
        """Seconds until ``cost`` tokens are there (0: now); takes nothing."""
        self._refill(now)
        missing = min(cost, self.capacity) - self.tokens
        return max(missing, 0.0) / self.rate_per_s

    def take(self, cost: float, now: float) -> None:
        """Take ``cost`` tokens (a cost above the capacity takes the whole bucket)."""
        self._refill(now)
        self.tokens -= min(cost, self.capacity)

    def _refill(self, now: float) -> None:
        if now > self.at:
            self.tokens = min(self.capacity, self.tokens + (now - self.at) * self.rate_per_s)
            self.at = now


class LocalBuckets:
    """One process's buckets, per (limit, key, share): all-or-nothing over several limits.

    A change of ``share`` (the fleet's size, counted again at the next outage) starts new
    buckets; so does a rate changed at run time (the :class:`Limit` differs)."""

    def __init__(self) -> None:
        self._buckets: dict[tuple[Limit, str | None, int], LocalBucket] = {}

    def take(
        self, targets: Sequence[tuple[Limit, str | None, float]], share: int, now: float
    ) -> float:
        """Take every target's cost now and return 0.0, or take nothing and return the
        seconds until all of them could be taken. ``share`` >= 1: the processes that split
        each limit; ``now``: a monotonic clock in seconds."""
        if share < 1:
            raise ValueError(f"share must be >= 1 (got {share!r})")
        buckets = [(self._bucket(limit, key, share, now), cost) for limit, key, cost in targets]
        wait = max((bucket.wait_s(cost, now) for bucket, cost in buckets), default=0.0)
        if wait == 0.0:
            for bucket, cost in buckets:
                bucket.take(cost, now)
        return wait

    def clear(self) -> None:
        """Forget every bucket (Redis is back: the next outage starts afresh)."""
        self._buckets.clear()

    def _bucket(self, limit: Limit, key: str | None, share: int, now: float) -> LocalBucket:
        bucket = self._buckets.get((limit, key, share))
        if bucket is None:
            rate = limit.count / limit.period_s / share
            # At least one call of capacity: below it no call of cost 1 could ever pass.
            capacity = max(limit.capacity / share, 1.0)
            bucket = LocalBucket(rate, capacity, capacity, now)
            self._buckets[(limit, key, share)] = bucket
        return bucket
