"""Fair limits (lua/fair.lua) on a real Redis and the test clock, through the Limiter.

Floods run through tests/support/flood.py: every task acquires as the Celery gate does
(a reservation horizon of a day, a denied task back after retry_after plus the gate's
jitter, from a seeded generator), so the script sees a fleet's calls on one clock.
Shares are judged on the slots granted, in Redis (test clock) seconds.
"""

from __future__ import annotations

import itertools
import math
import uuid
from collections import Counter
from typing import Any

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.clock import EPOCH_US, FakeClock
from tests.support.flood import flood, rate_between
from tests.support.model import ModelLimiter
from throttle import ConfigError, Limit, Limiter, RequestError
from throttle.config import ThrottleConfig
from throttle.memory import MemoryLimiter
from throttle.rules import Rule

RATE = 20.0


def fair(spec: str = "20/s burst 1", algorithm: str = "gcra", **weights: float) -> Limit:
    return Limit.parse(spec, name="llm", algorithm=algorithm, fair=True, weights=weights)


def tasks(n: int, start_s: float = 0.0) -> list[float]:
    """n tasks arriving 1 ms apart from start_s."""
    return [start_s + i * 0.001 for i in range(n)]


def test_one_key_alone_gets_the_whole_rate(clocked: Limiter, clock: FakeClock) -> None:
    slots = flood(clocked, clock, fair(), {"a": tasks(200)})["a"]
    # 200 tasks at 20/s, burst 1: the last at 199 intervals, each 50 ms after the one before.
    assert slots[-1] == pytest.approx(199 / RATE)
    assert min(b - a for a, b in itertools.pairwise(slots)) == pytest.approx(1 / RATE)


@pytest.mark.parametrize("algorithm", ["gcra", "token_bucket"])
def test_three_flooding_keys_share_the_rate_equally(
    clocked: Limiter, clock: FakeClock, algorithm: str
) -> None:
    spec = "20/s burst 1" if algorithm == "gcra" else "20/s"
    slots = flood(clocked, clock, fair(spec, algorithm), {k: tasks(300) for k in "abc"})
    # While all three flood (from 5 s, after a token bucket's first burst, to 40 s of 45),
    # each window of 5 s gives each key its third of the rate within 10 %, and 20 s within
    # 3 %; and the slots nobody's share needed went to another key: the total ran at the
    # limit's rate (work conserving).
    for key in "abc":
        for start in range(5, 40, 5):
            assert rate_between(slots[key], start, start + 5) == pytest.approx(RATE / 3, rel=0.1)
        for start in (5, 15):
            assert rate_between(slots[key], start, start + 20) == pytest.approx(RATE / 3, rel=0.03)
    every = sorted(slot for key in "abc" for slot in slots[key])
    assert rate_between(every, 5, 40) == pytest.approx(RATE, rel=0.01)


def test_first_come_first_served_without_fair(clocked: Limiter, clock: FakeClock) -> None:
    # The same flood on the same limit without fair: the key that came first books the
    # future (what fair is for).
    limit = Limit.parse("20/s burst 1", name="plain", algorithm="gcra")
    slots = flood(clocked, clock, limit, {"a": tasks(300), "b": tasks(300, 0.5)})
    assert rate_between(slots["a"], 0, 10) == pytest.approx(RATE, rel=0.05)
    assert rate_between(slots["b"], 0, 10) == 0


def test_weights_give_their_share(clocked: Limiter, clock: FakeClock) -> None:
    limit = fair(c=2.0)
    slots = flood(clocked, clock, limit, {k: tasks(300) for k in "abc"})
    # Weights 1, 1, 2: 5/s, 5/s and 10/s while all three flood (c's 300 end at 30 s).
    for start in range(0, 25, 5):
        assert rate_between(slots["a"], start, start + 5) == pytest.approx(5.0, rel=0.15)
        assert rate_between(slots["b"], start, start + 5) == pytest.approx(5.0, rel=0.15)
        assert rate_between(slots["c"], start, start + 5) == pytest.approx(10.0, rel=0.15)


def test_a_key_that_goes_idle_returns_its_share(clocked: Limiter, clock: FakeClock) -> None:
    # b has 50 tasks: it shares while they last, then a gets the whole rate again.
    slots = flood(clocked, clock, fair(), {"a": tasks(400), "b": tasks(50)})
    assert rate_between(slots["a"], 0, 4) == pytest.approx(RATE / 2, rel=0.15)
    assert rate_between(slots["b"], 0, 4) == pytest.approx(RATE / 2, rel=0.15)
    b_done = slots["b"][-1]
    assert b_done < 6
    # b stops counting once its schedule has passed: within a second a has the rate alone.
    assert rate_between(slots["a"], b_done + 1, b_done + 6) == pytest.approx(RATE, rel=0.02)


def test_a_key_below_its_share_leaves_the_rest_to_the_others(
    clocked: Limiter, clock: FakeClock
) -> None:
    # c asks 3/s, less than its third (6.67/s): it gets all it asks, and a and b share the
    # other 17/s (a key counts in the shares only while its schedule is ahead of now or
    # its tasks wait: c about 3/6.67 of the time). The total runs at the limit's rate.
    arrivals = {"a": tasks(300), "b": tasks(300), "c": [i / 3 for i in range(60)]}
    slots = flood(clocked, clock, fair(), arrivals)
    assert rate_between(slots["c"], 2, 18) == pytest.approx(3.0, rel=0.05)
    # Its tasks wait about the near horizon at most (0.5 s: slots the others booked stay
    # theirs), a little more while a's and b's first tasks book it.
    waits = [s - i / 3 for i, s in enumerate(slots["c"])]
    assert max(waits[6:]) <= 0.55
    assert max(waits) <= 1.0
    for key in "ab":
        assert rate_between(slots[key], 2, 18) == pytest.approx((RATE - 3) / 2, rel=0.1)
    every = sorted(slot for key in "abc" for slot in slots[key])
    assert rate_between(every, 2, 18) == pytest.approx(RATE, rel=0.01)


def test_a_newcomer_gets_its_share_within_seconds(clocked: Limiter, clock: FakeClock) -> None:
    arrivals = {k: tasks(300) for k in "ab"}
    arrivals["c"] = tasks(60, 5.0)
    slots = flood(clocked, clock, fair(), arrivals)
    assert slots["c"][0] - 5.0 <= 0.55  # the near horizon: slots booked before it stay
    assert rate_between(slots["c"], 6.5, 9.5) == pytest.approx(RATE / 3, rel=0.2)


@pytest.mark.parametrize(
    ("spec", "algorithm"), [("20/s burst 1", "gcra"), ("20/s burst 5", "token_bucket")]
)
def test_never_above_the_total_rate(
    clocked: Limiter, clock: FakeClock, spec: str, algorithm: str
) -> None:
    limit = fair(spec, algorithm, b=3.0)
    arrivals = {"a": tasks(200), "b": tasks(100, 2.0), "c": tasks(50, 4.0), "d": tasks(5, 9.0)}
    slots = sorted(s for times in flood(clocked, clock, limit, arrivals).values() for s in times)
    # GCRA's definition: the n-th slot after any slot s is no earlier than s + (n - burst)/rate.
    burst = limit.capacity
    for i, s in enumerate(slots):
        for j in range(i + 1, len(slots)):
            if slots[j] - s >= (j - i + 1) / RATE:
                break
            assert slots[j] - s >= (j - i - burst + 1) / RATE - 1e-6


def test_waiting_tasks_come_back_spread_over_their_plan(clocked: Limiter) -> None:
    limit = fair()
    for key in "ab":
        assert clocked.acquire(limit, key, max_wait_s=60).allowed
    # 150 more of a at the same instant: a's schedule (at its share, 2 / 20 s a task) may
    # run the near horizon (0.5 s) ahead of now, so a reserves 5 of the total's slots;
    # the rest are told to come back one share interval apart from when a may reserve
    # again (0.1 s) up to the plan's reach (3 s), then among the earlier ones again.
    granted, retries = [], []
    for _ in range(150):
        decision = clocked.acquire(limit, "a", max_wait_s=60)
        if decision.allowed:
            granted.append(decision.wait_s)
        else:
            retries.append(decision.retry_after_s)
    assert granted == pytest.approx([0.05 * i for i in range(2, 7)])
    first = retries[:30]
    assert first == pytest.approx([0.1 + 0.1 * i for i in range(30)])
    assert max(retries) <= 3.0
    per_instant = Counter(round(r, 3) for r in retries).most_common(1)[0][1]
    assert per_instant == math.ceil(len(retries) / len(first))


def test_a_fair_limit_needs_a_key(clocked: Limiter) -> None:
    with pytest.raises(RequestError, match=r"is fair: it shares its rate among keys"):
        clocked.acquire(fair(), None)
    with pytest.raises(ConfigError, match=r"give it a key"):
        Rule(fair())


def test_every_key_has_a_ttl_and_idle_keys_vanish(
    clocked: Limiter, clock: FakeClock, client: redis.Redis, prefix: str
) -> None:
    limit = fair()
    for key in ("a", "b"):
        for _ in range(30):
            clocked.acquire(limit, key, max_wait_s=60)
    names = list(client.scan_iter(match=f"{prefix}:*"))
    assert len(names) == 4  # a's and b's schedules, the shared HASH and the active ZSET
    ttls = [client.pttl(name) for name in names]
    # Every key expires: after the plan (at most 3 s and a share interval ahead) and the
    # prelude's second.
    assert all(0 < ttl <= 4_100 for ttl in ttls)
    # b goes idle; a's next call, after b's plan and schedule passed, sweeps it.
    clock.advance(4.1)
    clocked.acquire(limit, "a")
    shared = client.hgetall(clocked.keyspace.state_keys(limit, "a")[1])
    assert set(shared) == {b"t", b"W", b"T", clocked.keyspace.state_keys(limit, "a")[0].encode()}
    assert float(shared[b"W"]) == 1.0


def test_settle_refunds_the_total_and_the_key(clocked: Limiter) -> None:
    limit = fair("20/s burst 1")
    first = clocked.acquire(limit, "a", cost=1, acquisition_id="t1")
    assert first.acquisition is not None
    assert not clocked.acquire(limit, "b").allowed
    assert clocked.settle(first.acquisition, 0).deltas == (-1.0,)
    assert clocked.acquire(limit, "b").allowed


def test_fair_in_a_limits_file_and_its_errors(tmp_path: Any) -> None:
    good = tmp_path / "limits.yaml"
    good.write_text(
        "limits:\n"
        "  llm: {rate: 20/s burst 1, algorithm: gcra, key: '{tenant}', fair: true,\n"
        "        weights: {enterprise: 4, free: 1.5}, cost: size, on_error: refund,\n"
        "        spacing_guard: false}\n"
    )
    rule = ThrottleConfig.load(str(good)).rule("llm")
    assert rule.limit.fair and rule.limit.weight("enterprise") == 4.0
    assert rule.limit.weight("anyone") == 1.0
    assert (rule.on_error, rule.spacing_guard) == ("refund", False)
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "limits:\n"
        "  nokey: {rate: 20/s, fair: true, cost: 2}\n"
        "  negative: {rate: 20/s, key: '{t}', fair: true, weights: {free: -1}}\n"
        "  text: {rate: 20/s, key: '{t}', fair: true, weights: {free: lots}}\n"
        "  notfair: {rate: 20/s, key: '{t}', weights: {free: 2}}\n"
        "  window: {rate: 20/s, key: '{t}', algorithm: fixed_window, fair: true}\n"
    )
    errors = {e.limit: e for e in ThrottleConfig.check(str(bad))}
    expected = {
        "nokey": ("fair", True),
        "negative": ("weights.free", -1),
        "text": ("weights.free", "lots"),
        "notfair": ("weights", {"free": 2}),
        "window": ("fair", True),
    }
    assert set(errors) == set(expected)
    for limit, (field, value) in expected.items():
        error = errors[limit]
        assert (error.source, error.field, error.value) == (str(bad), field, value)
        assert str(bad) in str(error) and f"'{limit}'" in str(error)


# -- the script and its models


@settings(max_examples=100)
@given(data=st.data())
def test_the_script_matches_its_model(client: redis.Redis, data: st.DataObject) -> None:
    spec = data.draw(st.sampled_from(["20/s burst 1", "20/s burst 3", "2/s burst 1.5", "5/m"]))
    weighted = data.draw(st.booleans())
    limit = Limit.parse(
        spec, name="fair", algorithm="gcra", fair=True, weights={"b": 2.5} if weighted else {}
    )
    period_us = limit.period_s * 1e6 / limit.count
    step = st.tuples(
        st.sampled_from(["acquire", "acquire", "acquire", "settle"]),
        st.one_of(st.just(0), st.integers(0, int(3 * period_us)), st.integers(0, 3_000_000)),
        st.sampled_from(["a", "b", "c"]),
        st.sampled_from([0.0, 1.0, 0.5, limit.capacity]),
        st.one_of(st.just(0), st.integers(0, int(30 * period_us))),
    )
    sequence = data.draw(st.lists(step, min_size=1, max_size=40))
    clock = FakeClock(EPOCH_US)
    prefix = f"f-{uuid.uuid4().hex[:12]}"
    limiter = Limiter(client, prefix=prefix, clock_us=clock)
    memory = MemoryLimiter(prefix=prefix, clock_us=clock)
    model = ModelLimiter()  # every key of weight 1: only for the unweighted limit
    done: list[tuple[Any, Any, str]] = []
    try:
        for i, (op, dt, key, cost, wait_us) in enumerate(sequence):
            clock.now_us += dt
            if op == "settle":
                if done:
                    real, mem, state_key = done[i % len(done)]
                    result = limiter.settle(real, cost)
                    assert memory.settle(mem, cost) == result, f"step {i}"
                    if not weighted:
                        expected = model.settle(
                            real.id, [(limit, state_key)], now=clock.now_us, actual=cost
                        )
                        assert (result.status, result.deltas) == expected, f"step {i}"
                continue
            ident = f"acq-{i}" if i % 2 else None
            real = limiter.acquire(
                limit, key, cost=cost, max_wait_s=wait_us / 1e6, acquisition_id=ident
            )
            mem = memory.acquire(
                limit, key, cost=cost, max_wait_s=wait_us / 1e6, acquisition_id=ident
            )
            assert mem == real, f"step {i}: {(op, dt, key, cost, wait_us)}"
            state_key = limiter.keyspace.state_keys(limit, key)[0]
            if not weighted:
                expected = model.acquire(
                    [(limit, state_key)], now=clock.now_us, cost=cost, max_wait_us=wait_us,
                    acq=ident,
                )  # fmt: skip
                assert expected[0] == real.allowed, f"step {i}"
                assert expected[2] == round(real.wait_s * 1e6), f"step {i}"
            if real.acquisition is not None:
                assert mem.acquisition is not None
                done.append((real.acquisition, mem.acquisition, state_key))
    finally:
        names = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        if names:
            client.delete(*names)


def test_a_fair_limit_with_another_limit_matches_in_memory(
    clocked: Limiter, clock: FakeClock
) -> None:
    # A per-tenant GCRA beside a fair shared limit: one script, both committed or neither.
    memory = MemoryLimiter(prefix=clocked.keyspace.prefix, clock_us=clock)
    shared = fair("20/s burst 2", "token_bucket", b=3.0)
    tenant = Limit.parse("8/s burst 1", name="tenant", algorithm="gcra")
    for i in range(200):
        key = "abc"[i % 3] if i % 7 else "a"
        targets: list[Any] = [(shared, key), (tenant, key)]
        real = clocked.acquire_many(targets, max_wait_s=0.5)
        assert memory.acquire_many(targets, max_wait_s=0.5) == real, f"call {i}"
        clock.now_us += 7_000 * (i % 5)


def test_the_spacing_guard_spaces_a_fair_limits_calls_as_one(
    clocked: Limiter, clock: FakeClock
) -> None:
    # Two tenants calling at the same instant on a burst-1 fair limit: the second waits a
    # spacing of the total (50 ms), not of its own key.
    limit = fair()
    assert clocked.space([(limit, "a", 1.0)]) == 0
    assert clocked.space([(limit, "b", 1.0)]) == pytest.approx(1 / RATE)
