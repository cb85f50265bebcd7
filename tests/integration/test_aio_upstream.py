"""The upstream's word in asyncio code: throttle.aio.upstream_hook on an httpx.AsyncClient
(an httpx.MockTransport upstream), apply_upstream and the asyncio RateBook, against a real
Redis, judged through both limiters."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import pytest
import redis
import redis.asyncio

from tests.support.clock import FakeClock
from throttle import ConfigError, Limit, RequestError, Throttled, throttled_in
from throttle import Limiter as SyncLimiter
from throttle.adaptive import Adaptive
from throttle.adaptive import LearnedRates as SyncLearnedRates
from throttle.aio import (
    LearnedRates,
    Limiter,
    RateBook,
    RefusalBook,
    apply_upstream,
    upstream_hook,
)
from throttle.rates import RateBook as SyncRateBook
from throttle.refusals import RefusalBook as SyncRefusalBook
from throttle.upstream import apply_upstream as sync_apply_upstream


class Upstream:
    """An API that answers each call with the next of ``replies`` (status, headers), then
    200s; it records the calls."""

    def __init__(self, *replies: tuple[int, dict[str, str]]) -> None:
        self.replies = list(replies)
        self.calls = 0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.calls += 1
        status, headers = self.replies.pop(0) if self.replies else (200, {})
        return httpx.Response(status, headers=headers, text="body")


def run(redis_url: str, prefix: str, clock: FakeClock, body: Callable[..., Any]) -> Any:
    """``body(limiter, rates)`` awaited in a fresh loop, with clients of that loop."""

    async def main() -> Any:
        client = redis.asyncio.Redis.from_url(redis_url)
        limiter = Limiter(client, prefix=prefix, clock_us=clock)
        try:
            return await body(limiter, RateBook(client, limiter.keyspace, refresh_s=0))
        finally:
            await client.aclose()

    return asyncio.run(main())


@pytest.fixture
def arun(redis_url: str, prefix: str, clock: FakeClock) -> Callable[[Callable[..., Any]], Any]:
    return lambda body: run(redis_url, prefix, clock, body)


def test_a_429_through_the_hook_holds_the_limit_fleet_wide(
    arun: Callable[[Callable[..., Any]], Any], clocked: SyncLimiter, clock: FakeClock
) -> None:
    limit = Limit.parse("30/s burst 1", name="api", algorithm="gcra")
    upstream = Upstream((200, {}), (429, {"Retry-After": "2"}))

    async def body(limiter: Limiter, rates: RateBook) -> None:
        hook = upstream_hook(limiter, limit)
        transport = httpx.MockTransport(upstream)
        async with httpx.AsyncClient(transport=transport, event_hooks={"response": [hook]}) as http:
            assert (await http.get("https://api.test/a")).status_code == 200
            assert await limiter.holds() == {}
            refused = await http.get("https://api.test/b")
            assert refused.status_code == 429  # returned as usual without retry
        assert await limiter.holds() == {("api", None): pytest.approx(2.0)}
        denied = await limiter.acquire(limit, "any-key")
        assert not denied.allowed and denied.retry_after_s == pytest.approx(2.0)

    arun(body)
    # The blocking limiter (a Celery worker's) sees the same hold.
    assert not clocked.acquire(limit).allowed
    clock.advance(2.0)
    assert clocked.acquire(limit).allowed


def test_retry_raises_throttled_with_the_hold_after_placing_it(
    arun: Callable[[Callable[..., Any]], Any],
) -> None:
    limit = Limit.parse("10/s", name="api")
    upstream = Upstream((429, {"Retry-After": "3"}), (503, {}))

    async def body(limiter: Limiter, rates: RateBook) -> None:
        hook = upstream_hook(limiter, limit, "acct-1", retry=True)
        transport = httpx.MockTransport(upstream)
        async with httpx.AsyncClient(transport=transport, event_hooks={"response": [hook]}) as http:
            with pytest.raises(Throttled) as info:
                await http.get("https://api.test/a")
            assert info.value.retry_after_s == 3.0
            assert info.value.denied_by == ("api",)
            # A 503 without Retry-After or a spent quota is not a refusal for the rate.
            assert (await http.get("https://api.test/b")).status_code == 503
        assert await limiter.holds() == {("api", "acct-1"): pytest.approx(3.0)}
        assert (await limiter.acquire(limit, "acct-2")).allowed

    arun(body)
    assert upstream.calls == 2


def test_a_keyed_limit_is_held_for_that_key_and_its_rate_left_alone(
    arun: Callable[[Callable[..., Any]], Any],
) -> None:
    limit = Limit.parse("30/s burst 1", name="per-account", algorithm="gcra")
    response = httpx.Response(429, headers={"Retry-After": "1", "RateLimit-Policy": "1;w=1"})

    async def body(limiter: Limiter, rates: RateBook) -> None:
        signal = await apply_upstream(limiter, response, limit, "acct-1", rates=rates)
        assert signal is not None and signal.refused and signal.rate_per_s == 1
        assert await limiter.holds() == {("per-account", "acct-1"): pytest.approx(1.0)}
        assert await rates.overrides() == {}

    arun(body)


def test_a_slower_stated_policy_lowers_the_run_time_rate_never_raises_it(
    arun: Callable[[Callable[..., Any]], Any], client: redis.Redis, clocked: SyncLimiter
) -> None:
    limit = Limit.parse("30/s burst 1", name="api", algorithm="gcra")

    def stated(quota: int, window: int) -> httpx.Response:
        return httpx.Response(200, headers={"RateLimit-Policy": f'"p";q={quota};w={window}'})

    async def body(limiter: Limiter, rates: RateBook) -> None:
        await apply_upstream(limiter, stated(40, 1), limit, rates=rates)  # faster: nothing
        assert await rates.overrides() == {}
        await apply_upstream(limiter, stated(20, 1), limit, rates=rates)
        assert await rates.overrides() == {"api": "20/1s burst 1"}
        assert (await rates.current(limit)).rate_per_s == 20
        await apply_upstream(limiter, stated(25, 1), limit, rates=rates)  # never raised
        assert (await rates.current(limit)).rate_per_s == 20
        assert await limiter.holds() == {}  # a policy alone holds nothing

    arun(body)
    # The blocking book (a Celery worker's) follows the same hash.
    sync_rates = SyncRateBook(client, clocked.keyspace, refresh_s=0)
    assert sync_rates.current(limit).rate_per_s == 20

    async def clear(limiter: Limiter, rates: RateBook) -> None:
        await rates.clear("api")
        assert await rates.current(limit) == limit

    arun(clear)
    assert sync_rates.current(limit) == limit


def test_a_spent_quota_on_a_success_holds_before_the_429(
    arun: Callable[[Callable[..., Any]], Any], clock: FakeClock
) -> None:
    limit = Limit.parse("5000/h", name="github")
    reset = str(int(time.time()) + 300)
    upstream = Upstream((200, {"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": reset}))

    async def body(limiter: Limiter, rates: RateBook) -> None:
        hook = upstream_hook(limiter, limit, retry=True)  # not a refusal: no Throttled
        transport = httpx.MockTransport(upstream)
        async with httpx.AsyncClient(transport=transport, event_hooks={"response": [hook]}) as http:
            assert (await http.get("https://api.test/")).status_code == 200
        held = (await limiter.holds())[("github", None)]
        assert held == pytest.approx(300, abs=2)
        assert not (await limiter.acquire(limit)).allowed
        clock.advance(held)
        assert (await limiter.acquire(limit)).allowed

    arun(body)


def test_the_rate_book_caches_for_refresh_s(
    redis_url: str, prefix: str, client: redis.Redis
) -> None:
    limit = Limit.parse("30/s", name="api")
    now = [0.0]

    async def body() -> None:
        aclient = redis.asyncio.Redis.from_url(redis_url)
        try:
            keyspace = Limiter(aclient, prefix=prefix).keyspace
            rates = RateBook(aclient, keyspace, refresh_s=2, monotonic=lambda: now[0])
            assert await rates.current(limit) == limit
            SyncRateBook(client, keyspace).set(limit, "5/s")  # another process
            assert await rates.current(limit) == limit  # cached
            now[0] = 2.0
            assert (await rates.current(limit)).rate_per_s == 5
            with pytest.raises(ConfigError):
                await rates.set(limit, "fast please")
            client.hset(keyspace.rates_key(), "api", "not a rate")  # by hand
            now[0] = 4.0
            assert await rates.current(limit) == limit  # ignored, not an error
        finally:
            await aclient.aclose()

    asyncio.run(body())


def test_refusals_through_the_hook_are_kept_in_the_fleets_record(
    arun: Callable[[Callable[..., Any]], Any], clocked: SyncLimiter
) -> None:
    # Given a hook with a record of refusals, and an upstream that refuses twice
    limit = Limit.parse("30/s burst 1", name="api", algorithm="gcra")
    upstream = Upstream((429, {"Retry-After": "2"}), (200, {}), (503, {"Retry-After": "1"}))

    async def body(limiter: Limiter, rates: RateBook) -> list[Any]:
        record = RefusalBook(limiter.client, limiter.keyspace)
        hook = upstream_hook(limiter, limit, "acme", refusals=record)
        transport = httpx.MockTransport(upstream)
        async with httpx.AsyncClient(transport=transport, event_hooks={"response": [hook]}) as http:
            for path in ("a", "b", "c"):
                await http.get(f"https://api.test/{path}")
        # and apply_upstream without a book records nothing
        await apply_upstream(limiter, httpx.Response(429, headers={"Retry-After": "3"}), limit)
        return await record.read("api")

    newest, oldest = arun(body)
    # Then each refusal is one entry, newest first, with its status, header and hold
    assert (oldest.key, oldest.status, oldest.header, oldest.hold_s, oldest.held) == (
        "acme", 429, "Retry-After", 2.0, True,
    )  # fmt: skip
    assert (newest.status, newest.hold_s, newest.task_id) == (503, 1.0, None)
    # and the blocking book (what celery throttle refusals reads) sees the same entries
    sync = SyncRefusalBook(clocked.client, clocked.keyspace)
    assert [entry.status for entry in sync.read("api", key="acme")] == [503, 429]


def test_bad_arguments_are_refused_at_once(arun: Callable[[Callable[..., Any]], Any]) -> None:
    async def body(limiter: Limiter, rates: RateBook) -> None:
        with pytest.raises(RequestError, match="expected a Limit"):
            upstream_hook(limiter, "api")  # type: ignore[arg-type]
        limit = Limit.parse("1/s", name="api")
        with pytest.raises(RequestError, match="status_code and headers"):
            await apply_upstream(limiter, "not a response", limit)
        assert await apply_upstream(limiter, httpx.Response(200), limit) is None
        assert math.isinf(await limiter.hold(limit))  # the limiter still works

    arun(body)


def test_with_a_learned_book_the_hook_answers_in_proportion_and_learns(
    arun: Callable[[Callable[..., Any]], Any], clocked: SyncLimiter, clock: FakeClock
) -> None:
    # Given an adaptive limit and an upstream that refuses with only Retry-After: 1
    limit = Limit.parse("20/s burst 1", name="api", algorithm="gcra")
    learning = Adaptive(decrease=0.5)
    refusals = [(429, {"Retry-After": "1"})] * 10
    upstream = Upstream((200, {}), *refusals)

    async def body(limiter: Limiter, rates: RateBook) -> tuple[float, float]:
        book = LearnedRates(limiter.client, limiter.keyspace, clock_us=clock)
        hook = upstream_hook(limiter, limit, learned=book, adaptive=learning, retry=True)
        transport = httpx.MockTransport(upstream)
        async with httpx.AsyncClient(transport=transport, event_hooks={"response": [hook]}) as http:
            assert (await http.get("https://api.test/a")).status_code == 200
            # When one call is refused: Throttled for the task, no hold for the limit
            with pytest.raises(Throttled):
                await http.get("https://api.test/b")
            assert await limiter.holds() == {}
            lowered = (await book.current(limit, None, learning)).rate_per_s
            # When refusals persist (half of what 10/s calls in a second: 5)
            count, _ = book.persist_for(lowered)
            for _ in range(count - 1):
                with pytest.raises(Throttled):
                    await http.get("https://api.test/c")
            held = (await limiter.holds())[("api", None)]
        return lowered, held

    lowered, held = arun(body)
    # Then the rate was halved once (one episode), and the limit is held now
    assert lowered == pytest.approx(10.0)
    assert held == pytest.approx(1.0)
    # and a blocking book reads the same learned state
    sync = SyncLearnedRates(clocked.client, clocked.keyspace, clock_us=clock)
    assert sync.read(limit, None, learning).rate_per_s == pytest.approx(10.0)


def test_an_sdks_exception_holds_the_limit_as_its_response_would(
    arun: Callable[[Callable[..., Any]], Any], clocked: SyncLimiter, clock: FakeClock
) -> None:
    # Given the error an SDK raised for a refused call (openai's, on httpx2)
    limit = Limit.parse("30/s burst 1", name="api", algorithm="gcra")
    request = httpx2.Request("POST", "https://api.openai.com/v1/chat/completions")
    refused = httpx2.Response(429, headers={"retry-after-ms": "1500"}, request=request)
    error = openai.RateLimitError("rate limited", response=refused, body=None)

    # When the asyncio code and the plain helper are handed the exception itself
    async def body(limiter: Limiter, rates: RateBook) -> Any:
        return await apply_upstream(limiter, error, limit, "acct-1")

    signal = arun(body)
    # Then the limit is held for the provider's time, for that key, fleet-wide
    assert signal is not None and signal.hold_s == pytest.approx(1.5)
    assert not clocked.acquire(limit, "acct-1").allowed
    assert clocked.acquire(limit, "acct-2").allowed
    assert sync_apply_upstream(clocked, error, limit, "acct-3") == signal
    assert not clocked.acquire(limit, "acct-3").allowed


def test_behind_an_sdk_that_wraps_its_clients_errors_the_hooks_throttled_is_found(
    arun: Callable[[Callable[..., Any]], Any],
) -> None:
    # Given AsyncAnthropic (which wraps any exception of its HTTP client as
    # APIConnectionError) on a client with the hook, and an API that answers 429
    limit = Limit.parse("50/m", name="anthropic-requests")
    error = {"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}

    async def answer(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(429, headers={"retry-after": "3"}, json=error)

    async def body(limiter: Limiter, rates: RateBook) -> None:
        hook = upstream_hook(limiter, limit, retry=True)
        http = httpx2.AsyncClient(
            transport=httpx2.MockTransport(answer), event_hooks={"response": [hook]}
        )
        sdk = anthropic.AsyncAnthropic(
            api_key="k", base_url="https://api.test", max_retries=0, http_client=http
        )
        with pytest.raises(anthropic.APIConnectionError) as info:
            await sdk.messages.create(
                model="m", max_tokens=1, messages=[{"role": "user", "content": "hi"}]
            )
        await http.aclose()
        # Then the hook's Throttled is found in the SDK's exception, with the hold
        refused = throttled_in(info.value)
        assert refused is not None and refused.retry_after_s == 3.0
        assert refused.denied_by == ("anthropic-requests",)
        assert await limiter.holds() == {("anthropic-requests", None): pytest.approx(3.0)}
        assert throttled_in(RuntimeError("a network error")) is None

    arun(body)
