"""Invariants of each algorithm, on the reference models.

tests/integration/test_model.py proves that every script computes exactly what its model
computes; it cannot see a mistake the two share. These properties check the models (and so
the scripts) against what each limit promises, over random sequences of calls with costs,
reservations, refunds and clock steps back. Pure Python: thousands of examples in seconds.
"""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from tests.support.clock import EPOCH_US
from tests.support.model import ModelLimiter
from throttle import Limit

SLACK = 1e-6  # tokens: float rounding over a few dozen additions

counts = st.sampled_from([1.0, 2.0, 3.0, 2.5, 7.0, 100.0])
whole_counts = st.sampled_from([1.0, 2.0, 3.0, 7.0, 100.0])  # tasks in flight: concurrency
periods_s = st.sampled_from([0.05, 1.0, 3.0, 60.0])
bursts = st.sampled_from([None, 1.0, 1.5, 4.0])


def calls(period_us: float, capacity: float) -> st.SearchStrategy[list[tuple[int, float, int]]]:
    """(time step in us, cost, max_wait in us) triples."""
    return st.lists(
        st.tuples(
            st.one_of(st.just(0), st.integers(0, 2_000), st.integers(0, int(2 * period_us))),
            st.one_of(st.just(1.0), st.floats(0.0, capacity, allow_nan=False)),
            st.one_of(st.just(0), st.integers(0, int(3 * period_us))),
        ),
        max_size=60,
    )


@given(data=st.data(), algorithm=st.sampled_from(["token_bucket", "gcra"]))
def test_buckets_never_admit_more_than_burst_plus_rate_times_time(
    data: st.DataObject, algorithm: str
) -> None:
    limit = Limit("l", algorithm, data.draw(counts), data.draw(periods_s), data.draw(bursts))  # type: ignore[arg-type]
    period_us = limit.period_s * 1e6
    model, now = ModelLimiter(), EPOCH_US
    admitted: list[tuple[float, float]] = []  # (slot time in us, cost)
    for step, cost, max_wait in data.draw(calls(period_us, limit.capacity)):
        now += step
        allowed, _, wait, _, _ = model.acquire(
            [(limit, "k")], now=now, cost=cost, max_wait_us=max_wait
        )
        if allowed:
            admitted.append((now + wait, cost))
    # Over any span between two slots, the cost admitted fits the bucket.
    rate_per_us = limit.count / period_us
    slots = sorted(admitted)
    for i, (start, _) in enumerate(slots):
        total = 0.0
        for end, cost in slots[i:]:
            total += cost
            bound = limit.capacity + rate_per_us * (end - start)
            # Reserved slots are rounded up to whole us: one us of rate per call.
            assert total <= bound + SLACK + rate_per_us * len(slots), (start, end, total, bound)


@given(
    data=st.data(),
    algorithm=st.sampled_from(["fixed_window", "sliding_window"]),
    back=st.booleans(),
)
def test_windows_never_admit_more_than_count_per_window(
    data: st.DataObject, algorithm: str, back: bool
) -> None:
    limit = Limit("l", algorithm, data.draw(counts), data.draw(periods_s))  # type: ignore[arg-type]
    period_us = limit.period_s * 1e6
    model, now = ModelLimiter(), EPOCH_US
    per_window: dict[int, float] = {}
    latest = -math.inf  # the latest time the limiter has seen
    for step, cost, _ in data.draw(calls(period_us, limit.capacity)):
        # Optionally let Redis TIME step back by up to a period.
        now += -step if back and step % 3 == 0 else step
        allowed, *_ = model.acquire([(limit, "k")], now=now, cost=cost)
        latest = max(latest, now)
        if allowed:
            # Cost counts in the latest window reached: a step back must not reopen one.
            window = math.floor(latest / period_us)
            per_window[window] = per_window.get(window, 0.0) + cost
    assert all(total <= limit.count + SLACK for total in per_window.values()), per_window


@given(data=st.data())
def test_concurrency_never_holds_more_than_count(data: st.DataObject) -> None:
    limit = Limit("l", "concurrency", data.draw(whole_counts))  # type: ignore[arg-type]
    model, now = ModelLimiter(), EPOCH_US
    holding: dict[str, tuple[float, float]] = {}  # id: (lease end, cost)
    steps = data.draw(
        st.lists(
            st.tuples(
                st.integers(0, 5_000_000),
                st.floats(0.0, limit.capacity, allow_nan=False),
                st.integers(1_000_000, 10_000_000),
                st.booleans(),
            ),
            max_size=60,
        )
    )
    for i, (step, cost, lease_us, release) in enumerate(steps):
        now += step
        if release and holding:
            holder = sorted(holding)[i % len(holding)]
            model.settle(holder, [(limit, "k")], now=now, actual=None)
            del holding[holder]
        allowed, *_ = model.acquire(
            [(limit, "k")], now=now, cost=cost, acq=f"h{i}", lease_us=lease_us
        )
        if allowed:
            holding[f"h{i}"] = (now + lease_us, cost)
        live = sum(c for end, c in holding.values() if end > now)
        assert live <= limit.count + SLACK, (live, holding)
