"""Several limits on one acquisition: the slot is the earliest time at which every limit
conforms, and every limit keeps its own shape at the granted slots.

The same sequences go to the real scripts (a Limiter on the test clock, test redis-server)
and to the in-memory limiter; the decisions must be equal, and the granted slots are judged
by the reference models (tests/support/model.py) replayed at the slot times.
"""

from __future__ import annotations

import copy
import itertools
import math
import uuid
from collections import defaultdict
from typing import Any

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

import tests.support.model as models
from tests.support.clock import EPOCH_US, FakeClock
from tests.support.model import ModelLimiter, Params
from throttle import Acquisition, Limit, Limiter
from throttle.memory import MemoryLimiter

ALGORITHMS = ("token_bucket", "gcra", "sliding_window", "fixed_window", "concurrency")
LEASE_S = 1e6  # no lease expires during a sequence: a unit is held until released
TENANTS = ("a", "b")


def tenants_case(limiter: Limiter) -> list[tuple[str, float]]:
    tenant = Limit.parse("1/s burst 1", name="tenant", algorithm="gcra")
    shared = Limit.parse("10/s burst 1", name="global", algorithm="gcra")
    slots = []
    for _ in range(5):
        for name in ("A", "B"):
            decision = limiter.acquire_many([(tenant, name), (shared, None)], max_wait_s=60)
            assert decision.allowed
            slots.append((name, round(decision.wait_s, 6)))
    return slots


# Per-tenant 1/s burst 1 and a global 10/s burst 1, tenants A and B asking 5 times each at
# t = 0: B's calls are 0.1 s after A's (the global spacing), never on the same instant.
TENANT_SLOTS = [
    (name, float(second) + (0.1 if name == "B" else 0.0))
    for second in range(5)
    for name in ("A", "B")
]


def test_two_tenants_and_a_global_limit_never_share_a_slot(clocked: Limiter) -> None:
    assert tenants_case(clocked) == TENANT_SLOTS


def test_two_tenants_and_a_global_limit_in_memory(clock: FakeClock) -> None:
    assert tenants_case(MemoryLimiter(clock_us=clock)) == TENANT_SLOTS


def committed_state_case(limiter: Limiter) -> list[tuple[float, float]]:
    """A GCRA and a token bucket whose own slot is now, beside a limit whose slot is 1 s
    ahead: each is charged at 1 s, and its remaining and reset say so."""
    slow = Limit.parse("1/s burst 1", name="slow", algorithm="gcra")
    spaced = Limit.parse("10/s burst 1", name="spaced", algorithm="gcra")
    bucket = Limit.parse("10/s burst 5", name="bucket", algorithm="token_bucket")
    assert limiter.acquire(slow).allowed
    decision = limiter.acquire_many([(slow, None), (spaced, None), (bucket, None)], max_wait_s=5)
    assert decision.allowed and decision.wait_s == pytest.approx(1.0)
    return [(round(s.remaining, 9), round(s.reset_after_s, 6)) for s in decision.limits]


# As committed at the slot (1 s): spaced's next slot is 1.1 s (TAT), full again then; the
# bucket paid 1 token at 1 s with the refill before it unbanked: full at 1.1 s, nothing
# left now. (A limit's own slot would have said: reset 0.1 s, and 4 tokens left.)
COMMITTED = [(0.0, 2.0), (0.0, 1.1), (0.0, 1.1)]


def test_remaining_and_reset_describe_the_state_committed_at_the_common_slot(
    clocked: Limiter,
) -> None:
    assert committed_state_case(clocked) == COMMITTED


def test_remaining_and_reset_at_the_common_slot_in_memory(clock: FakeClock) -> None:
    assert committed_state_case(MemoryLimiter(clock_us=clock)) == COMMITTED


def test_a_slot_past_a_window_is_denied_and_comes_back_at_it(
    clocked: Limiter, clock: FakeClock
) -> None:
    # The GCRA's slot is 0.5 s ahead, the window ends in 0.2 s: counted in this window the
    # call would be made in the next one. Denied (nothing taken); retry at the slot.
    shaper = Limit.parse("2/s burst 1", name="shaper", algorithm="gcra")
    window = Limit.parse("5/s", name="window", algorithm="fixed_window")
    clock.now_us = clock.now_us // 1_000_000 * 1_000_000 + 800_000
    assert clocked.acquire(shaper).allowed
    denied = clocked.acquire_many([(shaper, None), (window, None)], max_wait_s=1.0)
    assert not denied.allowed
    assert denied.denied_by == ("window",)
    assert denied.retry_after_s == pytest.approx(0.5)
    assert clocked.peek(window).remaining == 5.0
    # In the next window the slot (0.3 s ahead) is within it: granted and counted in it.
    clock.advance(0.2)
    granted = clocked.acquire_many([(shaper, None), (window, None)], max_wait_s=1.0)
    assert granted.allowed and granted.wait_s == pytest.approx(0.3)
    assert clocked.peek(window).remaining == 4.0


# -- the property


@st.composite
def limit_of(draw: st.DrawFn, algorithm: str, index: int) -> Limit:
    counts = [1.0, 2.0, 2.5, 5.0, 10.0]
    if algorithm == "concurrency":
        counts.remove(2.5)  # a concurrency limit counts whole tasks in flight
    count = draw(st.sampled_from(counts))
    period_s = draw(st.sampled_from([0.1, 1.0, 3.0]))
    burst = None
    if algorithm in ("token_bucket", "gcra"):
        burst = draw(st.sampled_from([None, 1.0, 1.5, 4.0]))
    return Limit(f"{algorithm}-{index}", algorithm, count, period_s, burst)  # type: ignore[arg-type]


COMBINATIONS = [
    *itertools.combinations_with_replacement(ALGORITHMS, 2),
    *itertools.combinations_with_replacement(ALGORITHMS, 3),
]


@st.composite
def multi_case(
    draw: st.DrawFn, algorithms: tuple[str, ...]
) -> tuple[list[tuple[Limit, bool]], list[tuple[Any, ...]]]:
    """Limits of these algorithms, each keyed by tenant or shared, and a sequence of
    (step us, tenant, per-limit costs, max_wait us) or ("release", step us, pick)."""
    chosen = [draw(limit_of(algo, i)) for i, algo in enumerate(algorithms)]
    keyed = [draw(st.booleans()) for _ in chosen]
    longest = max(lim.period_s for lim in chosen) * 1e6

    def cost(lim: Limit) -> st.SearchStrategy[float]:
        return st.sampled_from([0.0, 1.0, lim.capacity]) | st.floats(0.0, lim.capacity)

    dt = st.just(0) | st.integers(0, 5_000) | st.integers(0, 100_000) | st.integers(0, int(longest))
    # Mostly a reservation horizon of several periods: the slots that several limits share.
    wait = st.just(0) | st.integers(0, int(3 * longest)) | st.just(int(10 * longest))
    acquire = st.tuples(
        st.just("acquire"), dt, st.sampled_from(TENANTS), st.tuples(*map(cost, chosen)), wait
    )
    release = st.tuples(st.just("release"), dt, st.integers(0, 100))
    sequence = draw(st.lists(acquire | acquire | acquire | release, min_size=5, max_size=40))
    return list(zip(chosen, keyed, strict=True)), sequence


EPSILON = 1e-6
"""Tokens of float rounding forgiven per call: a slot is a whole us, computed by other
floating-point operations than the replay's. A call early by a whole us or more (or a
whole token too many) still fails."""


SLACK_US = 1.0
"""How early a token bucket or GCRA call may be: a slot is rounded up to a whole us while
the state keeps the exact time, so the next slot may come up to 1 us before the rounded
one plus the spacing."""


def conforms(algo: Any, p: Params, grants: list[tuple[float, float]], code: str) -> bool:
    """The limit's own definition (its model, no reservation) at the granted slot times, in
    time order, from a fresh state."""
    slack = SLACK_US if code in ("tb", "gcra") else 0.0
    for slot, granted in sorted(grants, key=lambda g: g[0]):
        cost = max(granted - EPSILON, 0.0)
        if not algo.check("k", p, slot + slack, cost, 0)["allowed"]:
            return False
        r = algo.check("k", p, slot, cost, math.inf)  # the state as of the slot itself
        algo.commit("k", p, slot, cost, r, holder="", expiry=0.0)
    return True


FRESH = {"tb": "TokenBucket", "gcra": "Gcra", "fw": "FixedWindow", "sw": "SlidingWindow"}


@pytest.mark.parametrize("algorithms", COMBINATIONS, ids="+".join)
@settings(deadline=None, max_examples=15)
@given(data=st.data())
def test_every_limit_keeps_its_shape_at_the_earliest_common_slot(
    client: redis.Redis, algorithms: tuple[str, ...], data: st.DataObject
) -> None:
    limits, sequence = data.draw(multi_case(algorithms))
    clock = FakeClock(EPOCH_US)
    prefix = f"mm-{uuid.uuid4().hex[:12]}"
    real = Limiter(client, prefix=prefix, clock_us=clock)
    memory = MemoryLimiter(prefix=prefix, clock_us=clock)
    shadow = ModelLimiter()  # the models' state, to judge each decision against
    grants: dict[tuple[int, str | None], list[tuple[float, float]]] = defaultdict(list)
    held: list[tuple[Acquisition, list[Any], list[tuple[int, str | None, float, float]]]] = []
    released: list[tuple[int, str | None, float, float, float]] = []  # conc intervals
    try:
        for i, step in enumerate(sequence):
            clock.now_us += step[1]
            now = clock.now_us
            if step[0] == "release":
                if held:
                    acquisition, specs, units = held.pop(step[2] % len(held))
                    assert real.release(acquisition) == memory.release(acquisition)
                    shadow.finish(acquisition.id, acquisition.id, specs, now=now,
                                  actuals=[None] * len(specs))  # fmt: skip
                    released.extend((*u, float(now)) for u in units)
                continue
            _, _, tenant, costs, wait_us = step
            keys = [tenant if is_keyed else None for _, is_keyed in limits]
            targets = [(lim, key, c) for (lim, _), key, c in zip(limits, keys, costs, strict=True)]
            ident = f"t{i}"
            before = copy.deepcopy(shadow.algos)
            specs = [
                (lim.code, Params.of(lim), f"{j}:{key}")
                for j, ((lim, _), key) in enumerate(zip(limits, keys, strict=True))
            ]
            decided = real.acquire_many(
                targets, max_wait_s=wait_us / 1e6, acquisition_id=ident, lease_s=LEASE_S
            )
            assert (
                memory.acquire_many(
                    targets, max_wait_s=wait_us / 1e6, acquisition_id=ident, lease_s=LEASE_S
                )
                == decided
            ), f"step {i}"
            shadow.decide(specs, now=now, costs=list(costs), max_wait_us=wait_us, acq=ident,
                          record=ident, lease_us=LEASE_S * 1e6)  # fmt: skip
            if not decided.allowed:
                justify_denial(before, specs, costs, now, wait_us)
                continue
            slot = now + round(decided.wait_s * 1e6)
            assert_earliest(before, specs, costs, now, slot)
            units = []
            for j, ((lim, _), key, c) in enumerate(zip(limits, keys, costs, strict=True)):
                if lim.code == "conc":
                    units.append((j, key, c, float(now)))
                else:
                    grants[(j, key)].append((float(slot), c))
            assert decided.acquisition is not None
            held.append((decided.acquisition, specs, units))
        for (j, key), granted in grants.items():
            lim = limits[j][0]
            fresh = getattr(models, FRESH[lim.code])()
            assert conforms(fresh, Params.of(lim), granted, lim.code), f"{lim} key {key}: {granted}"
        open_units = [(*u, float("inf")) for _, _, units in held for u in units]
        for j, key, _, start, _ in released + open_units:
            lim = limits[j][0]
            live = sum(
                c for jj, kk, c, s, e in released + open_units
                if (jj, kk) == (j, key) and s <= start < e
            )  # fmt: skip
            assert live <= lim.capacity + 1e-9, f"{lim} key {key} over capacity at {start}"
    finally:
        found = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        if found:
            client.delete(*found)


def assert_earliest(
    before: dict[str, Any], specs: list[Any], costs: Any, now: int, slot: int
) -> None:
    """Every limit admits the cost at ``slot`` on the state before the call, and 2 us
    before it some limit does not: no slot later than the earliest common one (a wait is
    rounded up to a whole us, from a float that may be a hair above a whole number; the
    state at the slot may be short of the cost by float rounding: EPSILON)."""
    for (code, p, key), c in zip(specs, costs, strict=True):
        if code in ("tb", "gcra"):
            cost = max(c - EPSILON, 0.0)
            assert copy.deepcopy(before[code]).check(key, p, slot, cost, 0)["allowed"]
    if slot - 2 >= now:
        assert any(
            not copy.deepcopy(before[code]).check(key, p, slot - 2, c, 0)["allowed"]
            for (code, p, key), c in zip(specs, costs, strict=True)
            if code in ("tb", "gcra")
        ), "a slot later than the earliest at which every limit conforms"


def justify_denial(
    before: dict[str, Any], specs: list[Any], costs: Any, now: int, wait_us: int
) -> None:
    """A denial is explained: a limit cannot admit within max_wait alone, or the common
    slot falls past the end of a window limit's current window."""
    slot = now
    for (code, p, key), c in zip(specs, costs, strict=True):
        r = copy.deepcopy(before[code]).check(key, p, now, c, wait_us)
        if not r["allowed"]:
            return
        slot = max(slot, now + r["wait"])
    for (code, p, key), c in zip(specs, costs, strict=True):
        algo = before[code]
        read = copy.deepcopy(algo).check(key, p, now, c, 0)
        if code in ("fw", "sw") and slot >= algo.ends(p, read):
            return
    raise AssertionError("denied although every limit conforms at a slot within its window")
