"""Property tests: every Lua script agrees exactly with its Python reference model.

Hypothesis draws limits and sequences of (time step, cost, reservation horizon, settle);
the same sequence goes to the real script in Redis (through the test clock), to its model
(throttle/memory/, re-exported by tests/support/model.py) and to the in-memory limiter
built on the models (throttle.memory.MemoryLimiter, the one users' eager tests run on).
Decisions, remaining tokens, retry_after and reset must be identical.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st

from tests.support.clock import EPOCH_US, FakeClock
from tests.support.model import ModelLimiter
from throttle import Decision, KeySpace, Limit, Limiter, RequestError
from throttle.adaptive import Adaptive, LearnedRates
from throttle.memory import MemoryLimiter

ALGORITHMS = ("token_bucket", "gcra", "sliding_window", "fixed_window", "concurrency")


@st.composite
def limits(draw: st.DrawFn, algorithm: str | None = None) -> Limit:
    algo = algorithm or draw(st.sampled_from(ALGORITHMS))
    counts = [1.0, 2.0, 3.0, 2.5, 7.0, 100.0]
    if algo == "concurrency":
        counts.remove(2.5)  # a concurrency limit counts whole tasks in flight
    count = draw(st.sampled_from(counts))
    period_s = draw(st.sampled_from([0.05, 1.0, 3.0, 60.0, 3600.0, 86400.0]))
    burst = None
    if algo in ("token_bucket", "gcra"):
        burst = draw(st.sampled_from([None, 1.0, 1.5, 4.0]))
    name = f"{algo}-{draw(st.integers(0, 999))}"
    return Limit(name, algo, count, period_s, burst)  # type: ignore[arg-type]


def steps(capacity: float, period_us: float) -> st.SearchStrategy[list[tuple[Any, ...]]]:
    dt = st.one_of(
        st.just(0),
        st.integers(0, 2_000),
        st.integers(0, int(2 * period_us)),
        st.integers(-1_000, 0),  # Redis TIME may step back a little
        st.integers(-int(period_us), 0),  # or across a window edge
    )
    cost = st.one_of(
        st.sampled_from([0.0, 1.0, 0.5, 2.0]).filter(lambda c: c <= capacity),
        st.floats(0.0, capacity, allow_nan=False),
    )
    wait = st.one_of(st.just(0), st.integers(0, int(3 * period_us)))
    # Ids from a small pool: the same id comes back (a redelivery, a re-acquire after settle).
    ident = st.one_of(st.none(), st.sampled_from(["a", "b", "c"]))
    acquire = st.tuples(st.just("acquire"), dt, cost, wait, ident)
    settle = st.tuples(
        st.just("settle"), dt, st.integers(0, 50), st.one_of(st.none(), cost), st.booleans()
    )
    return st.lists(st.one_of(acquire, acquire, settle), min_size=1, max_size=40)


def summary(decision: Decision) -> tuple[Any, ...]:
    def us(seconds: float) -> int:
        return round(seconds * 1e6)

    per_limit = tuple(
        (s.allowed, s.remaining, us(s.retry_after_s), us(s.reset_after_s)) for s in decision.limits
    )
    return (
        decision.allowed,
        decision.held,
        us(decision.wait_s),
        us(decision.late_s if decision.held else decision.retry_after_s),
        per_limit,
    )


def run_against_model(
    client: redis.Redis, targets: list[tuple[Limit, str | None]], sequence: list[tuple[Any, ...]]
) -> None:
    clock = FakeClock(EPOCH_US)
    prefix = f"m-{uuid.uuid4().hex[:12]}"
    limiter = Limiter(client, prefix=prefix, clock_us=clock)
    model = ModelLimiter()
    memory = MemoryLimiter(prefix=prefix, clock_us=clock)
    model_targets = [(lim, limiter.keyspace.state_keys(lim, key)[0]) for lim, key in targets]
    acquisitions: list[Any] = []
    in_memory: list[Any] = []  # the memory limiter's acquisitions, beside the real ones
    try:
        for i, step in enumerate(sequence):
            clock.now_us += step[1]
            if step[0] == "acquire":
                _, _, cost, wait_us, acq = step
                if acq is None and any(lim.code == "conc" for lim, _ in targets):
                    acq = f"generated-{i}"  # what the limiter would generate, but known
                expected = model.acquire(
                    model_targets, now=clock.now_us, cost=cost, max_wait_us=wait_us, acq=acq
                )
                # A list of costs is one per limit: the limiter takes (limit, key, cost).
                call_targets: list[Any] = list(targets)
                if isinstance(cost, list):
                    call_targets = [(*t, c) for t, c in zip(targets, cost, strict=True)]
                    cost = 1.0
                if expected == ("mismatch",):
                    for one in (limiter, memory):
                        with pytest.raises(RequestError, match="already holds a lease"):
                            one.acquire_many(
                                call_targets,
                                cost=cost,
                                max_wait_s=wait_us / 1e6,
                                acquisition_id=acq,
                            )
                    continue
                real = limiter.acquire_many(
                    call_targets, cost=cost, max_wait_s=wait_us / 1e6, acquisition_id=acq
                )
                assert summary(real) == expected, f"step {i}: {step}"
                mem = memory.acquire_many(
                    call_targets, cost=cost, max_wait_s=wait_us / 1e6, acquisition_id=acq
                )
                assert mem == real, f"step {i} (memory limiter): {step}"
                if real.acquisition:
                    acquisitions.append(real.acquisition)
                    in_memory.append(mem.acquisition)
            elif acquisitions:
                _, _, pick, actual, _ = step
                acquisition = acquisitions[pick % len(acquisitions)]
                result = limiter.settle(acquisition, actual)
                expected_settle = model.settle(
                    acquisition.id, model_targets, now=clock.now_us, actual=actual
                )
                assert (result.status, result.deltas) == expected_settle, f"step {i}: {step}"
                mem_result = memory.settle(in_memory[pick % len(in_memory)], actual)
                assert mem_result == result, f"step {i} (memory limiter): {step}"
    finally:
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            client.delete(*keys)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@given(data=st.data())
def test_each_script_matches_its_model(
    client: redis.Redis, algorithm: str, data: st.DataObject
) -> None:
    limit = data.draw(limits(algorithm))
    sequence = data.draw(steps(limit.capacity, limit.period_s * 1e6))
    if data.draw(st.booleans()):
        # The cost as the limit's own ((limit, key, cost): the one-limit script takes it too),
        # and the actual cost of a settle as a sequence of one.
        for i, step in enumerate(sequence):
            if step[0] == "acquire":
                sequence[i] = (step[0], step[1], [step[2]], *step[3:])
            elif step[3] is not None:
                sequence[i] = (*step[:3], [step[3]], *step[4:])
    run_against_model(client, [(limit, "k")], sequence)


@st.composite
def multi_case(draw: st.DrawFn) -> tuple[list[tuple[Limit, str | None]], list[tuple[Any, ...]]]:
    chosen = draw(st.lists(limits(), min_size=2, max_size=4, unique_by=lambda lim: lim.name))
    targets = [(lim, draw(st.sampled_from([None, "tenant-a"]))) for lim in chosen]
    capacity = min(lim.capacity for lim in chosen)
    period_us = min(lim.period_s for lim in chosen) * 1e6
    sequence = draw(steps(capacity, period_us))
    if draw(st.booleans()):
        # Each limit its own cost (1 request and 2000 tokens), on acquire and on settle.
        def own(lim: Limit) -> st.SearchStrategy[float]:
            return st.sampled_from([0.0, 1.0, lim.capacity]) | st.floats(0.0, lim.capacity)

        for i, step in enumerate(sequence):
            per_limit = [draw(own(lim)) for lim in chosen]
            if step[0] == "acquire":
                sequence[i] = (step[0], step[1], per_limit, *step[3:])
            elif step[3] is not None:
                actual = [draw(st.none() | own(lim)) for lim in chosen]
                sequence[i] = (*step[:3], actual, *step[4:])
    return targets, sequence


@given(case=multi_case())
def test_multi_limit_matches_model(client: redis.Redis, case: Any) -> None:
    targets, sequence = case
    run_against_model(client, targets, sequence)


# -- lua/adapt.lua: the learned state of adaptive limits ---------------------------------


@given(data=st.data())
def test_the_adapt_script_matches_its_model(client: redis.Redis, data: st.DataObject) -> None:
    # One limit and key, two books (the script in Redis, the model in memory) on one clock
    rate = data.draw(st.sampled_from([0.5, 3.0, 20.0, 1000.0]), label="ceiling")
    limit = Limit.parse(f"{rate}/s burst 1", name="api", algorithm="gcra")
    learning = (
        None
        if data.draw(st.booleans(), label="not adaptive")
        else Adaptive(
            floor_per_s=data.draw(st.sampled_from([None, rate / 3, rate])),
            decrease=data.draw(st.sampled_from([0.5, 0.7, 0.8, 0.99])),
            recover_s=data.draw(st.sampled_from([0.5, 10.0, 60.0])),
        )
    )
    clock = FakeClock(EPOCH_US)
    keyspace = KeySpace(f"t-{uuid.uuid4().hex[:12]}", "ns")
    books = [
        LearnedRates(client, keyspace, clock_us=clock),
        LearnedRates(MemoryLimiter().client, keyspace, clock_us=clock),
    ]
    event = st.sampled_from(["refuse", "refuse", "success", "success", "success", "state", "read"])
    steps = st.tuples(
        event,
        st.one_of(st.just(0), st.integers(0, 300_000), st.integers(0, 20_000_000)),
        st.floats(0.0, 5.0, allow_nan=False),  # reserved s, for refusals
        st.sampled_from([None, rate / 4, rate / 2, rate * 2]),  # the rate of the call
        st.floats(0.01, 2 * rate, allow_nan=False),  # a stated rate
    )
    try:
        for kind, dt, reserved, at, stated in data.draw(st.lists(steps, max_size=40)):
            clock.now_us += dt
            answers = []
            for book in books:
                if kind == "refuse":
                    answers.append(
                        book.refused(limit, None, learning, rate_per_s=at, reserved_s=reserved)
                    )
                elif learning is None:
                    answers.append(book.refused(limit, None, None))  # counts only
                elif kind == "success":
                    answers.append(book._call("success", limit, None, learning))
                elif kind == "state":
                    answers.append(book.stated(limit, None, learning, stated))
                else:
                    answers.append(book.read(limit, None, learning))
            assert answers[0] == answers[1], (kind, answers)
    finally:
        for name in client.scan_iter(match=keyspace.learned_pattern()):
            client.delete(name)
