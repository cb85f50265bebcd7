"""The asyncio limiter (throttle.aio.Limiter) against a real Redis: the essential cases of
test_limiter.py, awaited, and the two limiters sharing one set of limits.

Each test runs its coroutine with ``asyncio.run``: a ``redis.asyncio`` client belongs to the
event loop that made it, so each test makes its own (:func:`run`).
"""

from __future__ import annotations

import asyncio
import gc
import math
import threading
import uuid
import warnings
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis
import redis.asyncio

from tests.support.clock import FakeClock
from tests.support.servers import RedisServer, free_port
from throttle import (
    Acquire,
    BackendError,
    BackendUnavailable,
    ConfigError,
    CostExceedsCapacity,
    Decision,
    Limit,
    RequestError,
)
from throttle import Limiter as SyncLimiter
from throttle.aio import Limiter
from throttle.redis.urls import acl_rules

Body = Callable[[Limiter], Awaitable[Any]]


def run(url: str, prefix: str, body: Body, *, clock: FakeClock | None = None) -> Any:
    """Run ``body`` with an asyncio limiter on ``url`` under ``prefix``, in a fresh loop."""

    async def main() -> Any:
        client = redis.asyncio.Redis.from_url(url)
        try:
            return await body(Limiter(client, prefix=prefix, clock_us=clock))
        finally:
            await client.aclose()

    return asyncio.run(main())


@pytest.fixture
def arun(redis_url: str, prefix: str, clock: FakeClock) -> Callable[[Body], Any]:
    """``arun(body)``: ``body`` awaited with an asyncio limiter on the test clock."""
    return lambda body: run(redis_url, prefix, body, clock=clock)


def test_the_blocking_limiters_methods_all_have_an_awaited_twin() -> None:
    public = {name for name in vars(SyncLimiter) if not name.startswith("_")}
    twins = {name for name in vars(Limiter) if not name.startswith("_")}
    assert public == twins
    for name in public - {"from_url"}:
        assert asyncio.iscoroutinefunction(getattr(Limiter, name)), name


@pytest.mark.parametrize(
    ("spec", "algorithm", "retry_after_s"),
    [
        ("5/s", "token_bucket", 0.2),
        ("5/s burst 5", "gcra", 0.2),
        ("5/m", "fixed_window", None),
        ("5/m", "sliding_window", None),
    ],
    ids=lambda value: value if isinstance(value, str) and "/" not in value else None,
)
def test_each_algorithm_allows_then_denies(
    arun: Callable[[Body], Any], spec: str, algorithm: str, retry_after_s: float | None
) -> None:
    limit = Limit.parse(spec, name="api", algorithm=algorithm)

    async def body(limiter: Limiter) -> list[Decision]:
        return [await limiter.acquire(limit, "k") for _ in range(6)]

    decisions = arun(body)
    assert [d.allowed for d in decisions] == [True] * 5 + [False]
    assert all(isinstance(d, Decision) for d in decisions)
    denied = decisions[-1]
    assert denied.denied_by == ("api",)
    assert denied.retry_after_s > 0
    if retry_after_s is not None:
        assert denied.retry_after_s == pytest.approx(retry_after_s)


def test_each_target_is_taken_alone_as_of_when_it_was_asked(redis_url: str, prefix: str) -> None:
    gcra = Limit.parse("10/s burst 1", name="api", algorithm="gcra")

    async def body(limiter: Limiter) -> tuple[list[Any], list[Any]]:
        # asks that came 0.1 s apart, sent together now; then a cost that can never pass
        dated = await limiter.acquire_each(
            [(gcra, "k", 1.0)] * 3, max_wait_s=10, ago_s=[0.2, 0.1, 0.0]
        )
        mixed = await limiter.acquire_each([(gcra, "n", 2.0), (gcra, "n", 1.0)], max_wait_s=10)
        return dated, mixed

    dated, mixed = run(redis_url, prefix, body)  # on the Redis clock: dated asks need it
    assert [(d.allowed, d.wait_s) for d in dated] == [(True, 0.0)] * 3
    assert isinstance(mixed[0], CostExceedsCapacity)
    assert mixed[1].allowed


def test_a_limiter_marked_started_is_not_fenced_on_a_new_redis(redis_url: str, prefix: str) -> None:
    gcra = Limit.parse("10/s burst 1", name="api", algorithm="gcra")

    async def body(limiter: Limiter) -> Any:
        limiter.fence_s = 2.0
        await limiter.mark_started()
        return await limiter.acquire(gcra, max_wait_s=2.0)

    assert run(redis_url, prefix, body).wait_s == 0.0  # not 2 s of fence


def test_a_limiter_used_in_a_second_event_loop_says_so(redis_url: str, prefix: str) -> None:
    # Given one asyncio limiter used in an asyncio.run(), then in another
    limiter = Limiter.from_url(redis_url, prefix=prefix)
    api = Limit.parse("10/s", name="api")
    assert asyncio.run(limiter.acquire(api)).allowed
    # Then its call there names the cause, as a BackendError, not asyncio's RuntimeError
    with pytest.raises(BackendError, match=r"build the limiter \(its client\) inside each"):
        asyncio.run(limiter.acquire(api))
    # (the first loop's connection cannot be closed from another loop: collected here,
    # not in a later test, without its ResourceWarning)
    del limiter
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()


def test_a_limiter_used_by_two_running_event_loops_refuses_the_second(
    redis_url: str, prefix: str
) -> None:
    # Given one asyncio limiter in use by a loop that still runs, in another thread
    limiter = Limiter.from_url(redis_url, prefix=prefix)
    api = Limit.parse("10/s", name="api")
    in_use, done = threading.Event(), threading.Event()
    first: list[Any] = []

    async def owner() -> None:
        first.append(await limiter.acquire(api))
        in_use.set()
        while not done.is_set():
            await asyncio.sleep(0.01)
        first.append(await limiter.acquire(api))
        await limiter.client.aclose()

    thread = threading.Thread(target=asyncio.run, args=(owner(),))
    thread.start()
    try:
        assert in_use.wait(10)
        # When another loop (this thread's) calls it meanwhile
        # Then it is refused at once, naming the cause: redis-py's connections and locks
        # belong to the first loop (a waiter of the other loop could wait forever)
        with pytest.raises(BackendError, match="in use by another event loop running"):
            asyncio.run(asyncio.wait_for(limiter.acquire(api), 10))
        with pytest.raises(BackendError, match="in use by another event loop running"):
            asyncio.run(asyncio.wait_for(limiter.mark_started(), 10))
    finally:
        done.set()
        thread.join(10)
    # And the first loop's calls were not disturbed
    assert [bool(d) for d in first] == [True, True]


def test_a_batch_of_acquisitions_is_taken_in_order(redis_url: str, prefix: str) -> None:
    shared = Limit.parse("10/s burst 1", name="shared", algorithm="gcra")
    window = Limit.parse("1/h", name="tenant", algorithm="fixed_window")

    async def body(limiter: Limiter) -> list[Any]:
        return await limiter.acquire_batch([
            Acquire([(shared, None), (window, "a")], max_wait_s=1.0, acquisition_id="t1"),
            Acquire([(shared, None), (window, "a")], max_wait_s=1.0, acquisition_id="t2"),
            Acquire([(shared, None)], cost=5.0),
            Acquire([(shared, None), (window, "b")], max_wait_s=1.0),
        ])  # fmt: skip

    first, second, third, fourth = run(redis_url, prefix, body)
    assert (first.allowed, second.denied_by) == (True, ("tenant",))
    assert isinstance(third, CostExceedsCapacity)
    # the slot after t1's: 0.1 s after it, less the round trips between (awaited one by one)
    assert fourth.allowed
    assert 0.0 < fourth.wait_s <= 0.1 + 1e-6


def test_the_test_clock_moves_the_limits(arun: Callable[[Body], Any], clock: FakeClock) -> None:
    limit = Limit.parse("10/s burst 1", name="shaper", algorithm="gcra")

    async def body(limiter: Limiter) -> None:
        assert (await limiter.acquire(limit)).allowed
        denied = await limiter.acquire(limit)
        assert not denied.allowed and denied.retry_after_s == pytest.approx(0.1)
        clock.advance(0.099)
        assert not (await limiter.acquire(limit)).allowed
        clock.advance(0.001)
        assert (await limiter.acquire(limit)).allowed

    arun(body)


def test_gcra_reserves_the_next_free_slots(arun: Callable[[Body], Any]) -> None:
    limit = Limit.parse("10/s burst 1", name="shaper", algorithm="gcra")

    async def body(limiter: Limiter) -> None:
        waits = [(await limiter.acquire(limit, max_wait_s=0.35)).wait_s for _ in range(4)]
        assert waits == pytest.approx([0.0, 0.1, 0.2, 0.3])
        beyond = await limiter.acquire(limit, max_wait_s=0.35)
        assert not beyond.allowed and beyond.retry_after_s == pytest.approx(0.4)

    arun(body)


def test_token_bucket_reservation_goes_into_debt(arun: Callable[[Body], Any]) -> None:
    limit = Limit.parse("2/s burst 2", name="api")

    async def body(limiter: Limiter) -> None:
        assert (await limiter.acquire(limit, cost=2)).wait_s == 0
        reserved = await limiter.acquire(limit, cost=1, max_wait_s=1.0)
        assert reserved.allowed and reserved.wait_s == pytest.approx(0.5)

    arun(body)


def test_multi_limit_is_all_or_nothing(arun: Callable[[Body], Any]) -> None:
    tenant = Limit.parse("2/s", name="per-tenant")
    fleet = Limit.parse("100/s", name="fleet", algorithm="gcra")
    daily = Limit.parse("50000/d", name="daily", algorithm="fixed_window")
    targets = [(tenant, "acme"), (fleet, None), (daily, "acme")]

    async def body(limiter: Limiter) -> None:
        assert (await limiter.acquire_many(targets)).allowed
        assert (await limiter.acquire_many(targets)).allowed
        denied = await limiter.acquire_many(targets)
        assert not denied.allowed and denied.denied_by == ("per-tenant",)
        assert (await limiter.acquire(fleet, cost=0)).remaining == pytest.approx(98.0)
        assert (await limiter.acquire(daily, "acme", cost=0)).remaining == pytest.approx(49998.0)
        # One target with its own cost runs the one-limit script, as the blocking one does.
        one = await limiter.acquire_many([(tenant, "other", 2)], cost=5)
        assert one.allowed and one.remaining == 0
        assert tenant.code in limiter._one
        with pytest.raises(RequestError, match="appear twice"):
            await limiter.acquire_many([(tenant, "acme"), (tenant, "acme")])
        with pytest.raises(RequestError, match="at least one limit"):
            await limiter.acquire_many([])

    arun(body)


def test_settle_refunds_and_charges(arun: Callable[[Body], Any]) -> None:
    requests = Limit.parse("3/m", name="requests")
    tokens = Limit.parse("5000/m", name="tokens")

    async def body(limiter: Limiter) -> None:
        first = await limiter.acquire_many(
            [(requests, "acme", 1), (tokens, "acme", 2000)], acquisition_id="call-1"
        )
        assert first.allowed and first.acquisition is not None
        settled = await limiter.settle(first.acquisition, [None, 1200])
        assert (settled.status, settled.deltas) == ("settled", (0.0, -800.0))
        assert (await limiter.acquire(tokens, "acme", cost=0)).remaining == pytest.approx(3800)
        again = await limiter.settle(first.acquisition, 0)
        assert again.status == "already_settled"
        # A charge beyond the reservation is a debt.
        second = await limiter.acquire(tokens, "acme", cost=100, acquisition_id="call-2")
        assert second.acquisition is not None
        assert (await limiter.settle(second.acquisition, 3900)).charged == 3800.0
        assert not (await limiter.acquire(tokens, "acme")).allowed
        # The same id does not pay twice.
        await limiter.acquire(requests, "acme", acquisition_id="call-3")
        held = await limiter.acquire(requests, "acme", acquisition_id="call-3")
        assert held.allowed and held.held
        assert (await limiter.peek(requests, "acme")).remaining == pytest.approx(1.0)
        with pytest.raises(RequestError, match="1 actual costs for 2 limits"):
            await limiter.settle(first.acquisition, [5])

    arun(body)


def test_concurrency_units_are_released(arun: Callable[[Body], Any]) -> None:
    limit = Limit.parse("1 concurrent", name="streams")

    async def body(limiter: Limiter) -> None:
        first = await limiter.acquire(limit, lease_s=60)
        assert first.allowed and first.acquisition is not None
        assert not (await limiter.acquire(limit)).allowed
        assert (await limiter.release(first.acquisition)).status == "settled"
        assert (await limiter.acquire(limit)).allowed

    arun(body)


def test_peek_takes_nothing(arun: Callable[[Body], Any]) -> None:
    limit = Limit.parse("3/m", name="api")

    async def body(limiter: Limiter) -> None:
        assert (await limiter.acquire(limit, "k", cost=2)).allowed
        for _ in range(3):
            state = await limiter.peek(limit, "k")
            assert (state.limit, state.allowed, state.remaining) == ("api", True, 1.0)
        state = await limiter.peek(limit, "k", cost=2)
        assert not state.allowed and state.retry_after_s == pytest.approx(20.0)

    arun(body)


def test_hold_and_holds(arun: Callable[[Body], Any], clock: FakeClock) -> None:
    limit = Limit.parse("100/s", name="api")

    async def body(limiter: Limiter) -> None:
        assert await limiter.hold(limit, "acme", 5) == pytest.approx(5.0)
        assert await limiter.hold("api", None, None) == math.inf  # a pause
        denied = await limiter.acquire(limit, "acme")
        assert not denied.allowed and denied.retry_after_s == math.inf
        clock.advance(1)
        assert await limiter.holds() == {
            ("api", "acme"): pytest.approx(4.0),
            ("api", None): math.inf,
        }
        await limiter.unhold("api")
        assert not (await limiter.acquire(limit, "acme")).allowed  # the key's hold stays
        assert (await limiter.acquire(limit, "other")).allowed
        await limiter.unhold(limit, "acme")
        assert await limiter.holds() == {}
        with pytest.raises(RequestError, match="hold needs a limit"):
            await limiter.hold("", None, 1)

    arun(body)


def test_bad_arguments_raise_before_anything_is_sent(arun: Callable[[Body], Any]) -> None:
    limit = Limit.parse("10/s", name="api")

    async def body(limiter: Limiter) -> None:
        with pytest.raises(RequestError, match="cost must be"):
            await limiter.acquire(limit, cost=-1)
        with pytest.raises(RequestError, match="key must be"):
            await limiter.acquire(limit, "")
        with pytest.raises(CostExceedsCapacity):
            await limiter.acquire(limit, cost=11)
        with pytest.raises(RequestError, match="max_wait_s"):
            await limiter.acquire(limit, max_wait_s=math.nan)

    arun(body)


def test_both_limiters_share_the_limits(
    arun: Callable[[Body], Any], client: redis.Redis, prefix: str, clock: FakeClock
) -> None:
    blocking = SyncLimiter(client, prefix=prefix, clock_us=clock)
    limit = Limit.parse("2/m", name="shared")
    assert blocking.acquire(limit, "k").allowed

    async def body(limiter: Limiter) -> Decision:
        assert (await limiter.acquire(limit, "k")).allowed
        await limiter.hold(limit, "held", 30)
        return await limiter.acquire(limit, "k")

    assert not arun(body).allowed
    assert not blocking.acquire(limit, "k").allowed
    assert blocking.holds() == {("shared", "held"): pytest.approx(30.0)}


def test_a_full_connection_pool_says_so(redis_url: str, prefix: str) -> None:
    # Given a client whose pool holds fewer connections than the calls made at once
    api = Limit.parse("1000/s", name="api")

    async def main() -> list[Any]:
        limiter = Limiter.from_url(redis_url, prefix=prefix, max_connections=2)
        try:
            calls = (limiter.acquire(api) for _ in range(20))
            return await asyncio.gather(*calls, return_exceptions=True)
        finally:
            await limiter.client.aclose()

    # Then the calls left without a connection say what to change, not only "unreachable"
    refused = [r for r in asyncio.run(main()) if isinstance(r, BaseException)]
    assert refused
    for error in refused:
        assert isinstance(error, BackendUnavailable)
        assert "connection pool is full" in str(error)
        assert "max_connections=N" in str(error)


def test_a_limiter_from_a_url_serves_more_calls_at_once_than_redis_pys_pool(
    redis_url: str, prefix: str
) -> None:
    # redis-py's pool holds 100 connections and refuses beyond ("Too many connections",
    # read as Redis unreachable): a gevent or threads pool of 100 slots reaches that with
    # the worker's own calls. A limiter built from a URL here holds 1000.
    api = Limit.parse("100000/s", name="api")

    async def main() -> list[Any]:
        limiter = Limiter.from_url(redis_url, prefix=prefix)
        try:
            return await asyncio.gather(
                *(limiter.acquire(api) for _ in range(300)), return_exceptions=True
            )
        finally:
            await limiter.client.aclose()

    answers = asyncio.run(main())
    assert [a for a in answers if isinstance(a, BaseException)] == []
    assert all(a.allowed for a in answers)


def test_errors_are_wrapped_when_redis_is_down(prefix: str) -> None:
    limit = Limit.parse("10/s", name="api")

    async def body() -> None:
        limiter = Limiter.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_timeout=1)
        try:
            with pytest.raises(BackendUnavailable, match="unreachable"):
                await limiter.acquire(limit)
            with pytest.raises(BackendUnavailable):
                await limiter.holds()
        finally:
            await limiter.client.aclose()

    asyncio.run(body())


def test_a_refused_call_is_a_backend_error(
    redis_url: str, prefix: str, client: redis.Redis
) -> None:
    limit = Limit.parse("10/s", name="api")
    # A state key of the wrong type: Redis refuses the script's HMGET.
    state_key = SyncLimiter(client, prefix=prefix).keyspace.state_keys(limit, None)[0]
    client.set(state_key, "not a hash")

    async def body(limiter: Limiter) -> None:
        with pytest.raises(BackendError, match="refused"):
            await limiter.acquire(limit)

    run(redis_url, prefix, body)


def test_the_library_and_the_scripts_come_back_after_a_flush(private_redis: RedisServer) -> None:
    # On a server of our own (FUNCTION FLUSH, SCRIPT FLUSH), under a prefix of its own.
    limit = Limit.parse("10/s", name="api")

    async def body(limiter: Limiter) -> None:
        assert (await limiter.acquire(limit)).allowed
        assert limiter.library.functions is True
        await limiter.client.function_flush()
        assert (await limiter.acquire(limit)).allowed
        assert (await limiter.acquire_many([(limit, "a"), (limit, "b")])).allowed
        limiter.library.functions = False  # the scripts, as on Redis 6
        await limiter.client.script_flush()
        assert (await limiter.acquire(limit)).allowed
        assert (await limiter.acquire_many([(limit, "a"), (limit, "b")])).allowed

    run(private_redis.url, f"aio-flush-{uuid.uuid4().hex[:8]}", body)


def test_a_user_denied_fcall_gets_the_scripts() -> None:
    with RedisServer(acl=[f"user scripts on >pw {acl_rules()} -fcall"]) as server:
        limit = Limit.parse("2/s", name="api")

        async def body(limiter: Limiter) -> None:
            assert [bool(await limiter.acquire(limit)) for _ in range(3)] == [True, True, False]
            assert limiter.library.functions is False

        run(server.url_for("scripts", "pw"), "throttle", body, clock=FakeClock())


def test_from_url_refuses_what_it_does_not_support() -> None:
    with pytest.raises(ConfigError, match="does not support a Redis Cluster"):
        Limiter.from_url("redis+cluster://127.0.0.1:7000")
    with pytest.raises(ConfigError, match="Sentinel over TLS"):
        Limiter.from_url("rediss+sentinel://127.0.0.1:26379/svc")
    limiter = Limiter.from_url("redis://:secret@127.0.0.1:1/3")
    assert isinstance(limiter.client, redis.asyncio.Redis)
    assert limiter.client.connection_pool.connection_kwargs["socket_timeout"] == 5.0


def test_a_fair_limit_decides_as_the_blocking_limiter(
    arun: Callable[[Body], Any], clocked: SyncLimiter, clock: FakeClock
) -> None:
    # The same calls on two limits of the same definition (two names: two states), one
    # through each limiter: the same decisions.
    def limit(name: str) -> Limit:
        return Limit.parse("20/s burst 1", name=name, algorithm="gcra", fair=True,
                           weights={"b": 2})  # fmt: skip

    calls = [("a", 0), ("b", 0), ("a", 0), ("c", 10_000), ("b", 0), ("a", 200_000)] * 5

    async def body(limiter: Limiter) -> list[Decision]:
        out = []
        for key, step_us in calls:
            clock.now_us += step_us
            out.append(await limiter.acquire(limit("async"), key, max_wait_s=0.2))
        return out

    start = clock.now_us
    awaited = arun(body)
    clock.now_us = start
    blocking = []
    for key, step_us in calls:
        clock.now_us += step_us
        blocking.append(clocked.acquire(limit("blocking"), key, max_wait_s=0.2))
    strip = [(d.allowed, d.wait_s, d.retry_after_s, d.remaining) for d in awaited]
    assert strip == [(d.allowed, d.wait_s, d.retry_after_s, d.remaining) for d in blocking]
    assert {d.allowed for d in blocking} == {True, False}


BUSY_LUA = (
    "local t = redis.call('TIME') local s = t[1] * 1e6 + t[2] "
    "while true do local n = redis.call('TIME') "
    "if n[1] * 1e6 + n[2] - s > 500000 then break end end return 1"
)


def test_an_acquire_cancelled_after_its_call_left_gives_back_what_it_took(
    redis_url: str, prefix: str
) -> None:
    pool = Limit.parse("2 concurrent", name="pool")

    async def main() -> tuple[float, bool]:
        limiter = Limiter(redis.asyncio.Redis.from_url(redis_url), prefix=prefix)
        other = redis.asyncio.Redis.from_url(redis_url)
        try:
            await limiter.peek(pool)  # the library loaded, the connection open
            # Given a Redis busy for 0.5 s (another client's script) when an acquire is sent
            busy = asyncio.ensure_future(other.eval(BUSY_LUA, 0))
            await asyncio.sleep(0.1)
            taking = asyncio.ensure_future(limiter.acquire(pool, acquisition_id="gone"))
            await asyncio.sleep(0.1)
            # When the caller is cancelled (asyncio.timeout, say) before the reply
            taking.cancel()
            with pytest.raises(asyncio.CancelledError):
                await taking
            await busy
            # Then the call that Redis ran anyway is given back once it answers (waited
            # for on the Redis clock, up to a generous 10 s for a busy host)
            seconds, micros = await other.time()
            until = seconds + micros / 1e6 + 10
            while (await limiter.peek(pool)).remaining != 2:
                seconds, micros = await other.time()
                if seconds + micros / 1e6 > until:
                    break
                await asyncio.sleep(0.01)
            remaining = (await limiter.peek(pool)).remaining
            # and the connection still answers in order
            after = await limiter.acquire(pool)
            return remaining, after.allowed and after.remaining == 1
        finally:
            await limiter.client.aclose()
            await other.aclose()

    remaining, ordered = asyncio.run(main())
    assert remaining == 2  # both units free: not held until the lease's end (300 s)
    assert ordered


@pytest.mark.parametrize("retrier", ["same", "other"], ids=["same-limiter", "other-limiter"])
def test_a_retry_of_a_cancelled_acquire_keeps_what_it_took(
    private_redis: RedisServer, prefix: str, retrier: str
) -> None:
    one = Limit.parse("1 concurrent", name="one")
    redis_url = private_redis.url  # CLIENT PAUSE: never on a server the tests did not start

    async def main() -> tuple[Decision, float, Decision, str]:
        limiter = Limiter(redis.asyncio.Redis.from_url(redis_url), prefix=prefix)
        other = Limiter(redis.asyncio.Redis.from_url(redis_url), prefix=prefix)
        admin = redis.asyncio.Redis.from_url(redis_url)
        give_back = limiter._give_back_now

        async def slow_give_back(*args: Any) -> None:
            await asyncio.sleep(0.3)  # a slow network: the give-back arrives late
            await give_back(*args)

        limiter._give_back_now = slow_give_back  # type: ignore[method-assign]
        try:
            await limiter.peek(one)  # the library loaded, the connections open
            await other.peek(one)
            # Given an acquire cancelled while Redis holds its clients' commands for
            # 0.2 s: its call runs all the same, and what it took is given back, late
            await admin.execute_command("CLIENT", "PAUSE", 200, "ALL")
            taking = asyncio.ensure_future(limiter.acquire(one, acquisition_id="task-1"))
            await asyncio.sleep(0.1)
            taking.cancel()
            with pytest.raises(asyncio.CancelledError):
                await taking
            await asyncio.sleep(0.2)  # the call ran; its give-back is on its way
            # When the caller retries it under the same id (as the docs advise), from
            # this limiter or another one (another process, say)
            by = limiter if retrier == "same" else other
            retried = await by.acquire(one, acquisition_id="task-1")
            # Then, once the give-back is over, the retry still holds the unit: nobody
            # else gets it, and its own settle releases it
            await asyncio.sleep(0.4)
            remaining = (await by.peek(one)).remaining
            intruder = await by.acquire(one, acquisition_id="task-2")
            assert retried.acquisition is not None
            settled = await by.settle(retried.acquisition, 0.0)
            return retried, remaining, intruder, settled.status
        finally:
            await limiter.client.aclose()
            await other.client.aclose()
            await admin.aclose()

    retried, remaining, intruder, status = asyncio.run(main())
    assert retried.allowed
    assert remaining == 0
    assert not intruder.allowed
    assert status == "settled", status
