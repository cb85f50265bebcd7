"""A bursty limit keeps ``burst_margin`` of its refill in hand in workers
(:meth:`throttle.Limit.with_margin`): the first calls of a busy period may reach an
upstream that enforces exactly the same limit late, without the calls after the burst
being refused there."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from celery import Celery

from tests.support.clock import FakeClock
from tests.support.eager import close_throttler
from throttle import Limit, Limiter
from throttle.celery.gate import Gate
from throttle.celery.runtime import Throttler
from throttle.rules import kept_in_hand
from workers.mock_api import UpstreamLimit


def slots(limiter: Limiter, limit: Limit, n: int) -> list[float]:
    """The slots (s from now) of ``n`` calls that arrive at once, each reserving."""
    found = []
    for _ in range(n):
        decision = limiter.acquire_many([(limit, "k")], max_wait_s=60.0)
        assert decision.allowed
        found.append(decision.wait_s)
    return found


def refused_upstream(slots_s: list[float], late_s: float, rate: float, burst: float) -> int:
    """How many of the calls an upstream enforcing ``rate`` and ``burst`` exactly refuses
    when the calls admitted at once arrive ``late_s`` after their slot (the pool starting
    them) and the others on their slot (they slept to it)."""
    upstream = UpstreamLimit(rate, burst)
    upstream.stamp = 0.0
    arrivals = sorted(s + (late_s if s == 0 else 0.0) for s in slots_s)
    return sum(not upstream.take(at)[0] for at in arrivals)


@pytest.mark.parametrize("algorithm", ["gcra", "token_bucket"])
def test_late_first_calls_cost_no_refusal_within_the_margin(
    clocked: Limiter, clock: FakeClock, algorithm: str
) -> None:
    limit = Limit.parse("10/s burst 5", name=f"api-{algorithm}", algorithm=algorithm)
    # The whole burst at once: the first five arrive 40 ms late, the sixth on its slot
    # 0.1 s later finds the upstream's bucket 0.4 of a token short
    assert refused_upstream(slots(clocked, limit, 30), 0.04, 10, 5) == 1
    clock.advance(10)  # idle again: a full bucket
    # With 50 ms kept in hand: four at once, the fifth 50 ms later, none refused
    margined = limit.with_margin(0.05)
    found = slots(clocked, margined, 30)
    assert found[:5] == [0, 0, 0, 0, pytest.approx(0.05)]
    assert refused_upstream(found, 0.04, 10, 5) == 0
    clock.advance(10)
    # Later than the margin, the margin no longer covers it
    assert refused_upstream(slots(clocked, margined, 30), 0.07, 10, 5) == 1
    # The sustained rate is the limit's: the 30th call 2.5 s after the first in both
    clock.advance(10)
    assert slots(clocked, limit, 30)[-1] == pytest.approx(2.5)
    clock.advance(10)
    assert slots(clocked, margined, 30)[-1] == pytest.approx(2.5 + 0.05)


def test_what_the_margin_changes() -> None:
    limit = Limit.parse("50/s burst 25", name="api", algorithm="gcra")
    margined = limit.with_margin(0.05)
    assert (margined.burst, margined.count, margined.period_s) == (22.5, 50, 1)
    assert limit.with_margin(0.05) is margined  # kept: a worker asks on every task
    assert limit.with_margin(0) is limit
    # never less than half the burst beyond 1: 500/s burst 25 keeps 13 (a margin of 24 ms)
    assert Limit.parse("500/s burst 25", name="api").with_margin(0.05).burst == 13.0
    assert Limit.parse("50/s burst 2", name="api").with_margin(0.05).burst == 1.5
    # Nothing to keep: strict spacing, windows, concurrency, fair limits
    for unchanged in (
        Limit.parse("50/s burst 1", name="api", algorithm="gcra"),
        Limit.parse("50/s", name="api", algorithm="fixed_window"),
        Limit.parse("50/s", name="api", algorithm="sliding_window"),
        Limit.parse("5 concurrent", name="api"),
        Limit.parse("50/s burst 25", name="api", algorithm="gcra", fair=True),
    ):
        assert unchanged.with_margin(0.05) is unchanged
    # A task whose cost is above the margined burst takes its cost as the burst
    (tokens, _, _), (other, _, _) = kept_in_hand([(limit, None, 24.0), (limit, None, 26.0)], 0.05)
    assert (tokens.burst, other.burst) == (24.0, 25.0)


@pytest.fixture
def app(redis_url: str, prefix: str) -> Iterator[Celery]:
    app = Celery("margin", set_as_current=False)
    app.conf.update(
        throttle_redis_url=redis_url,
        throttle_config={
            "settings": {"prefix": prefix},
            "limits": {"api": {"algorithm": "gcra", "rate": "10/s", "burst": 5}},
            "tasks": {"margin.call": ["api"]},
        },
    )  # fmt: skip
    yield app
    close_throttler(app)


def evaluated_burst(app: Celery, eager: bool) -> float:
    call = app.tasks["margin.call"]
    call.push_request(id="t", headers={}, delivery_info={}, called_directly=False, is_eager=eager)
    try:
        gate = Gate(call, None, call.run, (), {})
        gate.evaluate()
        return gate.execution.targets[0][0].capacity
    finally:
        call.pop_request()


def test_workers_keep_the_setting_in_hand_and_eager_calls_take_the_whole_burst(
    app: Celery,
) -> None:
    @app.task(name="margin.call", shared=False)
    def call() -> None: ...

    assert Throttler.of(app).settings.burst_margin_s == 0.1  # the default
    assert evaluated_burst(app, eager=False) == 4.0
    assert evaluated_burst(app, eager=True) == 5.0
