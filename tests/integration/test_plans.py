"""What a plan (throttle/celery/plan.py) hands back: a slot the task no longer needs, and
the part of its cost a call did not use; and nothing is planned twice under one task id.

A real redis-server, the limiter on Redis time; a plan of 1/s, so that a slot is a second
and the bounds (0.2 s) leave a loaded host ample room.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import pytest
from celery import Celery

from throttle import Limit, Limiter
from throttle.celery import Throttler
from throttle.celery.execution import Ticket
from throttle.celery.observe import Observer
from throttle.celery.plan import hand_back, plan_id, plan_limit
from throttle.celery.settle import actual_costs, settle

TENANT = Limit.parse("1/s burst 5", name="tenant", algorithm="gcra")
TWIN = plan_limit(TENANT)


def next_slot_s(limiter: Limiter, key: str = "a") -> float:
    """How far ahead the plan of ``key`` runs: the wait of its next cost-1 slot, in s."""
    return limiter.peek(TWIN, key).retry_after_s


def test_a_redelivered_plan_takes_nothing_twice_and_a_dropped_one_is_handed_back(
    limiter: Limiter,
) -> None:
    # The plan is full (5 slots: its burst), then two tasks plan 1 and 2 s ahead
    for n in range(5):
        assert limiter.acquire_many([(TWIN, "a", 1.0)], acquisition_id=plan_id(f"t{n}")).allowed
    first = limiter.acquire_many([(TWIN, "a", 1.0)], max_wait_s=60, acquisition_id=plan_id("t5"))
    second = limiter.acquire_many([(TWIN, "a", 1.0)], max_wait_s=60, acquisition_id=plan_id("t6"))
    assert first.wait_s == pytest.approx(1.0, abs=0.2)
    assert second.wait_s == pytest.approx(2.0, abs=0.2)
    # t6 redelivered (its worker died before re-publishing it): its own plan, nothing new
    again = limiter.acquire_many([(TWIN, "a", 1.0)], max_wait_s=60, acquisition_id=plan_id("t6"))
    assert again.held and again.wait_s == pytest.approx(2.0, abs=0.2)
    assert next_slot_s(limiter) == pytest.approx(3.0, abs=0.2)
    # t6 times out: its slot goes back, the key's next task plans 1 s earlier
    settled = hand_back(limiter, [(TWIN, "a", 1.0)], "t6", [0.0], 60.0)
    assert settled is not None and settled.deltas == (-1.0,)
    assert next_slot_s(limiter) == pytest.approx(2.0, abs=0.2)
    # A task without a plan (never planned, or its record expired) hands back nothing,
    # and takes nothing
    assert hand_back(limiter, [(TWIN, "a", 1.0)], "t9", [0.0], 60.0) is None
    assert next_slot_s(limiter) == pytest.approx(2.0, abs=0.2)
    # Nothing to hand back: no round trip at all
    assert hand_back(limiter, [(TWIN, "a", 1.0)], "t5", [None], 60.0) is None


@pytest.fixture
def throttler(redis_url: str, prefix: str) -> Iterator[Throttler]:
    app = Celery("plans", set_as_current=False)
    app.conf.update(
        throttle_redis_url=redis_url,
        throttle_config={
            "settings": {"prefix": prefix},
            "limits": {
                "tenant": {"algorithm": "gcra", "rate": "1/s", "burst": 5,
                           "key": "{tenant}", "cost": "estimate"},
                "shared": {"algorithm": "gcra", "rate": "100/s", "burst": 5,
                           "cost": "estimate"},
            },
        },
    )  # fmt: skip
    throttler = Throttler.of(app)
    yield throttler
    throttler.limiter.client.close()


def test_a_planned_call_that_cost_less_hands_the_rest_back_to_its_plan(
    throttler: Throttler,
) -> None:
    limiter = throttler.limiter
    tenant, shared = throttler.config.rule("tenant"), throttler.config.rule("shared")
    # A task estimated at 3 planned, then came back and took its real limits
    plan = [(TWIN, "a", 3.0)]
    assert limiter.acquire_many(plan, max_wait_s=60, acquisition_id=plan_id("t1")).allowed
    due = limiter.acquire_many(
        [(tenant.limit, "a", 3.0), (shared.limit, None, 3.0)], acquisition_id="t1", lease_s=60
    )
    assert due.acquisition is not None
    # Its call reported a cost of 1: 2 go back to the real limits and to the plan
    ticket = Ticket(due.acquisition, (tenant, shared), time.time(), {None: 1.0}, plan=plan)
    settle(throttler, ticket, failed=False)
    assert limiter.peek(tenant.limit, "a").remaining == pytest.approx(4.0, abs=0.2)
    assert limiter.peek(TWIN, "a").remaining == pytest.approx(4.0, abs=0.2)


def test_an_admitted_call_settles_its_plan_as_its_limit(throttler: Throttler) -> None:
    # Admitted on arrival, a task takes its plan in the same acquisition: the plan's cost
    # follows its limit's (the reported one, or 0 on error with on_error: refund)
    limiter = throttler.limiter
    tenant, shared = throttler.config.rule("tenant"), throttler.config.rule("shared")
    decision = limiter.acquire_many(
        [(tenant.limit, "a", 3.0), (shared.limit, None, 3.0), (TWIN, "a", 3.0)],
        acquisition_id="t2", lease_s=60,
    )  # fmt: skip
    assert decision.acquisition is not None
    ticket = Ticket(decision.acquisition, (tenant, shared), time.time(), {None: 1.0})
    assert actual_costs(ticket, decision.acquisition, failed=False) == [1.0, 1.0, 1.0]
    # and the refunds counted (metrics, events) are the task's limits', not the plan's
    counted: list[tuple[list[str], list[float]]] = []

    class Counting(Observer):
        def settled(self, limits: Sequence[str], deltas: Sequence[float]) -> None:
            counted.append((list(limits), list(deltas)))

    throttler.observer.add(Counting())
    settle(throttler, ticket, failed=False)
    assert counted == [(["tenant", "shared"], [-2.0, -2.0])]


def test_a_plan_that_refuses_its_hand_back_leaves_the_settle_and_the_body_s_outcome(
    throttler: Throttler, caplog: pytest.LogCaptureFixture
) -> None:
    limiter = throttler.limiter
    tenant, shared = throttler.config.rule("tenant"), throttler.config.rule("shared")
    # A task estimated at 3 planned, came back and took its real limits; meanwhile a rate
    # set at run time gave the plan a burst of 2, below the task's cost
    assert limiter.acquire_many([(TWIN, "a", 3.0)], max_wait_s=60, acquisition_id=plan_id("t3"))
    due = limiter.acquire_many(
        [(tenant.limit, "a", 3.0), (shared.limit, None, 3.0)], acquisition_id="t3", lease_s=60
    )
    assert due.acquisition is not None
    narrow = Limit.parse("1/s burst 2", name=TWIN.name, algorithm="gcra")
    ticket = Ticket(due.acquisition, (tenant, shared), time.time(), {None: 1.0},
                    plan=[(narrow, "a", 3.0)])  # fmt: skip
    # When its call settles, the plan's refusal is logged, not raised out of the settle
    # (it would replace the body's result, run in a finally), and the real limits are
    # refunded as reported
    settle(throttler, ticket, failed=False)
    assert limiter.peek(tenant.limit, "a").remaining == pytest.approx(4.0, abs=0.2)
    assert "plan" in caplog.text
