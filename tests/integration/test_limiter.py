"""Behaviour of the limiter against a real Redis: algorithms, TTLs, settle, leases."""

from __future__ import annotations

import math
import struct
import time

import pytest
import redis

from tests.support.clock import FakeClock, redis_now_s
from throttle import (
    Acquire,
    Acquisition,
    CostExceedsCapacity,
    Decision,
    Limit,
    Limiter,
    RequestError,
    Throttled,
    ThrottleError,
)

HOUR = 3600.0


def state_key(limiter: Limiter, limit: Limit, key: str | None = None) -> str:
    return limiter.keyspace.state_keys(limit, key)[0]


def test_token_bucket_allows_the_burst_then_the_rate(clocked: Limiter, clock: FakeClock) -> None:
    limit = Limit.parse("5/s", name="api")
    assert [clocked.acquire(limit, "k").allowed for _ in range(6)] == [True] * 5 + [False]
    denied = clocked.acquire(limit, "k")
    assert denied.retry_after_s == pytest.approx(0.2)
    assert denied.denied_by == ("api",)
    clock.advance(0.2)
    assert clocked.acquire(limit, "k").allowed
    assert not clocked.acquire(limit, "k").allowed


def test_keys_are_independent(clocked: Limiter) -> None:
    limit = Limit.parse("1/m", name="api")
    assert clocked.acquire(limit, "tenant-a").allowed
    assert clocked.acquire(limit, "tenant-b").allowed
    assert clocked.acquire(limit).allowed
    assert not clocked.acquire(limit, "tenant-a").allowed


def test_fractional_refill_is_not_lost(clocked: Limiter, clock: FakeClock) -> None:
    # throttled-py floors whole seconds: 23 tokens where 26 were due. Here 2.6 s at 10/s
    # after emptying a bucket of 30 gives exactly 26 tokens.
    limit = Limit.parse("10/s burst 30", name="api")
    assert clocked.acquire(limit, cost=30).allowed
    clock.advance(2.6)
    assert clocked.acquire(limit, cost=0).remaining == pytest.approx(26.0)


def test_gcra_spaces_calls_strictly(clocked: Limiter, clock: FakeClock) -> None:
    limit = Limit.parse("10/s burst 1", name="shaper", algorithm="gcra")
    assert clocked.acquire(limit).allowed
    denied = clocked.acquire(limit)
    assert not denied.allowed
    assert denied.retry_after_s == pytest.approx(0.1)
    clock.advance(0.099)
    assert not clocked.acquire(limit).allowed
    clock.advance(0.001)
    assert clocked.acquire(limit).allowed


def test_gcra_reserves_the_next_free_slots_up_to_max_wait(
    clocked: Limiter, clock: FakeClock
) -> None:
    limit = Limit.parse("10/s burst 1", name="shaper", algorithm="gcra")
    waits = [clocked.acquire(limit, max_wait_s=0.35).wait_s for _ in range(4)]
    assert waits == pytest.approx([0.0, 0.1, 0.2, 0.3])
    beyond = clocked.acquire(limit, max_wait_s=0.35)
    assert not beyond.allowed
    assert beyond.retry_after_s == pytest.approx(0.4)
    # The queue drains with time: 0.25 s later the next free slot is 0.15 s away.
    clock.advance(0.25)
    assert clocked.acquire(limit, max_wait_s=0.35).wait_s == pytest.approx(0.15)


def test_token_bucket_reservation_goes_into_debt(clocked: Limiter) -> None:
    limit = Limit.parse("2/s burst 2", name="api")
    assert clocked.acquire(limit, cost=2).wait_s == 0
    reserved = clocked.acquire(limit, cost=1, max_wait_s=1.0)
    assert reserved.allowed
    assert reserved.wait_s == pytest.approx(0.5)
    assert clocked.acquire(limit, cost=0).remaining == 0
    assert clocked.acquire(limit, cost=1, max_wait_s=1.0).wait_s == pytest.approx(1.0)


def test_fixed_window_resets_at_the_window_edge(clocked: Limiter, clock: FakeClock) -> None:
    limit = Limit.parse("3/m", name="quota", algorithm="fixed_window")
    clock.now_us = clock.now_us // 60_000_000 * 60_000_000 + 50_000_000  # 50 s into a minute
    assert [clocked.acquire(limit).allowed for _ in range(4)] == [True, True, True, False]
    assert clocked.acquire(limit).retry_after_s == pytest.approx(10.0)
    clock.advance(10)
    assert clocked.acquire(limit).allowed


def test_sliding_window_closes_the_window_edge_burst(clocked: Limiter, clock: FakeClock) -> None:
    limit = Limit.parse("4/m", name="sliding", algorithm="sliding_window")
    clock.now_us = clock.now_us // 60_000_000 * 60_000_000 + 55_000_000
    assert all(clocked.acquire(limit).allowed for _ in range(4))
    clock.advance(10)  # 5 s into the next minute: the previous 4 still weigh 4 * 55/60
    denied = clocked.acquire(limit)
    assert not denied.allowed
    # Room for one more when 4 * (1 - f) + 0 + 1 <= 4, i.e. f >= 1/4: 15 s in, 10 s away.
    assert denied.retry_after_s == pytest.approx(10.0)
    clock.advance(10)
    assert clocked.acquire(limit).allowed


def test_multi_limit_is_all_or_nothing(clocked: Limiter) -> None:
    tenant = Limit.parse("2/s", name="per-tenant")
    fleet = Limit.parse("100/s", name="fleet", algorithm="gcra")
    daily = Limit.parse("50000/d", name="daily", algorithm="fixed_window")
    targets = [(tenant, "acme"), (fleet, None), (daily, "acme")]
    assert clocked.acquire_many(targets).allowed
    assert clocked.acquire_many(targets).allowed
    denied = clocked.acquire_many(targets)
    assert not denied.allowed
    assert denied.denied_by == ("per-tenant",)
    # The denial took nothing from the limits that would have allowed it.
    fleet_left = clocked.acquire(fleet, cost=0).remaining
    daily_left = clocked.acquire(daily, "acme", cost=0).remaining
    assert fleet_left == pytest.approx(98.0)
    assert daily_left == pytest.approx(49998.0)


def test_each_limit_can_have_its_own_cost(clocked: Limiter) -> None:
    # An LLM call: 1 of 3 requests per minute and an estimated 2000 of 5000 tokens per minute.
    requests = Limit.parse("3/m", name="requests")
    tokens = Limit.parse("5000/m", name="tokens")
    first = clocked.acquire_many(
        [(requests, "acme", 1), (tokens, "acme", 2000)], acquisition_id="call-1"
    )
    assert first.allowed and first.acquisition is not None
    assert first.acquisition.costs == (1.0, 2000.0)
    assert [s.remaining for s in first.limits] == [pytest.approx(2.0), pytest.approx(3000.0)]
    # All or nothing: 4000 more tokens do not fit, so no request is taken either.
    denied = clocked.acquire_many([(requests, "acme", 1), (tokens, "acme", 4000)])
    assert denied.denied_by == ("tokens",)
    assert clocked.acquire(requests, "acme", cost=0).remaining == pytest.approx(2.0)
    # The call used 1200 tokens: settle the tokens, keep the request as reserved.
    settled = clocked.settle(first.acquisition, [None, 1200])
    assert settled.deltas == (0.0, -800.0)
    assert clocked.acquire(tokens, "acme", cost=0).remaining == pytest.approx(3800.0)
    assert clocked.acquire(requests, "acme", cost=0).remaining == pytest.approx(2.0)
    # A redelivered call does not pay twice, and knows what it reserved.
    second = clocked.acquire_many(
        [(requests, "acme", 1), (tokens, "acme", 100)], acquisition_id="call-2"
    )
    held = clocked.acquire_many(
        [(requests, "acme", 1), (tokens, "acme", 999)], acquisition_id="call-2"
    )
    assert held.held and held.acquisition is not None
    assert held.acquisition.costs == (1.0, 100.0)
    assert second.acquisition is not None
    with pytest.raises(RequestError, match="1 actual costs for 2 limits"):
        clocked.settle(second.acquisition, [5])
    with pytest.raises(CostExceedsCapacity, match="cost 6000 exceeds the capacity 5000"):
        clocked.acquire_many([(requests, "acme", 1), (tokens, "acme", 6000)])


def test_multi_limit_retry_after_is_the_largest_denial(clocked: Limiter) -> None:
    short = Limit.parse("1/s", name="short")
    long = Limit.parse("1/m", name="long")
    other = Limit.parse("10/s", name="other")
    assert clocked.acquire_many([(short, None), (long, None)]).allowed
    denied = clocked.acquire_many([(short, None), (long, None), (other, None)])
    assert denied.denied_by == ("short", "long")
    assert denied.retry_after_s == pytest.approx(60.0)
    assert [s.retry_after_s for s in denied.limits] == pytest.approx([1.0, 60.0, 0.0])


def test_a_reservable_wait_counts_in_the_retry_after_of_a_denial(
    clocked: Limiter, clock: FakeClock
) -> None:
    # GCRA could reserve 0.5 s ahead, but the window denies for 0.2 s: the caller must not
    # come back before the GCRA slot either.
    shaper = Limit.parse("2/s burst 1", name="shaper", algorithm="gcra")
    window = Limit.parse("1/s", name="window", algorithm="fixed_window")
    clock.now_us = clock.now_us // 1_000_000 * 1_000_000 + 800_000  # 0.2 s before a window edge
    assert clocked.acquire(shaper).allowed
    assert clocked.acquire(window).allowed
    denied = clocked.acquire_many([(shaper, None), (window, None)], max_wait_s=1.0)
    assert not denied.allowed
    assert denied.denied_by == ("window",)
    assert [s.retry_after_s for s in denied.limits] == pytest.approx([0.0, 0.2])
    assert denied.retry_after_s == pytest.approx(0.5)


def pipelined_trips(limiter: Limiter, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The commands of each pipelined round trip ``limiter`` makes from now on (its
    library loaded first, so that its calls are pipelined)."""
    limiter.acquire(Limit.parse("1/s", name="warm-up"))
    direct = limiter._direct
    assert direct is not None
    trips: list[int] = []
    each = direct.each
    monkeypatch.setattr(direct, "each", lambda cmds: trips.append(len(cmds)) or each(cmds))
    return trips


def test_acquire_each_takes_each_target_alone_as_of_when_it_was_asked(
    limiter: Limiter, monkeypatch: pytest.MonkeyPatch
) -> None:
    gcra = Limit.parse("10/s burst 1", name="api", algorithm="gcra")
    trips = pipelined_trips(limiter, monkeypatch)
    # Given five asks of a 10/s burst-1 limit gathered as they came, 0.1 s apart, and sent
    # together now: each dated when it was asked
    dated = limiter.acquire_each(
        [(gcra, "k", 1.0)] * 5, max_wait_s=HOUR, ago_s=[0.4, 0.3, 0.2, 0.1, 0.0]
    )
    # Then none waits (they came at the limit's rate), all in one round trip and one call
    # (the asks of one limit and key go together)
    assert [(d.allowed, d.wait_s) for d in dated] == [(True, 0.0)] * 5  # type: ignore[union-attr]
    assert trips == [1]
    # Undated, three asks at once are spaced by the limit, each on its own: one that can
    # never pass (a cost above the capacity) fails alone in its place
    asks = [(gcra, "n", 1.0), (gcra, "n", 2.0), (gcra, "n", 1.0), (gcra, "n", 1.0)]
    now = limiter.acquire_each(asks, max_wait_s=HOUR)
    assert isinstance(now[1], CostExceedsCapacity)
    waits = [d.wait_s for d in (now[0], now[2], now[3]) if isinstance(d, Decision)]
    assert waits[0] == 0.0
    # the next two slots, 0.1 s apart, less what passed on the Redis clock between the
    # calls (a descheduled redis-server only shortens the waits)
    assert 0.0 < waits[1] <= 0.1 + 1e-6
    assert waits[1] < waits[2] <= 0.2 + 1e-6
    assert trips == [1, 1]
    # and a limit that is full denies one ask without touching the others
    window = Limit.parse("1/h", name="win", algorithm="fixed_window")
    mixed = limiter.acquire_each([(window, None, 1.0), (window, None, 1.0), (gcra, "m", 1.0)])
    assert [d.allowed for d in mixed if isinstance(d, Decision)] == [True, False, True]
    with pytest.raises(RequestError, match="ago_s has 1 values for 2 targets"):
        limiter.acquire_each([(gcra, "k", 1.0)] * 2, ago_s=[0.1])
    with pytest.raises(RequestError, match=r"one number of s per target, a list \(got 0.5\)"):
        limiter.acquire_each([(gcra, "k", 1.0)] * 2, ago_s=0.5)  # type: ignore[arg-type]
    # an ago_s that is not a number is that ask's error, named; the others are decided
    roomy = Limit.parse("10/s", name="roomy")
    asked = limiter.acquire_each([(roomy, "n", 1.0)] * 3, ago_s=[math.nan, "x", 0.0])  # type: ignore[list-item]
    assert [str(d) for d in asked[:2]] == [
        "ago_s must be a number of s (got nan)",
        "ago_s must be a number of s (got 'x')",
    ]
    assert isinstance(asked[2], Decision) and asked[2].allowed


def test_acquire_each_goes_as_one_call_per_limit_and_key_and_decides_as_one_call_per_ask(
    limiter: Limiter, monkeypatch: pytest.MonkeyPatch
) -> None:
    gcra = Limit.parse("10/s burst 2", name="g", algorithm="gcra")
    bucket = Limit.parse("10/s burst 2", name="b")
    window = Limit.parse("2/h", name="w", algorithm="sliding_window")
    fair = Limit.parse("10/s burst 2", name="f", algorithm="gcra", fair=True)
    asks: list[tuple[Limit, str | None, float]] = [
        (gcra, "x", 1.0), (bucket, "x", 1.0), (gcra, "y", 1.0), (window, None, 1.0),
        (gcra, "x", 1.0), (fair, "x", 1.0), (bucket, "x", 1.0), (gcra, "x", 1.0),
        (window, None, 1.0), (bucket, "x", 5.0), (window, None, 1.0), (fair, "x", 1.0),
    ]  # fmt: skip
    # Given asks of four limits and two keys gathered over 50 ms, sent together
    ago = [0.05 * (len(asks) - i) / len(asks) for i in range(len(asks))]
    trips = pipelined_trips(limiter, monkeypatch)
    together = limiter.acquire_each(asks, max_wait_s=1.0, ago_s=ago)
    # Then one call per limit and key of a token bucket, GCRA or window (an ask that
    # cannot pass is not sent), each fair ask alone (its state is every key's), all in one
    # round trip
    assert trips == [1 + 1 + 1 + 1 + 2]
    outcome = [
        type(d).__name__ if isinstance(d, ThrottleError) else (d.allowed, d.wait_s > 0)
        for d in together
    ]
    # and each ask decided in its place, in order within its limit and key: GCRA x
    # admits two at once (burst 2), then waits; the bucket's third ask costs above its
    # capacity; the 2/h window admits two
    assert outcome == [
        (True, False), (True, False), (True, False), (True, False),
        (True, False), (True, False), (True, False), (True, True),
        (True, False), "CostExceedsCapacity", (False, False), (True, False),
    ]  # fmt: skip


def test_acquire_batch_runs_independent_acquisitions_in_order_in_one_round_trip(
    limiter: Limiter, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared = Limit.parse("10/s burst 1", name="shared", algorithm="gcra")
    tenant = Limit.parse("1/h", name="tenant", algorithm="fixed_window")
    trips = pipelined_trips(limiter, monkeypatch)
    # Given four tasks' acquisitions, each of both limits (all or nothing), with an id
    calls = [
        Acquire([(shared, None), (tenant, "a")], max_wait_s=1.0, acquisition_id="t1"),
        Acquire([(shared, None), (tenant, "a")], max_wait_s=1.0, acquisition_id="t2"),
        Acquire([(shared, None), (tenant, "b")], max_wait_s=1.0, acquisition_id="t3"),
        Acquire([(shared, None)], max_wait_s=0.15, acquisition_id="t4"),
    ]
    decisions = limiter.acquire_batch(calls)
    assert trips == [4]
    assert all(isinstance(d, Decision) for d in decisions)
    first, second, third, fourth = (d for d in decisions if isinstance(d, Decision))
    # Then they are taken in order: t2 is denied by its tenant's window alone and takes
    # nothing of the shared limit, whose next slot t3 gets; t4 would wait past its own
    # horizon for the one after
    assert (first.allowed, first.wait_s) == (True, 0.0)
    assert (second.allowed, second.denied_by) == (False, ("tenant",))
    assert third.allowed
    assert 0.0 < third.wait_s <= 0.1 + 1e-6  # t1's slot plus the spacing, less the time between
    assert (fourth.allowed, fourth.denied_by) == (False, ("shared",))
    # and each is recorded under its id: asked again, it takes nothing twice
    again = limiter.acquire_batch([calls[0], Acquire([(shared, None)], cost=-1)])
    assert isinstance(again[0], Decision) and again[0].held
    assert isinstance(again[1], RequestError)  # a bad call fails alone, before sending
    assert trips == [4, 1]
    assert first.acquisition is not None
    assert limiter.settle(first.acquisition, None).status == "settled"


def test_settle_refunds_the_unused_part(clocked: Limiter) -> None:
    limit = Limit.parse("100/h burst 10", name="llm")
    decision = clocked.acquire(limit, "acme", cost=8, acquisition_id="task-1")
    assert decision.acquisition is not None
    settled = clocked.settle(decision.acquisition, 3)
    assert (settled.status, settled.refunded, settled.charged) == ("settled", 5.0, 0.0)
    assert clocked.acquire(limit, "acme", cost=0).remaining == pytest.approx(7.0)


def test_a_refund_never_lifts_a_bucket_above_capacity(clocked: Limiter, clock: FakeClock) -> None:
    limit = Limit.parse("10/s burst 10", name="api")
    decision = clocked.acquire(limit, cost=4, acquisition_id="t")
    clock.advance(0.3)  # 3 tokens back: 9
    assert decision.acquisition is not None
    assert clocked.settle(decision.acquisition, 0).refunded == 4.0
    assert clocked.acquire(limit, cost=0).remaining == pytest.approx(10.0)


def test_settle_charges_the_extra_as_a_debt(clocked: Limiter) -> None:
    limit = Limit.parse("1/s burst 10", name="api")
    decision = clocked.acquire(limit, cost=2, acquisition_id="t")
    assert decision.acquisition is not None
    assert clocked.settle(decision.acquisition, 14).charged == 12.0
    denied = clocked.acquire(limit)
    assert not denied.allowed
    assert denied.retry_after_s == pytest.approx(5.0)  # -4 tokens: 5 s to reach one


def test_settle_refuses_a_cost_beyond_any_limit_and_takes_nothing(clocked: Limiter) -> None:
    limit = Limit.parse("100/h", name="api")
    decision = clocked.acquire(limit, cost=10, acquisition_id="t")
    assert decision.acquisition is not None
    # A charge of 1e20 would deny the key for ages (a typo, a unit mixed up): refused
    with pytest.raises(RequestError, match="actual_cost"):
        clocked.settle(decision.acquisition, 1e20)
    # and the acquisition is still there to settle with its real cost
    assert clocked.settle(decision.acquisition, 4).refunded == 6.0
    assert clocked.acquire(limit).allowed


def test_gcra_refund_never_moves_a_slot_before_now(clocked: Limiter, clock: FakeClock) -> None:
    limit = Limit.parse("1/s burst 1", name="shaper", algorithm="gcra")
    decision = clocked.acquire(limit, acquisition_id="t")
    clock.advance(0.5)
    assert decision.acquisition is not None
    clocked.settle(decision.acquisition, 0)
    # The slot is free now, but no credit was banked for the past.
    assert clocked.acquire(limit).allowed
    assert not clocked.acquire(limit).allowed


def test_window_refund_goes_only_to_the_window_that_paid(
    clocked: Limiter, clock: FakeClock
) -> None:
    limit = Limit.parse("5/m", name="quota", algorithm="fixed_window")
    clock.now_us = clock.now_us // 60_000_000 * 60_000_000 + 59_000_000
    decision = clocked.acquire(limit, cost=3, acquisition_id="t")
    clock.advance(2)  # the next window
    assert clocked.acquire(limit, cost=5).allowed
    assert decision.acquisition is not None
    assert clocked.settle(decision.acquisition, 0).status == "settled"
    assert not clocked.acquire(limit).allowed  # nothing came back into the new window


def test_settling_twice_or_unknown_changes_nothing(clocked: Limiter) -> None:
    limit = Limit.parse("10/h", name="api")
    decision = clocked.acquire(limit, cost=5, acquisition_id="t")
    assert decision.acquisition is not None
    assert clocked.settle(decision.acquisition, 1).status == "settled"
    again = clocked.settle(decision.acquisition, 0)
    assert (again.status, again.delta) == ("already_settled", 0.0)
    ghost = Acquisition(
        "never-acquired",
        (5.0,),
        decision.acquisition.targets,
        (*decision.acquisition.keys[:-1], clocked.keyspace.lease_key("never-acquired")),
    )
    assert clocked.settle(ghost, 0).status == "unknown"
    assert clocked.acquire(limit, cost=0).remaining == pytest.approx(9.0)


def test_settling_an_expired_lease_changes_nothing(limiter: Limiter) -> None:
    limit = Limit.parse("10/h", name="api")
    decision = limiter.acquire(limit, cost=5, acquisition_id="t", lease_s=0.05)
    time.sleep(0.15)
    assert decision.acquisition is not None
    assert limiter.settle(decision.acquisition, 0).status == "unknown"
    assert limiter.acquire(limit, cost=0).remaining == pytest.approx(5.0, abs=0.01)


def test_an_id_names_one_acquisition(clocked: Limiter) -> None:
    limit = Limit.parse("10/h", name="api")
    first = clocked.acquire(limit, "a", cost=5, acquisition_id="t")
    assert first.acquisition is not None
    # The same id on other keys (or limits) is refused, and takes nothing from them.
    with pytest.raises(RequestError, match="'t' already holds a lease on other limits or keys"):
        clocked.acquire(limit, "b", cost=5, acquisition_id="t")
    streams = Limit.parse("1 concurrent", name="streams")
    with pytest.raises(RequestError, match="already holds a lease"):
        clocked.acquire(streams, acquisition_id="t")
    assert clocked.acquire(limit, "b", cost=0).remaining == 10
    assert clocked.acquire(streams).allowed
    # A settle that names other keys than the record's changes nothing.
    forged = Acquisition(
        "t",
        (5.0,),
        ((limit, "b"),),
        (state_key(clocked, limit, "b"), clocked.keyspace.lease_key("t")),
    )
    assert clocked.settle(forged, 0).status == "mismatch"
    assert clocked.settle(first.acquisition, 0).status == "settled"
    assert clocked.acquire(limit, "a", cost=0).remaining == 10


def test_the_same_acquisition_id_does_not_pay_twice(clocked: Limiter, clock: FakeClock) -> None:
    limit = Limit.parse("1/s burst 1", name="shaper", algorithm="gcra")
    assert clocked.acquire(limit).allowed
    first = clocked.acquire(limit, acquisition_id="task-9", max_wait_s=5)
    assert first.wait_s == pytest.approx(1.0)
    clock.advance(0.4)
    redelivered = clocked.acquire(limit, cost=0.5, acquisition_id="task-9", max_wait_s=5)
    assert redelivered.held
    assert redelivered.wait_s == pytest.approx(0.6)  # the same slot, nothing taken again
    assert redelivered.acquisition is not None
    assert redelivered.acquisition.cost == 1.0  # what the lease reserved, not this call
    assert redelivered.late_s == 0
    clock.advance(0.85)  # 0.25 s past the slot
    late = clocked.acquire(limit, acquisition_id="task-9", max_wait_s=5)
    assert late.held and late.wait_s == 0 and late.late_s == pytest.approx(0.25)
    clock.advance(-0.85)
    assert clocked.acquire(limit, max_wait_s=5).wait_s == pytest.approx(1.6)
    # Once settled, the id may acquire (and pay) anew.
    assert first.acquisition is not None
    clocked.release(first.acquisition)
    again = clocked.acquire(limit, acquisition_id="task-9", max_wait_s=5)
    assert not again.held
    assert again.wait_s == pytest.approx(2.6)


def test_concurrency_limits_holders_and_releases(clocked: Limiter) -> None:
    limit = Limit.parse("2 concurrent", name="streams")
    a = clocked.acquire(limit, acquisition_id="a", lease_s=60)
    b = clocked.acquire(limit, acquisition_id="b", lease_s=60)
    c = clocked.acquire(limit, acquisition_id="c", lease_s=60)
    assert (a.allowed, b.allowed, c.allowed) == (True, True, False)
    assert c.retry_after_s == pytest.approx(60.0)  # an upper bound: the first lease's end
    assert a.acquisition is not None
    assert clocked.release(a.acquisition).status == "settled"
    assert clocked.acquire(limit, acquisition_id="c", lease_s=60).allowed


def test_a_dead_holder_frees_its_units_when_its_lease_ends(
    clocked: Limiter, clock: FakeClock
) -> None:
    limit = Limit.parse("1 concurrent", name="streams")
    assert clocked.acquire(limit, lease_s=30).allowed  # never released: the holder "died"
    assert not clocked.acquire(limit, lease_s=30).allowed
    clock.advance(30)
    assert clocked.acquire(limit, lease_s=30).allowed


def test_concurrency_without_an_id_gets_one(clocked: Limiter) -> None:
    decision = clocked.acquire(Limit.parse("3 concurrent", name="c"))
    assert decision.acquisition is not None
    assert len(decision.acquisition.id) == 32


def test_weighted_concurrency_units(clocked: Limiter) -> None:
    limit = Limit.parse("3 concurrent", name="gpu")
    big = clocked.acquire(limit, cost=2.5)
    assert big.allowed
    assert not clocked.acquire(limit, cost=1).allowed
    assert clocked.acquire(limit, cost=0.5).allowed
    assert big.acquisition is not None
    clocked.release(big.acquisition)
    assert clocked.acquire(limit, cost=2.5).allowed


def test_a_one_per_three_hours_limit_survives_an_idle_hour(
    clocked: Limiter, clock: FakeClock, client: redis.Redis
) -> None:
    limit = Limit.parse("1/3h", name="slow")
    assert clocked.acquire(limit).allowed
    # The key lives until the bucket is full again: three hours (plus a second).
    assert client.pttl(state_key(clocked, limit)) >= 3 * HOUR * 1000
    clock.advance(HOUR)
    denied = clocked.acquire(limit)
    assert not denied.allowed
    assert denied.retry_after_s == pytest.approx(2 * HOUR)


@pytest.mark.parametrize(
    "spec",
    [
        ("10/s", "token_bucket"),
        ("10/s burst 2", "gcra"),
        ("10/s", "sliding_window"),
        ("10/s", "fixed_window"),
        ("10 concurrent", "concurrency"),
    ],
    ids=lambda spec: spec[1],
)
def test_every_key_has_a_ttl_and_idle_keys_vanish(
    limiter: Limiter, client: redis.Redis, prefix: str, spec: tuple[str, str]
) -> None:
    limit = Limit.parse(spec[0], name="idle", algorithm=spec[1])
    started = redis_now_s(client)
    decision = limiter.acquire(limit, "k", acquisition_id="lease-1", lease_s=0.5)
    assert decision.allowed
    keys = list(client.scan_iter(match=f"{prefix}:*"))
    assert keys
    ttls = {key.decode(): client.pttl(key) for key in keys}
    # The TTLs ran down while they were read: by at most this long on the Redis clock, plus
    # a millisecond (PTTL counts whole ones). A fixed window's key written at the end of its
    # window starts at 1000 ms and a little, the lease record at 500 ms.
    elapsed_ms = (redis_now_s(client) - started) * 1000 + 1
    # Every key expires: no sooner than its state stops mattering, plus one second (a lease
    # record: when the lease ends), and no later than the end of the next 1 s window.
    for key, ttl in ttls.items():
        least = (500 if ":lease:" in key else 1000) - elapsed_ms
        assert least <= ttl <= 3000, (ttls, elapsed_ms)
    deadline = time.monotonic() + 5
    while list(client.scan_iter(match=f"{prefix}:*")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert list(client.scan_iter(match=f"{prefix}:*")) == []


@pytest.mark.parametrize("algorithm", ["token_bucket", "gcra"])
def test_a_key_whose_debt_grows_always_outlives_it(
    limiter: Limiter, client: redis.Redis, algorithm: str
) -> None:
    # On Redis TIME, a write keeps the key's TTL while it lasts long enough (SETRANGE) and
    # sets a longer one when the state needs more: each reservation here adds 0.5 s of debt.
    limit = Limit.parse("2/s burst 1", name=f"debt-{algorithm}", algorithm=algorithm)
    key = state_key(limiter, limit)
    for n in range(1, 21):
        decision = limiter.acquire(limit, max_wait_s=60)
        assert decision.allowed
        # The state must live until the debt is repaid (the bucket full, the TAT passed),
        # plus a second: reset_after_s is that, as of the call; PTTL is read after it.
        started = redis_now_s(client)
        ttl_ms = client.pttl(key)
        read_ms = (redis_now_s(client) - started) * 1000 + 1
        assert decision.reset_after_s * 1000 + 1000 - read_ms - 50 <= ttl_ms, (n, decision)
        assert ttl_ms <= decision.reset_after_s * 1000 + 2000 + 1, (n, decision)


@pytest.mark.parametrize("algorithm", ["token_bucket", "gcra", "fixed_window", "sliding_window"])
def test_a_hot_key_keeps_a_ttl_written_in_place(
    limiter: Limiter, client: redis.Redis, algorithm: str
) -> None:
    # Many calls within a second: the TTL set by the first write is kept (the key written
    # in place), and the decisions are those of every write setting it.
    limit = Limit.parse("1000/h", name=f"hot-{algorithm}", algorithm=algorithm)
    key = state_key(limiter, limit)
    assert limiter.acquire(limit).allowed
    ttls = []
    for _ in range(20):
        assert limiter.acquire(limit).allowed
        ttls.append(client.pttl(key))
    assert all(ttl > 1000 for ttl in ttls), ttls
    assert limiter.peek(limit).remaining == pytest.approx(1000 - 21, abs=0.1)


def test_a_state_of_the_previous_format_is_read_and_rewritten(
    clocked: Limiter, clock: FakeClock, client: redis.Redis
) -> None:
    # A fleet being upgraded: token bucket and GCRA states written without the end of their
    # key's TTL (two doubles, one) or a GCRA's without its interval (two doubles) are read
    # as they were, and written in the new format.
    bucket = Limit.parse("10/s", name="old-tb")
    client.set(state_key(clocked, bucket), struct.pack("<dd", 3.0, clock.now_us), px=60_000)
    assert clocked.acquire(bucket).remaining == pytest.approx(2.0)
    assert len(client.get(state_key(clocked, bucket)) or b"") == 24
    slot = Limit.parse("10/s burst 1", name="old-gcra", algorithm="gcra")
    client.set(state_key(clocked, slot), struct.pack("<d", clock.now_us + 50_000), px=60_000)
    denied = clocked.acquire(slot)
    assert not denied.allowed and denied.retry_after_s == pytest.approx(0.05)
    clock.advance(0.05)
    assert clocked.acquire(slot).allowed
    assert len(client.get(state_key(clocked, slot)) or b"") == 24
    assert client.pttl(state_key(clocked, slot)) > 1000
    lives = clock.now_us + 60e6
    client.set(state_key(clocked, slot), struct.pack("<dd", clock.now_us + 50_000, lives))
    denied = clocked.acquire(slot)
    assert not denied.allowed and denied.retry_after_s == pytest.approx(0.05)
    clock.advance(0.05)
    assert clocked.acquire(slot).allowed
    assert len(client.get(state_key(clocked, slot)) or b"") == 24


def test_a_fair_limit_slowed_then_raised_owes_its_calls_at_the_new_rate(
    clocked: Limiter, clock: FakeClock
) -> None:
    # The same for a fair limit: its total schedule and the key's own
    slow = Limit.from_mapping({"rate": "1/h", "burst": 1, "fair": True}, name="shared")
    fast = Limit.from_mapping({"rate": "5000/h", "burst": 10, "fair": True}, name="shared")
    assert clocked.acquire(slow, "acme").allowed
    assert not clocked.acquire(slow, "acme").allowed
    assert clocked.acquire(fast, "acme").allowed
    assert clocked.acquire(fast, "zeta").allowed


def test_a_gcra_limit_slowed_then_raised_owes_its_calls_at_the_new_rate(
    clocked: Limiter, clock: FakeClock
) -> None:
    # Given a GCRA limit slowed at run time to 1/h: one call pushes its next slot an hour on
    slow = Limit.parse("1/h burst 1", name="github", algorithm="gcra")
    fast = Limit.parse("5000/h burst 10", name="github", algorithm="gcra")
    assert clocked.acquire(slow).allowed
    assert clocked.acquire(slow).retry_after_s == pytest.approx(3600.0)
    # When the rate is raised back (celery throttle clear), the call made is owed at the
    # new rate (0.72 s of a burst of 10), not for the hour of the old one: 9 more at once
    assert [clocked.acquire(fast).allowed for _ in range(10)] == [True] * 9 + [False]
    # And lowered again, the debt is kept as it stands (as the spacing guard keeps it):
    # the next slot at 1/h is an hour after the 0.72 s x 10 booked
    denied = clocked.acquire(slow)
    assert denied.retry_after_s == pytest.approx(7.2, abs=0.01)


def test_a_gcra_limit_raised_while_a_caller_waits_frees_it_at_the_new_rate(
    clocked: Limiter, clock: FakeClock
) -> None:
    # Given a burst-1 GCRA limit at 1/m that took a call: its next slot is a minute on
    slow = Limit.parse("1/m burst 1", name="perkey", algorithm="gcra")
    fast = Limit.parse("60/m burst 1", name="perkey", algorithm="gcra")
    assert clocked.acquire(slow).allowed
    # When its rate is raised to 60/m, the call made is owed at the new rate: 1 s
    denied = clocked.acquire(fast)
    assert not denied.allowed and denied.retry_after_s == pytest.approx(1.0)
    # and a caller that waits what it was told is admitted then: the debt was converted
    # once, not again from the old slot on each read (0.983 s more, then 0.967 s...)
    clock.advance(denied.retry_after_s)
    assert clocked.acquire(fast).allowed


def test_clock_stepping_back_does_not_refill_twice(clocked: Limiter, clock: FakeClock) -> None:
    limit = Limit.parse("1/s burst 5", name="api")
    assert clocked.acquire(limit, cost=5).allowed
    clock.advance(2)
    assert clocked.acquire(limit, cost=0).remaining == pytest.approx(2.0)
    clock.advance(-1)  # Redis TIME stepped back a second
    assert clocked.acquire(limit, cost=0).remaining == pytest.approx(2.0)
    clock.advance(1)  # back where it was: that second must not be refilled again
    assert clocked.acquire(limit, cost=0).remaining == pytest.approx(2.0)
    clock.advance(1)
    assert clocked.acquire(limit, cost=0).remaining == pytest.approx(3.0)


@pytest.mark.parametrize("algorithm", ["fixed_window", "sliding_window"])
def test_a_clock_step_back_does_not_reopen_a_full_window(
    clocked: Limiter, clock: FakeClock, algorithm: str
) -> None:
    limit = Limit.parse("3/m", name="quota", algorithm=algorithm)
    clock.now_us = clock.now_us // 60_000_000 * 60_000_000 + 60_000_000  # a minute starts
    assert [clocked.acquire(limit).allowed for _ in range(4)] == [True, True, True, False]
    clock.advance(-0.001)  # back into the previous minute
    assert not clocked.acquire(limit).allowed
    clock.advance(0.002)
    assert not clocked.acquire(limit).allowed


def test_cost_zero_peeks_without_taking(clocked: Limiter, client: redis.Redis) -> None:
    limit = Limit.parse("3/m", name="api")
    for _ in range(3):
        assert clocked.acquire(limit, cost=0).remaining == pytest.approx(3.0)
    assert clocked.acquire(limit, cost=3).allowed
    # A cost-0 call on a concurrency limit holds nothing and leaves no holder behind.
    streams = Limit.parse("2 concurrent", name="streams")
    for _ in range(5):
        assert clocked.acquire(streams, cost=0).allowed
    assert client.exists(*clocked.keyspace.state_keys(streams, None)) == 0
    assert clocked.acquire(streams, cost=2).allowed


def test_cost_zero_is_denied_while_a_limit_is_in_debt(clocked: Limiter, clock: FakeClock) -> None:
    # Debt (a reservation or a charge) is owed before anything else passes, even nothing.
    limit = Limit.parse("2/s burst 2", name="api")
    assert clocked.acquire(limit, cost=2).allowed
    assert clocked.acquire(limit, cost=1, max_wait_s=1).wait_s == pytest.approx(0.5)
    peek = clocked.acquire(limit, cost=0)
    assert (peek.allowed, peek.remaining, peek.retry_after_s) == (False, 0.0, pytest.approx(0.5))
    clock.advance(0.5)
    assert clocked.acquire(limit, cost=0).allowed


def test_thousands_of_dead_holders_are_swept(clocked: Limiter, clock: FakeClock) -> None:
    # More expired leases than one sweep batch (and than Lua's unpack() could take at once).
    limit = Limit.parse("5000 concurrent", name="crowd")
    for i in range(2500):
        assert clocked.acquire(limit, acquisition_id=f"dead-{i}", lease_s=10).allowed
    assert not clocked.acquire(limit, cost=2501).allowed
    clock.advance(10)
    full = clocked.acquire(limit, cost=5000)
    assert full.allowed
    assert full.remaining == 0


def test_raise_if_denied_carries_the_delay(clocked: Limiter) -> None:
    limit = Limit.parse("1/m", name="api")
    assert clocked.acquire(limit).raise_if_denied().allowed
    with pytest.raises(Throttled) as caught:
        clocked.acquire(limit).raise_if_denied()
    assert caught.value.retry_after_s == pytest.approx(60.0)
    assert caught.value.denied_by == ("api",)
    assert str(caught.value) == "throttled by api: retry after 60.000 s"


@pytest.mark.parametrize("algorithm", ["token_bucket", "gcra"])
def test_back_to_back_calls_get_the_burst_and_no_more(
    clocked: Limiter, client: redis.Redis, algorithm: str
) -> None:
    # throttled-py 3.5 at "10/s burst 4" floors its TTL to 0 and admits 100 of 100.
    limit = Limit.parse("10/s burst 4", name="api", algorithm=algorithm)
    assert sum(clocked.acquire(limit).allowed for _ in range(100)) == 4
    assert client.pttl(state_key(clocked, limit)) > 1000


def test_one_limit_with_its_own_cost_runs_the_one_limit_script(clocked: Limiter) -> None:
    limit = Limit.parse("10/s", name="api")
    # A (limit, key, cost) triple alone, without an id: the cost is the limit's, not `cost`.
    decision = clocked.acquire_many([(limit, "k", 3)], cost=5)
    assert decision.allowed and decision.remaining == 7
    assert decision.late_s == 0.0 and decision.acquisition is None
    assert len(decision) == len(Decision._fields)  # every field, late_s included
    assert clocked.acquire(limit, "k").remaining == 6
    assert limit.code in clocked._one  # lua/acquire_one.lua ran, not acquire.lua
    with pytest.raises(RequestError, match="cost of limit 'api'"):
        clocked.acquire_many([(limit, "k", -1)])
    with pytest.raises(CostExceedsCapacity):
        clocked.acquire_many([(limit, "k", 11)])
    # The global cost is still checked, as acquire_many always did.
    with pytest.raises(RequestError, match="cost must be"):
        clocked.acquire_many([(limit, "k", 1)], cost=-1)


def test_a_settle_or_a_spacing_of_more_than_a_day_of_the_limit_is_refused(
    clocked: Limiter,
) -> None:
    limit = Limit.parse("100/m burst 10", name="api")  # a day: 144,000, and the burst
    decision = clocked.acquire(limit, acquisition_id="t")
    assert decision.acquisition is not None
    # A charge that the limit's rate takes more than a day to repay is a mistake (the
    # key would be denied for ages: 1e15 at 100/m, 19,000 years): refused, naming it
    with pytest.raises(RequestError, match=r"actual_cost of limit 'api' .* <= 144010"):
        clocked.settle(decision.acquisition, 144_011)
    with pytest.raises(RequestError, match=r"cost of limit 'api'"):
        clocked.space([(limit, "k", 1e300)])
    # while a debt within a day is charged, as an upstream that counted it would
    assert clocked.settle(decision.acquisition, 144_010).charged == 144_009.0
