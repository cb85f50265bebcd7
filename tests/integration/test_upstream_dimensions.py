"""Limits that follow one dimension of their upstream (``upstream: tokens``), through a real
Redis: one response steers a requests limit and a tokens limit apart (holds, rates down and
back up), an operator's rate stays the ceiling, the Celery binding passes the dimension,
and GitHub's secondary limit is told from a plain 403 by its body, sync and async."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest
import redis
import redis.asyncio
from celery import Celery

from tests.support.clock import FakeClock
from tests.support.eager import eager_app
from throttle import Limit, Limiter
from throttle import aio as throttle_aio
from throttle.adaptive import Adaptive, LearnedRates
from throttle.celery import report_cost, throttled
from throttle.celery.estimates import Estimates
from throttle.rates import RateBook
from throttle.refusals import RefusalBook
from throttle.rules import Rule
from throttle.upstream import apply_upstream, parse_upstream, report_upstream
from throttle.upstream.dialects import GITHUB_SECONDARY_S
from throttle.upstream.policy import Target, apply_signal

REQUESTS = Limit.parse("600/m burst 10", name="openai-requests")
TOKENS = Limit.parse("120000/m", name="openai-tokens")


def openai(limit_tokens: int = 120000, **headers: str) -> dict[str, str]:
    """OpenAI's headers: 600 requests and ``limit_tokens`` tokens per minute, plenty left."""
    return {
        "x-ratelimit-limit-requests": "600",
        "x-ratelimit-remaining-requests": "590",
        "x-ratelimit-reset-requests": "1s",
        "x-ratelimit-limit-tokens": str(limit_tokens),
        "x-ratelimit-remaining-tokens": str(limit_tokens - 10000),
        "x-ratelimit-reset-tokens": "5s",
        **{name.replace("_", "-"): value for name, value in headers.items()},
    }


class Provider:
    """One call's two limits, answered as a worker's hook answers them."""

    def __init__(self, limiter: Limiter, rates: RateBook, learned: LearnedRates | None = None):
        self.limiter, self.rates, self.learned = limiter, rates, learned
        self.adaptive: Adaptive | None = None

    def answer(
        self, status: int, headers: dict[str, str], tokens: float = 5000
    ) -> dict[int, float]:
        signal = parse_upstream(status, headers)
        assert signal is not None
        targets = [
            Target(self.rates.current(REQUESTS), REQUESTS, None, True, dimension="requests"),
            Target(
                self.rates.current(TOKENS), TOKENS, None, False, self.adaptive,
                self.rates.current(TOKENS), "tokens", tokens,
            ),
        ]  # fmt: skip
        return apply_signal(self.limiter, self.rates, signal, targets, self.learned)


@pytest.fixture
def provider(clocked: Limiter, client: redis.Redis) -> Provider:
    return Provider(clocked, RateBook(client, clocked.keyspace, refresh_s=0))


def test_a_stated_token_limit_moves_the_tokens_limit_only_down_and_back_up(
    provider: Provider,
) -> None:
    rates = provider.rates
    # Given the provider's steady word: both limits as configured, nothing stored
    provider.answer(200, openai())
    assert rates.overrides() == {} and rates.followed("openai-tokens") is None
    # When it halves its token limit and says so: the tokens limit follows, in tokens
    # (its cost is an estimate, not one per call), and the requests limit does not move
    provider.answer(200, openai(60000))
    assert rates.overrides() == {"openai-tokens": "60000/60s burst 60000"}
    assert rates.current(TOKENS).rate_per_s == 1000
    assert rates.current(REQUESTS) == REQUESTS
    assert provider.limiter.holds() == {}  # a stated policy alone holds nothing
    # When it raises it part way, then back to where we were configured: up again
    provider.answer(200, openai(90000))
    assert rates.current(TOKENS).rate_per_s == 1500
    provider.answer(200, openai(150000))  # more than configured: the configured rate
    assert rates.overrides() == {} and rates.current(TOKENS) == TOKENS
    # A response that states no tokens limit (requests only) leaves a followed rate alone
    provider.answer(200, openai(60000))
    requests_only = {k: v for k, v in openai().items() if k.endswith("-requests")}
    provider.answer(200, requests_only)
    assert rates.current(TOKENS).rate_per_s == 1000


def test_the_operators_rate_is_the_ceiling_and_the_last_word(provider: Provider) -> None:
    rates = provider.rates
    rates.set(TOKENS, "90000/m")
    provider.answer(200, openai(60000))
    assert rates.current(TOKENS).rate_per_s == 1000  # the lower of the two
    assert rates.overrides() == {"openai-tokens": "60000/60s burst 60000"}
    provider.answer(200, openai(120000))  # back up: to the operator's rate, not the file's
    assert rates.current(TOKENS).rate_per_s == 1500
    provider.answer(200, openai(60000))
    rates.set(TOKENS, "100000/m")  # an operator's word drops the upstream's
    assert rates.followed("openai-tokens") is None
    assert rates.current(TOKENS).rate_per_s == pytest.approx(100000 / 60)
    provider.answer(200, openai(60000))
    rates.clear("openai-tokens")  # back to the file: both gone
    assert rates.overrides() == {} and rates.current(TOKENS) == TOKENS
    # An operator above the file: the provider's word may follow up to it
    rates.set(TOKENS, "180000/m")
    provider.answer(200, openai(150000))
    assert rates.current(TOKENS).rate_per_s == 2500
    # A followed rate written by hand that does not parse is not in force
    provider.rates.client.hset(provider.limiter.keyspace.followed_rates_key(), "openai-tokens", "x")
    assert rates.current(TOKENS).rate_per_s == 3000


def test_a_refusal_holds_only_the_dimension_it_blames(provider: Provider, clock: FakeClock) -> None:
    limiter = provider.limiter
    # Tokens spent: the tokens limit is held for retry-after-ms, the requests limit runs on
    assert provider.answer(429, openai(x_ratelimit_remaining_tokens="0", retry_after_ms="1500"))
    assert limiter.holds() == {("openai-tokens", None): pytest.approx(1.5)}
    assert limiter.acquire(REQUESTS).allowed
    assert not limiter.acquire(TOKENS, cost=1).allowed
    clock.advance(2.0)
    # 3,000 tokens left for a call of 5,000: remaining is not 0, the tokens are to blame
    provider.answer(429, openai(x_ratelimit_remaining_tokens="3000", retry_after_ms="700"))
    assert limiter.holds() == {("openai-tokens", None): pytest.approx(0.7)}
    clock.advance(1.0)
    # A refusal that blames no dimension is everyone's
    provider.answer(429, openai(retry_after_ms="700"))
    assert set(limiter.holds()) == {("openai-tokens", None), ("openai-requests", None)}
    clock.advance(1.0)
    # Tokens spent for minutes on a success: the tokens limit holds before the 429
    provider.answer(200, openai(x_ratelimit_remaining_tokens="0", x_ratelimit_reset_tokens="6m0s"))
    assert limiter.holds() == {("openai-tokens", None): pytest.approx(360)}


def test_an_adaptive_limit_learns_its_dimensions_stated_rate(
    clocked: Limiter, client: redis.Redis
) -> None:
    learned = LearnedRates(client, clocked.keyspace)
    provider = Provider(clocked, RateBook(client, clocked.keyspace, refresh_s=0), learned)
    provider.adaptive = Adaptive()
    provider.answer(200, openai(60000))
    assert learned.states() == {("openai-tokens", None): pytest.approx(1000)}


def test_a_limit_following_no_dimension_reads_the_response_whole(
    clocked: Limiter, client: redis.Redis
) -> None:
    rates = RateBook(client, clocked.keyspace, refresh_s=0)
    plain = Limit.parse("600/m burst 10", name="plain")
    # OpenAI's per-dimension policy lowers nothing that does not follow a dimension
    apply_upstream(clocked, httpx.Response(200, headers=openai(60000)), plain, rates=rates)
    assert rates.overrides() == {}
    # and a refusal holds it, whichever dimension is to blame
    spent = openai(x_ratelimit_remaining_tokens="0", retry_after_ms="1500")
    apply_upstream(clocked, httpx.Response(429, headers=spent), plain, rates=rates)
    assert clocked.holds() == {("plain", None): pytest.approx(1.5)}
    # A limit that follows a dimension, answered in generic headers only: the whole answer
    follows = Limit.parse("100/s", name="follows")
    apply_upstream(clocked, httpx.Response(429, headers={"Retry-After": "30"}), follows,
                   dimension="tokens")  # fmt: skip
    assert clocked.holds()[("follows", None)] == pytest.approx(30)


def test_the_asyncio_twin_follows_a_dimension(clocked: Limiter, redis_url: str) -> None:
    async def body() -> dict[str, str]:
        aclient = redis.asyncio.Redis.from_url(redis_url)
        try:
            limiter = throttle_aio.Limiter(aclient, prefix=clocked.keyspace.prefix)
            rates = throttle_aio.RateBook(aclient, limiter.keyspace, refresh_s=0)
            hook = throttle_aio.upstream_hook(limiter, TOKENS, rates=rates, dimension="tokens")
            transport = httpx.MockTransport(lambda _: httpx.Response(200, headers=openai(30000)))
            hooks = {"response": [hook]}
            async with httpx.AsyncClient(transport=transport, event_hooks=hooks) as http:
                await http.get("https://api.openai.test/v1/models")
            assert await rates.followed_rates() == await rates.overrides()
            return await rates.overrides()
        finally:
            await aclient.aclose()

    assert asyncio.run(body()) == {"openai-tokens": "30000/60s burst 30000"}
    with pytest.raises(Exception, match="name of an upstream dimension"):
        throttle_aio.upstream_hook(throttle_aio.Limiter(redis.asyncio.Redis()), TOKENS,
                                   dimension="input tokens")  # fmt: skip


GITHUB = {
    "x-ratelimit-limit": "5000",
    "x-ratelimit-remaining": "4000",
    "x-ratelimit-reset": "1900000000",
    "x-ratelimit-resource": "core",
}
SECONDARY = b'{"message": "You have exceeded a secondary rate limit."}'
FORBIDDEN = b'{"message": "Resource not accessible by integration"}'


def github_api(request: httpx.Request) -> httpx.Response:
    body = SECONDARY if request.url.path == "/busy" else FORBIDDEN
    return httpx.Response(403, headers=GITHUB, content=body)


def test_a_github_403_is_read_by_its_body_in_a_hook(clocked: Limiter) -> None:
    """Hooks run before the client reads the body: the parser reads it, for GitHub's
    ambiguous 403 only, and the body is still there for the caller."""
    github = Limit.parse("5000/h", name="github")
    seen = []

    def hook(response: httpx.Response) -> None:
        seen.append(apply_upstream(clocked, response, github, dimension="core"))

    transport = httpx.MockTransport(github_api)
    with httpx.Client(transport=transport, event_hooks={"response": [hook]}) as http:
        assert http.get("https://api.github.test/forbidden").content == FORBIDDEN
        assert seen[-1] is None and clocked.holds() == {}
        assert http.get("https://api.github.test/busy").content == SECONDARY
    assert seen[-1] is not None and seen[-1].hold_s == GITHUB_SECONDARY_S
    assert clocked.holds() == {("github", None): pytest.approx(GITHUB_SECONDARY_S)}


def test_a_github_403_is_read_by_its_body_in_an_async_hook(
    clocked: Limiter, redis_url: str
) -> None:
    async def body() -> dict[tuple[str, str | None], float]:
        aclient = redis.asyncio.Redis.from_url(redis_url)
        try:
            limiter = throttle_aio.Limiter(aclient, prefix=clocked.keyspace.prefix)
            github = Limit.parse("5000/h", name="github")
            hook = throttle_aio.upstream_hook(limiter, github, dimension="core")
            transport = httpx.MockTransport(github_api)
            hooks = {"response": [hook]}
            async with httpx.AsyncClient(transport=transport, event_hooks=hooks) as http:
                assert (await http.get("https://api.github.test/forbidden")).content == FORBIDDEN
                assert await limiter.holds() == {}
                assert (await http.get("https://api.github.test/busy")).content == SECONDARY
            return await limiter.holds()
        finally:
            await aclient.aclose()

    holds = asyncio.run(body())
    assert holds == {("github", None): pytest.approx(GITHUB_SECONDARY_S, abs=0.5)}


# -- the Celery binding, in eager mode -------------------------------------------------


@pytest.fixture
def eager(redis_url: str, prefix: str) -> Iterator[Celery]:
    limits = {
        "openai-requests": {"rate": "600/m", "burst": 10, "upstream": "requests"},
        "openai-tokens": {"rate": "120000/m", "cost": "estimate", "upstream": "tokens"},
    }
    with eager_app("dimensions-eager", redis_url, prefix, limits) as app:
        yield app


def test_report_upstream_steers_each_limit_by_its_dimension(
    eager: Celery, client: redis.Redis, prefix: str
) -> None:
    @eager.task(shared=False)
    @throttled("openai-requests", "openai-tokens")
    def complete(estimate: int, headers: dict[str, str]) -> None:
        report_upstream(httpx.Response(200, headers=headers))

    complete.delay(4000, openai(60000)).get()
    limiter = Limiter(client, prefix=prefix)
    rates = RateBook(client, limiter.keyspace)
    assert rates.overrides() == {"openai-tokens": "60000/60s burst 60000"}
    spent = openai(x_ratelimit_remaining_tokens="0", x_ratelimit_reset_tokens="1m0s")
    complete.delay(4000, spent).get()
    assert set(limiter.holds()) == {("openai-tokens", None)}
    limiter.client.delete(limiter.keyspace.holds_key())


def test_a_refusal_that_blames_a_dimension_holds_it_at_once(
    eager: Celery, client: redis.Redis, prefix: str
) -> None:
    """The binding answers refusals in proportion (one 429 of a call early by jitter holds
    nothing), but a 429 whose headers say the tokens are spent is no jitter: the tokens
    limit is held at the first one, the requests limit is not."""

    @eager.task(shared=False)
    @throttled("openai-requests", "openai-tokens")
    def complete(estimate: int, headers: dict[str, str]) -> None:
        report_upstream(httpx.Response(429, headers=headers))

    refused = complete.delay(4000, openai(x_ratelimit_remaining_tokens="0", retry_after_ms="1500"))
    refused.get()
    limiter = Limiter(client, prefix=prefix)
    assert limiter.holds() == {("openai-tokens", None): pytest.approx(1.5, abs=0.2)}
    # The record says so per limit: the tokens limit held, the requests limit not
    book = RefusalBook(client, limiter.keyspace)
    (tokens,) = book.read("openai-tokens")
    (requests,) = book.read("openai-requests")
    assert (tokens.task_id, tokens.held, tokens.hold_s) == (refused.id, True, 1.5)
    assert (requests.task_id, requests.held) == (refused.id, False)
    # A 429 blaming no dimension, whose wait jitter and rounding explain (a second, at
    # 10/s), is judged in proportion: one refusal holds nothing
    limiter.client.delete(limiter.keyspace.holds_key())
    complete.delay(4000, openai(retry_after_ms="1000")).get()
    assert limiter.holds() == {}


def test_an_estimated_cost_is_reserved_at_the_share_its_calls_use(
    redis_url: str, client: redis.Redis, prefix: str
) -> None:
    """A tokens limit that follows its upstream reserves, once its calls have reported a
    few costs, the share of the estimate they use (spacing the slots by what calls cost,
    not by max_tokens), and still charges the whole estimate to a call that reports
    nothing."""
    limits = {
        "tokens": {
            "algorithm": "fixed_window", "rate": "1000000/d", "cost": "estimate",
            "upstream": "tokens",
        }
    }  # fmt: skip
    limit = Limit.parse("1000000/d", name="tokens", algorithm="fixed_window")
    limiter = Limiter(client, prefix=prefix)
    inside: list[float] = []
    with eager_app("estimates-eager", redis_url, prefix, limits) as app:

        @app.task(shared=False)
        @throttled("tokens")
        def complete(estimate: int, used: int | None) -> None:
            inside.append(limiter.peek(limit).remaining)  # with this call's reservation
            if used is not None:
                report_cost(used)

        # Given three calls estimated at 1,000 tokens that used 500 each
        for _ in range(3):
            complete.delay(1000, 500).get()
        assert inside == [999000, 998500, 998000]  # each reserved the whole estimate
        assert limiter.peek(limit).remaining == 1000000 - 1500
        # When the next call runs, it reserves 500; one that reports nothing pays 1,000
        complete.delay(1000, 500).get()
        complete.delay(1000, None).get()
    assert inside[3:] == [998000, 997500]
    assert limiter.peek(limit).remaining == 1000000 - 2000 - 1000


def test_a_process_that_settles_nothing_reserves_the_fleets_share(
    client: redis.Redis, prefix: str
) -> None:
    """A worker's consumer decides the reservations of the tasks it holds, but the pool
    children settle them: it reads the share they learned from Redis."""
    keyspace = Limiter(client, prefix=prefix).keyspace
    now = [0.0]
    child = Estimates(client, keyspace, refresh_s=2.0, monotonic=lambda: now[0])
    consumer = Estimates(client, keyspace, refresh_s=2.0, monotonic=lambda: now[0])
    rule = Rule(TOKENS, cost="estimate", upstream="tokens")
    targets = [(TOKENS, None, 250.0)]
    assert consumer.scaled([rule], targets)[0] == targets  # nothing learned anywhere yet
    for _ in range(3):
        child.settled({"openai-tokens": 250.0}, {"openai-tokens": 200.0})
    assert consumer.scaled([rule], targets)[0] == targets  # read 2 s ago at most: not yet
    now[0] += 2.0
    assert consumer.scaled([rule], targets)[0] == [(TOKENS, None, pytest.approx(200.0))]
    # A share written by hand that is no share is ignored
    client.hset(keyspace.estimate_shares_key(), "openai-tokens", "lots")
    now[0] += 2.0
    assert consumer.scaled([rule], targets)[0] == targets
