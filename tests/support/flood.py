"""A flood of tasks through the Limiter on the test clock, as the Celery gate acquires.

Each task asks at its arrival time with a reservation horizon (the gate's, a day); an
allowed task runs at its slot, a denied one comes back after ``retry_after_s`` plus a
jitter drawn as the gate draws it (a seeded generator: the run is deterministic; none
after a fair limit's denial, as the gate).
Events are taken in time order, so the script sees the calls a fleet would make, on one
clock, without a worker.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Mapping, Sequence

from tests.support.clock import FakeClock
from throttle import Limit, Limiter

DAY_S = 86400.0


def flood(
    limiter: Limiter,
    clock: FakeClock,
    limit: Limit,
    arrivals: Mapping[str, Sequence[float]],
    *,
    jitter_s: float = 1.0,
    seed: int = 1,
) -> dict[str, list[float]]:
    """Run every task of ``arrivals`` (key -> arrival times in s from now) to its slot;
    returns key -> the slots its tasks got, in s from the start, sorted. A limit that is
    not fair is acquired without a key: one state shared by every key, first come first
    served (today's shared limit)."""
    rng = random.Random(seed)
    start_us = clock.now_us
    events: list[tuple[int, int, str]] = []
    for key, times in arrivals.items():
        for t in times:
            events.append((start_us + round(t * 1e6), len(events), key))
    heapq.heapify(events)
    slots: dict[str, list[float]] = {key: [] for key in arrivals}
    order = len(events)
    while events:
        at_us, _, key = heapq.heappop(events)
        clock.now_us = max(clock.now_us, at_us)
        decision = limiter.acquire(limit, key if limit.fair else None, max_wait_s=DAY_S)
        if decision.allowed:
            slots[key].append((clock.now_us - start_us) / 1e6 + decision.wait_s)
            continue
        retry = decision.retry_after_s
        jitter = 0.0 if limit.fair else rng.uniform(0.0, min(jitter_s, max(retry, 0.05)))
        back = retry + jitter
        order += 1
        heapq.heappush(events, (clock.now_us + round(back * 1e6), order, key))
    return {key: sorted(times) for key, times in slots.items()}


def rate_between(slots: Sequence[float], start_s: float, end_s: float) -> float:
    """Slots per second in [start_s, end_s)."""
    return sum(start_s <= s < end_s for s in slots) / (end_s - start_s)
