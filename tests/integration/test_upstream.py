"""The upstream's word (throttle/upstream/, throttle/celery/upstream.py): the header parser
(a table, and fuzzed), holds and lowered rates through a real Redis, the Celery form in
eager mode, and a real ``celery worker`` fleet that follows an API lowering its limit
mid-run."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextvars
import email.utils
import logging
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import redis
import requests
from celery import Celery
from hypothesis import given
from hypothesis import strategies as st

from tests.support.clock import FakeClock, redis_now_s
from tests.support.eager import close_throttler
from tests.support.servers import RedisServer
from throttle import KeySpace, Limit, Limiter, RequestError, Throttled
from throttle.adaptive import LearnedRates
from throttle.celery import ThrottledTask, report_cost, throttled
from throttle.celery.runtime import Throttler
from throttle.rates import RateBook
from throttle.refusals import Refusal, RefusalBook
from throttle.testing import upstream_response
from throttle.upstream import (
    DEFAULT_HOLD_S,
    MAX_HOLD_S,
    MAX_WINDOW_S,
    UpstreamSignal,
    apply_upstream,
    parse_upstream,
    report_upstream,
    upstream_hook,
)
from workers import mock_api
from workers.harness import Api, Worker, start_api, wait_ready

NOW = 1_763_776_800.0  # epoch s, 2025-11-22 02:00 UTC
DATE = email.utils.formatdate(NOW, usegmt=True)


def _signal(
    refused: bool,
    hold_s: float,
    source: str = "",
    quota: float | None = None,
    window_s: float | None = None,
) -> UpstreamSignal:
    return UpstreamSignal(refused, hold_s, source, quota, window_s)


# -- the parser --------------------------------------------------------------------------

CASES = [
    pytest.param(429, {"Retry-After": "3"}, _signal(True, 3, "Retry-After"), id="429-delta"),
    pytest.param(
        429,
        {"Retry-After": email.utils.formatdate(NOW + 30, usegmt=True), "Date": DATE},
        _signal(True, 30, "Retry-After"),
        id="429-http-date-against-date",
    ),
    pytest.param(
        429,
        {"Retry-After": email.utils.formatdate(NOW + 12, usegmt=True)},
        _signal(True, 12, "Retry-After"),
        id="429-http-date-against-now",
    ),
    pytest.param(
        429,
        {"Retry-After": email.utils.formatdate(NOW - 60, usegmt=True)},
        _signal(True, 0, "Retry-After"),
        id="429-http-date-passed",
    ),
    pytest.param(429, {}, _signal(True, DEFAULT_HOLD_S, "default"), id="429-bare"),
    pytest.param(
        429, {"Retry-After": "soon"}, _signal(True, DEFAULT_HOLD_S, "default"), id="429-garbage"
    ),
    pytest.param(
        429, {"X-RateLimit-Reset": "7"}, _signal(True, 7, "X-RateLimit-Reset"), id="429-reset-only"
    ),
    pytest.param(
        429,
        {"x-ratelimit-remaining": "0", "x-ratelimit-reset-after": "2.5", "x-ratelimit-reset": "9"},
        _signal(True, 2.5, "X-RateLimit-Reset-After"),
        id="429-discord-fractional-reset-after",
    ),
    pytest.param(
        429,
        {"Retry-After": "4", "X-RateLimit-Remaining": "0", "X-RateLimit-Reset": str(NOW + 60)},
        _signal(True, 4, "Retry-After"),
        id="429-retry-after-wins-over-reset",
    ),
    pytest.param(
        200,
        {"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": str(int(NOW) + 600)},
        _signal(False, 600, "X-RateLimit-Reset"),
        id="200-github-epoch-spent",
    ),
    pytest.param(
        200,
        {"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": str(int(NOW) + 600), "Date": DATE},
        _signal(False, 600, "X-RateLimit-Reset"),
        id="200-github-epoch-against-date",
    ),
    pytest.param(
        200,
        {"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": str(int(NOW * 1000) + 90_000)},
        _signal(False, 90, "X-RateLimit-Reset"),
        id="200-epoch-milliseconds",
    ),
    pytest.param(
        200,
        {"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": "1"},
        None,
        id="200-spent-but-reset-within-rounding",
    ),
    pytest.param(
        200,
        {"X-RateLimit-Remaining": "3", "X-RateLimit-Reset": "600", "X-RateLimit-Limit": "5000"},
        None,
        id="200-quota-left-and-no-window",
    ),
    pytest.param(
        200,
        {"RateLimit-Remaining": "0", "RateLimit-Reset": "30"},
        _signal(False, 30, "RateLimit-Reset"),
        id="200-ietf-draft-06-fields",
    ),
    pytest.param(
        200,
        {"RateLimit": '"default";r=0;t=3', "RateLimit-Policy": '"default";q=100;w=60'},
        _signal(False, 3, "RateLimit", 100, 60),
        id="200-ietf-structured",
    ),
    pytest.param(
        200,
        {"RateLimit": '"burst";r=7;t=1, "daily";r=0;t=3600'},
        _signal(False, 3600, "RateLimit"),
        id="200-ietf-second-policy-spent",
    ),
    pytest.param(
        200,
        {"RateLimit": "limit=100, remaining=0, reset=30"},
        _signal(False, 30, "RateLimit"),
        id="200-ietf-dictionary-form",
    ),
    pytest.param(
        200,
        {"RateLimit-Policy": '"burst";q=10;w=1, "day";q=1000;w=86400'},
        _signal(False, 0, "", 1000, 86400),
        id="200-policy-slowest-of-two",
    ),
    pytest.param(
        200,
        {"RateLimit-Policy": "10;w=1;burst=20"},
        _signal(False, 0, "", 10, 1),
        id="200-policy-draft-07",
    ),
    pytest.param(
        200,
        {"X-RateLimit-Limit": "100, 100;w=60"},
        _signal(False, 0, "", 100, 60),
        id="200-x-limit-with-window",
    ),
    pytest.param(
        200,
        {"RateLimit-Policy": '"p";q=100;w=99999999999', "X-RateLimit-Limit": "5000"},
        None,
        id="200-absurd-window-ignored",
    ),
    pytest.param(403, {"Content-Type": "text/plain"}, None, id="403-not-a-rate-limit"),
    pytest.param(
        403,
        {"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": str(int(NOW) + 1200)},
        _signal(True, 1200, "X-RateLimit-Reset"),
        id="403-github-primary",
    ),
    pytest.param(
        403, {"Retry-After": "60"}, _signal(True, 60, "Retry-After"), id="403-github-secondary"
    ),
    pytest.param(
        503, {"Retry-After": "120"}, _signal(True, 120, "Retry-After"), id="503-retry-after"
    ),
    pytest.param(503, {}, None, id="503-bare"),
    pytest.param(
        429,
        {"Retry-After": str(10 * 86400)},
        _signal(True, MAX_HOLD_S, "Retry-After"),
        id="429-clamped-to-a-day",
    ),
    pytest.param(
        429,
        [("retry-after", "5"), ("RETRY-AFTER", "8")],
        _signal(True, DEFAULT_HOLD_S, "default"),
        id="429-two-values-joined-not-a-number",
    ),
    pytest.param(
        200,
        {"X-RATELIMIT-REMAINING": "0", "x-RateLimit-Reset": "45"},
        _signal(False, 45, "X-RateLimit-Reset"),
        id="200-names-any-case",
    ),
]


@pytest.mark.parametrize(("status", "headers", "expected"), CASES)
def test_the_parser_reads_every_dialect(
    status: int, headers: Any, expected: UpstreamSignal | None
) -> None:
    signal = parse_upstream(status, headers, now=NOW)
    if expected is None:
        assert signal is None
    else:
        assert signal is not None
        assert signal.hold_s == pytest.approx(expected.hold_s, abs=1e-6)
        assert signal == UpstreamSignal(
            expected.refused, signal.hold_s, expected.source, expected.quota, expected.window_s,
            error=status >= 400,
        )  # fmt: skip


NAMES = [
    "Retry-After", "Date", "RateLimit", "RateLimit-Policy", "RateLimit-Limit",
    "RateLimit-Remaining", "RateLimit-Reset", "X-RateLimit-Limit", "X-RateLimit-Remaining",
    "X-RateLimit-Reset", "X-RateLimit-Reset-After",
]  # fmt: skip
NUMBERISH = st.one_of(
    st.integers(-(10**20), 10**20).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(str),
    st.decimals(allow_nan=False, allow_infinity=False, places=3).map(str),
    st.sampled_from(["", " ", "0", "0.0", "-0", "1e9", "00000000000000000000000001", "ÿ"]),
)
DATES = st.datetimes().map(email.utils.format_datetime)
MEMBER = st.builds(
    lambda key, params: key + "".join(f";{k}={v}" for k, v in params),
    st.sampled_from(['"default"', "100", "", '"q', "limit=0", "remaining=0", "reset=5"]),
    st.lists(st.tuples(st.sampled_from(["q", "w", "r", "t", "x", ""]), NUMBERISH), max_size=4),
)
STRUCTURED = st.lists(MEMBER, min_size=1, max_size=3).map(", ".join)
VALUES = st.one_of(st.text(max_size=40), NUMBERISH, DATES, STRUCTURED)


@given(
    status=st.one_of(st.sampled_from([200, 403, 429, 503]), st.integers(-1000, 1000)),
    headers=st.dictionaries(st.one_of(st.sampled_from(NAMES), st.text(max_size=12)), VALUES),
)
def test_any_header_values_give_a_signal_or_none_never_an_exception(
    status: int, headers: dict[str, str]
) -> None:
    signal = parse_upstream(status, headers, now=NOW)
    if signal is None:
        assert status != 429
        return
    assert 0.0 <= signal.hold_s <= MAX_HOLD_S
    assert signal.refused == (status == 429) or (signal.refused and status in (403, 503))
    assert (signal.quota is None) == (signal.window_s is None)
    if signal.quota is not None and signal.window_s is not None:
        assert 0 < signal.quota < math.inf
        assert 0 < signal.window_s <= MAX_WINDOW_S
        assert signal.rate_per_s is not None and signal.rate_per_s > 0


# -- holds and rates through a real Redis, without Celery --------------------------------


@pytest.fixture(scope="module")
def one_per_second() -> Iterator[Api]:
    running = start_api(1.0, 1.0)
    yield running
    running.stop()


@pytest.fixture
def api(one_per_second: Api) -> Api:
    """The mock API at one call a second, strict, refilled for each test."""
    one_per_second.api.set_limit(1.0, 1.0)
    one_per_second.api.reset()
    return one_per_second


def refused(api: Api, session: requests.Session) -> requests.Response:
    """Calls until the mock API answers 429 (the second call, at 1/s burst 1)."""
    for _ in range(3):
        response = session.post(f"{api.url}/call", timeout=5)
        if response.status_code == 429:
            return response
    raise AssertionError("the mock API never refused")


def test_a_429_holds_the_limit_fleet_wide_for_retry_after(
    clocked: Limiter, clock: FakeClock, api: Api
) -> None:
    limit = Limit.parse("30/s burst 1", name="api", algorithm="gcra")
    with requests.Session() as session:
        response = refused(api, session)
    signal = apply_upstream(clocked, response, limit)
    assert signal is not None and signal.refused
    assert (signal.hold_s, signal.source) == (1.0, "Retry-After")
    assert clocked.holds() == {("api", None): pytest.approx(1.0)}
    denied = clocked.acquire(limit, "any-key")
    assert not denied.allowed and denied.retry_after_s == pytest.approx(1.0)
    clock.advance(1.0)
    assert clocked.acquire(limit).allowed


def test_apply_upstream_keeps_a_refusal_in_the_record_when_given_the_book(
    limiter: Limiter, api: Api, client: redis.Redis, prefix: str
) -> None:
    limit = Limit.parse("30/s burst 1", name="api", algorithm="gcra")
    book = RefusalBook(client, KeySpace(prefix))
    with requests.Session() as session:
        response = refused(api, session)
        assert apply_upstream(limiter, response, limit, "acme", refusals=book) is not None
        served = session.post(f"{api.url}/stats", timeout=5)  # not a /call: nothing refused
    apply_upstream(limiter, served, limit, "acme", refusals=book)
    (entry,) = book.read("api")
    assert (entry.key, entry.task_id, entry.status, entry.header, entry.held) == (
        "acme", None, 429, "Retry-After", True,
    )  # fmt: skip


def test_a_keyed_limit_is_held_for_that_key_and_its_rate_left_alone(
    clocked: Limiter, api: Api, client: redis.Redis
) -> None:
    limit = Limit.parse("30/s burst 1", name="per-account", algorithm="gcra")
    rates = RateBook(client, clocked.keyspace, refresh_s=0)
    with httpx.Client() as http:
        http.post(f"{api.url}/call")
        response = http.post(f"{api.url}/call")
    assert response.status_code == 429
    apply_upstream(clocked, response, limit, "acct-1", rates=rates)
    assert clocked.holds() == {("per-account", "acct-1"): pytest.approx(1.0)}
    assert clocked.acquire(limit, "acct-2").allowed
    # The upstream stated 1/s for this account: one rate per limit cannot say that.
    assert rates.overrides() == {}


def test_a_slower_stated_policy_lowers_the_run_time_rate_never_raises_it(
    clocked: Limiter, client: redis.Redis
) -> None:
    rates = RateBook(client, clocked.keyspace, refresh_s=0)
    limit = Limit.parse("30/s burst 1", name="api", algorithm="gcra")

    def stated(quota: int, window: int) -> UpstreamSignal | None:
        response = httpx.Response(200, headers={"RateLimit-Policy": f'"p";q={quota};w={window}'})
        return apply_upstream(clocked, response, limit, rates=rates)

    stated(40, 1)  # faster than the limit: nothing
    assert rates.overrides() == {}
    stated(20, 1)
    assert rates.overrides() == {"api": "20/1s burst 1"}
    assert rates.current(limit).rate_per_s == 20
    assert rates.current(limit).algorithm is limit.algorithm
    stated(25, 1)  # the upstream is back up: only an operator goes back
    assert rates.current(limit).rate_per_s == 20
    stated(600, 60)
    assert rates.current(limit).rate_per_s == 10
    assert clocked.holds() == {}  # a policy alone holds nothing
    rates.clear("api")
    assert rates.current(limit) == limit
    # A window keeps its count as its capacity; a token bucket's burst is capped by the quota.
    daily = Limit.parse("100000/d", name="daily", algorithm="fixed_window")
    apply_upstream(clocked, httpx.Response(200, headers={"X-RateLimit-Limit": "1000;w=86400"}),
                   daily, rates=rates)  # fmt: skip
    bucket = Limit.parse("100/s", name="bucket")
    apply_upstream(clocked, httpx.Response(200, headers={"RateLimit-Policy": "10;w=1"}),
                   bucket, rates=rates)  # fmt: skip
    assert rates.overrides() == {"daily": "1000/86400s", "bucket": "10/1s burst 10"}


def test_a_spent_quota_on_a_success_holds_before_the_429(
    clocked: Limiter, clock: FakeClock
) -> None:
    limit = Limit.parse("5000/h", name="github")
    response = httpx.Response(
        200,
        headers={"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": str(int(time.time()) + 300)},
    )
    signal = apply_upstream(clocked, response, limit)
    assert signal is not None and not signal.refused
    assert signal.hold_s == pytest.approx(300, abs=2)
    assert not clocked.acquire(limit).allowed
    clock.advance(signal.hold_s)
    assert clocked.acquire(limit).allowed


def test_hooks_outside_a_task_hold_nothing_and_retry_raises_throttled(
    limiter: Limiter, api: Api
) -> None:
    with requests.Session() as session:
        session.hooks["response"].append(upstream_hook())
        assert session.post(f"{api.url}/call", timeout=5).status_code == 200
        assert session.post(f"{api.url}/call", timeout=5).status_code == 429
        session.hooks["response"] = [upstream_hook(retry=True)]
        with pytest.raises(Throttled) as info:
            session.post(f"{api.url}/call", timeout=5)
        assert info.value.retry_after_s == 1.0
    assert limiter.holds() == {}
    with pytest.raises(RequestError, match="status_code and headers"):
        report_upstream("not a response")


# -- the Celery form, in eager mode (in process) -----------------------------------------


@pytest.fixture
def eager(redis_url: str, prefix: str) -> Iterator[Celery]:
    app = Celery("upstream-eager", set_as_current=False, task_cls=ThrottledTask)
    app.conf.update(
        task_always_eager=True,
        throttle_redis_url=redis_url,
        throttle_config={
            "settings": {"prefix": prefix},
            "limits": {
                "api": {"algorithm": "gcra", "rate": "30/s", "burst": 1},
                "tokens": {"rate": "100000/m", "cost": "estimate"},
                "per-account": {"algorithm": "gcra", "rate": "30/s", "burst": 1,
                                "key": "{account}"},
                "slow": {"algorithm": "gcra", "rate": "2/s", "burst": 1},
                "slow-learner": {"algorithm": "gcra", "rate": "2/s", "burst": 1,
                                 "adaptive": True},
            },
        },
    )  # fmt: skip
    yield app
    close_throttler(app)


def test_report_upstream_holds_the_tasks_limits_and_lowers_the_request_rate(
    eager: Celery, api: Api, client: redis.Redis, prefix: str
) -> None:
    @eager.task(shared=False)
    @throttled("api", "tokens", "per-account")
    def call(account: str, estimate: int) -> int:
        with httpx.Client(event_hooks={"response": [upstream_hook()]}) as http:
            return http.post(f"{api.url}/call").status_code

    assert call.delay("acct-1", 500).get() == 200
    assert call.delay("acct-1", 500).get() == 429
    limiter = Limiter(client, prefix=prefix)
    holds = limiter.holds()
    # Every limit of the task faster than the upstream's stated 1/s: the unkeyed ones
    # whole, the keyed one for the task's key. Not "api": the first answer (200, stating
    # 1/s) lowered it to the stated rate, so one refusal of it is answered in proportion
    # (the task comes back; a hold when refusals persist).
    assert set(holds) == {("tokens", None), ("per-account", "acct-1")}
    assert all(0.5 < left <= 1.0 for left in holds.values())
    # The upstream stated 1/s: the request limit follows; the token budget (500 per call,
    # not the upstream's units) and the keyed limit (one account's word) keep their rates.
    assert RateBook(client, limiter.keyspace).overrides() == {"api": "1/1s burst 1"}


def test_every_refusal_is_recorded_per_limit_with_its_key_task_status_header_and_hold(
    eager: Celery, api: Api, client: redis.Redis, prefix: str
) -> None:
    @eager.task(shared=False)
    @throttled("tokens", "per-account")
    def call(account: str, estimate: int) -> int:
        with httpx.Client(event_hooks={"response": [upstream_hook()]}) as http:
            return http.post(f"{api.url}/call").status_code

    started = redis_now_s(client)
    assert call.delay("acct-1", 5).get() == 200  # served: nothing recorded
    refused = call.delay("acct-1", 5)
    assert refused.get() == 429
    book = RefusalBook(client, KeySpace(prefix))
    (entry,) = book.read("per-account")
    assert (entry.limit, entry.key, entry.task_id, entry.status, entry.held) == (
        "per-account", "acct-1", refused.id, 429, True,
    )  # fmt: skip
    assert entry.header == "Retry-After" and 0 < entry.hold_s <= 1.0
    assert entry.task is not None and entry.task.endswith("call")
    assert entry.at is not None and started - 0.01 <= entry.at <= redis_now_s(client) + 0.01
    assert [e.key for e in book.read("tokens")] == [None]
    assert book.read("per-account", key="acct-2") == []


def test_the_record_of_refusals_is_capped_per_limit(client: redis.Redis, prefix: str) -> None:
    book = RefusalBook(client, KeySpace(prefix), max_entries=10)
    for i in range(500):
        book.record([Refusal("api", f"k{i % 3}", f"t{i}", "task", 429, "Retry-After", 1.0,
                             True)])  # fmt: skip
    assert client.xlen(KeySpace(prefix).refusals_key("api")) == 10  # exactly the cap
    newest = book.read("api", count=3)
    assert [e.task_id for e in newest] == ["t499", "t498", "t497"]
    assert [e.task_id for e in book.read("api", key="k1", count=2)] == ["t499", "t496"]
    # by age (Redis 6.2+): an entry older than keep_s goes when the next one is recorded
    stream = KeySpace(prefix).refusals_key("old")
    client.xadd(stream, {"limit": "old", "task_id": "ancient"}, id="1000-0")  # epoch + 1 s
    aged = RefusalBook(client, KeySpace(prefix), keep_s=60.0, clock=lambda: redis_now_s(client))
    aged.record([Refusal("old", None, "last", None, None, "", 0.0, False)])
    assert [e.task_id for e in book.read("old")] == ["last"]
    # and a read shows none older, though the stream keeps them until the next record
    stream = KeySpace(prefix).refusals_key("older")
    client.xadd(stream, {"limit": "older", "task_id": "aged"}, id="2000-0")
    client.xadd(stream, {"limit": "older", "task_id": "new"})
    assert [e.task_id for e in aged.read("older")] == ["new"]
    assert [e.task_id for e in book.read("older")] == ["new", "aged"]


def test_a_lone_refusal_holds_nothing_and_persisting_ones_hold_the_limit(
    eager: Celery, api: Api, client: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given an API that says only "429 Retry-After: 1" (no policy to compare the limit
    # with), whose clock stands still: one call passes, then every call is refused
    @eager.task(shared=False)
    @throttled("slow", "slow-learner")
    def call() -> int:
        with requests.Session() as session:
            session.hooks["response"].append(upstream_hook())
            return session.post(f"{api.url}/call", timeout=5).status_code

    api.api.retry_after_only = True
    now = time.monotonic()
    monkeypatch.setattr(mock_api, "time", SimpleNamespace(monotonic=lambda: now, time=time.time))
    limiter = Limiter(client, prefix=prefix)
    book = LearnedRates(client, limiter.keyspace)
    try:
        assert call.delay().get() == 200
        # When one call is refused: the hook holds nothing (jitter explains one refusal)
        assert call.delay().get() == 429
        assert limiter.holds() == {}
        # and the adaptive limit learned a lower rate; the other kept its own
        assert book.states() == {("slow-learner", None): pytest.approx(2.0 * 0.8)}
        # When the refusals persist: half of what the limits call in a window (2/s: 5
        # within 5 s; 1.6/s learned: 5 within 6.25 s), the calls 0.625 s apart
        assert book.persist_for(2.0) == (5, 5.0) and book.persist_for(1.6) == (5, 6.25)
        started = redis_now_s(client)
        for _ in range(4):
            assert call.delay().get() == 429
        assert redis_now_s(client) - started < 5.0
    finally:
        api.api.retry_after_only = False
    # Then both limits are held for the upstream's time
    assert set(limiter.holds()) == {("slow", None), ("slow-learner", None)}


def test_report_upstream_of_one_named_limit(
    eager: Celery, api: Api, client: redis.Redis, prefix: str
) -> None:
    @eager.task(shared=False)
    @throttled("api", "tokens")
    def call(estimate: int) -> int:
        with requests.Session() as session:
            response = session.post(f"{api.url}/call", timeout=5)
            assert response.status_code == 200
            response = session.post(f"{api.url}/call", timeout=5)
            report_upstream(response, limit="api")
            return response.status_code

    assert call.delay(10).get() == 429
    assert set(Limiter(client, prefix=prefix).holds()) == {("api", None)}


def test_a_named_limit_the_task_lacks_is_logged_and_never_fails_a_served_call(
    eager: Celery, client: redis.Redis, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a hook that names a limit the task does not have (another task's)
    @eager.task(shared=False)
    @throttled("api", "tokens")
    def call(estimate: int) -> int:
        served = httpx.Response(200, headers={"RateLimit-Remaining": "5"})
        for _ in range(2):
            report_upstream(served, limit="github", retry=True)
        refused = httpx.Response(429, headers={"Retry-After": "7"})
        with pytest.raises(Throttled):
            report_upstream(refused, limit="github", retry=True)
        return 200

    # Then a served call raises nothing (an SDK that retries what its hook raised would
    # call again), a refusal holds the task's limits as without a name, and the name is
    # logged once, with the limits the task has
    with caplog.at_level(logging.ERROR, logger="throttle"):
        assert call.delay(10).get() == 200
    assert set(Limiter(client, prefix=prefix).holds()) == {("api", None), ("tokens", None)}
    logged = [r.getMessage() for r in caplog.records if "has no limit 'github'" in r.getMessage()]
    assert len(logged) == 1 and "'api', 'tokens'" in logged[0], logged


def test_retry_in_eager_mode_raises_throttled_with_the_hold(eager: Celery, api: Api) -> None:
    @eager.task(shared=False)
    @throttled("api")
    def call() -> int:
        with requests.Session() as session:
            session.hooks["response"].append(upstream_hook(retry=True))
            session.post(f"{api.url}/call", timeout=5)
            return session.post(f"{api.url}/call", timeout=5).status_code

    with pytest.raises(Throttled, match=r"retry after 1\.000 s"):
        call.delay().get()


def test_a_refused_call_gives_its_estimated_cost_back_and_keeps_its_request(
    eager: Celery, api: Api
) -> None:
    """The task comes back for the upstream's refusal: the refused call used none of its
    estimated tokens (refunded, unless the body reported what its served calls used),
    while its request stays counted (an API may count refused requests)."""

    @eager.task(shared=False)
    @throttled("api", "tokens")
    def call(estimate: int, used: int | None = None) -> int:
        with requests.Session() as session:
            session.hooks["response"].append(upstream_hook(retry=True))
            if used is not None:
                report_cost(used, limit="tokens")  # a served call's usage
            return refused(api, session).status_code

    throttler = Throttler.of(eager)
    tokens = throttler.config.rule("tokens").limit
    requests_limit = throttler.config.rule("api").limit
    with pytest.raises(Throttled):
        call.delay(40_000).get()
    # 100,000/m refills about 1,667 tokens a second: the 40,000 came back
    assert throttler.limiter.peek(tokens).remaining == pytest.approx(100_000, abs=1)
    assert throttler.limiter.peek(requests_limit).remaining < 1  # held, and spent
    api.api.reset()
    throttler.limiter.unhold("api")
    started = time.monotonic()
    with pytest.raises(Throttled):
        call.delay(40_000, 25_000).get()
    refilled = (time.monotonic() - started) * 100_000 / 60
    assert 75_000 - 1 <= throttler.limiter.peek(tokens).remaining <= 75_000 + refilled + 1


def test_an_sdk_error_without_an_answer_holds_nothing_and_raises_nothing(
    eager: Celery, limiter: Limiter
) -> None:
    class APIConnectionError(Exception):  # stripe's: a StripeError without status or headers
        http_status = None
        headers = None

    @eager.task(shared=False)
    @throttled("api")
    def call() -> str:
        try:
            raise APIConnectionError("network error")
        except APIConnectionError as exc:
            assert report_upstream(exc, retry=True) is None  # the docs' pattern
            return "raised nothing"

    assert call.delay().get() == "raised nothing"
    assert report_upstream(ConnectionError("down"), retry=True) is None  # outside a task
    assert limiter.holds() == {}


def test_a_hook_called_from_another_thread_of_the_body_sees_the_task(
    eager: Celery, api: Api
) -> None:
    @eager.task(shared=False)
    @throttled("api")
    def call() -> int:
        def post() -> int:
            with requests.Session() as session:
                session.hooks["response"].append(upstream_hook(retry=True))
                session.post(f"{api.url}/call", timeout=5)
                return session.post(f"{api.url}/call", timeout=5).status_code

        return asyncio.run(asyncio.to_thread(post))  # the context (its ticket) goes along

    with pytest.raises(Throttled, match=r"retry after 1\.000 s"):
        call.delay().get()


def test_a_refusal_seen_in_a_thread_without_the_task_context_brings_the_task_back(
    eager: Celery,
) -> None:
    @eager.task(shared=False)
    @throttled("api")
    def call() -> None:
        def post() -> None:  # an executor's thread: no context, so no ticket
            report_upstream(upstream_response(retry_after_s=4.0), retry=True)

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            try:
                pool.submit(post).result()
            except Throttled as exc:
                raise RuntimeError("what the client made of it") from exc

    with pytest.raises(Throttled, match=r"retry after 4\.000 s"):  # came back (eager: raised)
        call.delay().get()


def test_a_fan_out_whose_refused_call_another_call_answered_since_still_comes_back(
    eager: Celery,
) -> None:
    # Given a body that makes two calls at once, in threads carrying its context (as the
    # docs advise), where the first is refused and the second served after it
    raised: list[Throttled] = []

    @eager.task(shared=False)
    @throttled("api")
    def call() -> list[int]:
        def answer(status: int) -> int:
            response = upstream_response(
                status=status, retry_after_s=4.0 if status == 429 else None, remaining=10
            )
            try:
                report_upstream(response, retry=True)
            except Throttled as exc:
                raised.append(exc)
                raise
            return status

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            refused = pool.submit(contextvars.copy_context().run, answer, 429)
            concurrent.futures.wait([refused])
            served = pool.submit(contextvars.copy_context().run, answer, 200)
            return [served.result(), refused.result()]  # raises the refusal's Throttled

    # When the body exits by the refusal (the served call cleared the task's record)
    with pytest.raises(Throttled, match=r"retry after 4\.000 s") as caught:
        call.delay().get()
    # Then the task came back for it (eager mode: the come-back's Throttled, raised from
    # the body's), instead of failing with the hook's own exception
    assert len(raised) == 1
    assert caught.value is not raised[0]
    assert caught.value.__cause__ is raised[0]


# -- a real fleet: one `celery worker` x 4 children against the mock API ------------------

FLEET_CONFIG = """
settings:
  refresh: 0.5s
  sleep_max: 0.5s
  park_after: 3s
  park_lead: 1s
limits:
  api: {algorithm: gcra, rate: 19.6/s, burst: 1}
  solo: {algorithm: gcra, rate: 19.6/s, burst: 1}
  hurry: {algorithm: gcra, rate: 19.6/s, burst: 1, key: "{account}", max_wait: 0.5s}
  learn: {algorithm: gcra, rate: 19.6/s, burst: 1, adaptive: true, floor: 2/s}
  watch: {algorithm: gcra, rate: 19.6/s, burst: 1, mode: shadow}
"""


class Fleet:
    def __init__(self, server: RedisServer, api: Api, worker: Worker) -> None:
        self.server, self.api, self.worker = server, api, worker
        self.client = redis.Redis.from_url(server.url)
        self.limiter = Limiter(self.client)
        self.rates = RateBook(self.client, self.limiter.keyspace)

    def refused_by_id(self) -> collections.Counter[str]:
        return collections.Counter(
            a["task_id"] for a in self.api.api.arrivals_json() if not a["allowed"]
        )


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("upstream")
    config = tmp / "limits.yaml"
    config.write_text(FLEET_CONFIG)
    env = {"THROTTLE_CONFIG": str(config)}
    with RedisServer() as server:
        # One call of headroom at the API (burst 2), as in tests/system/test_celery.py: the few ms
        # between Redis admitting a call and its arrival must not count as a violation here;
        # what is counted is how the fleet follows the API's change.
        api = start_api(20.0, 2.0)
        env.update(UPSTREAM_BROKER_URL=server.url, MOCK_API_URL=api.url)
        worker = Worker("u1", env, app="tests.apps.upstream_app", queues="upstream",
                        log=tmp / "u1.log")  # fmt: skip
        saved = {name: os.environ.get(name) for name in env}
        os.environ.update(env)  # the test process is the producer, of the same app
        from tests.apps.upstream_app import app  # noqa: PLC0415

        app.conf.broker_url = app.conf.result_backend = server.url
        fleet = Fleet(server, api, worker)
        try:
            worker.start()
            wait_ready(app, [worker])
            yield fleet
        finally:
            worker.stop()
            api.stop()
            fleet.client.close()
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def log_tail(fleet: Fleet) -> str:
    log = fleet.worker.log
    return "" if log is None else Path(log).read_text()[-3000:]


def test_a_refused_task_runs_again_after_the_hold_with_its_id_and_retry_budget(
    fleet: Fleet,
) -> None:
    # Given an API that allows one call a second and three tasks at once (max_retries=0)
    from tests.apps.upstream_app import fetch_httpx  # noqa: PLC0415

    fleet.api.api.set_limit(1.0, 1.0)
    fleet.api.api.reset()
    try:
        handles = [fetch_httpx.delay(n) for n in range(3)]
        done = [handle.get(timeout=30) for handle in handles]
    finally:
        fleet.rates.clear("solo")
    # Then every task succeeded under its own id, once at the API, without spending a retry
    assert [r["n"] for r in done] == [0, 1, 2], log_tail(fleet)
    assert [r["id"] for r in done] == [h.id for h in handles]
    assert all(r["status"] == 200 and r["retries"] == 0 for r in done)
    arrivals = fleet.api.api.arrivals_json()
    allowed = collections.Counter(a["task_id"] for a in arrivals if a["allowed"])
    assert allowed == {h.id: 1 for h in handles}
    # and the ones the API refused ran their body again (re-published, not failed)
    refused = fleet.refused_by_id()
    assert sum(refused.values()) >= 1, arrivals
    assert all(r["runs"] == 1 + refused[r["id"]] for r in done)
    assert all(r["deferrals"] >= 1 for r in done if refused[r["id"]])
    # through the queue's lane, as the throttler's own deferrals
    assert {r["queue"] for r in done if refused[r["id"]]} == {"upstream.throttled"}
    # and after the first refusal the fleet waited for the API instead of hammering it
    assert sum(refused.values()) <= 3, arrivals


def test_a_refusal_that_holds_nothing_sends_the_task_back_for_the_next_slot(
    fleet: Fleet,
) -> None:
    # Given an API that allows 4 calls a second and says only "429 Retry-After: 1" (no
    # policy to compare the fleet's 19.6/s with), and two tasks at once
    from tests.apps.upstream_app import fetch  # noqa: PLC0415

    api = fleet.api.api
    api.set_limit(4.0, 1.0)
    api.reset()
    api.retry_after_only = True
    try:
        handles = [fetch.delay(n) for n in range(2)]
        done = [handle.get(timeout=30) for handle in handles]
    finally:
        api.retry_after_only = False
        api.set_limit(20.0, 2.0)
    # Then both ran, each allowed once at the API; the second was refused (a spacing of
    # the limit after the first: as far as a lone refusal tells, jitter), which held
    # nothing
    assert sorted(r["n"] for r in done) == [0, 1], log_tail(fleet)
    arrivals = api.arrivals_json()
    assert collections.Counter(a["task_id"] for a in arrivals if a["allowed"]) == {
        h.id: 1 for h in handles
    }
    refused = [a for a in arrivals if not a["allowed"]]
    assert refused, arrivals
    assert fleet.limiter.holds() == {}
    # and it came back for the limit's next free slot, not after the rounded-up second of
    # its Retry-After (which would idle the limit at the end of a backlog)
    again = [a["at_s"] for a in arrivals if a["task_id"] == refused[0]["task_id"]]
    assert again[1] - again[0] < 1.0, arrivals


def test_a_task_refused_under_a_limit_in_shadow_comes_back_after_the_apis_time(
    fleet: Fleet,
) -> None:
    # Given a limit in shadow mode (it delays nothing) before an API that allows one call
    # a second, and three tasks at once (max_retries=0)
    from tests.apps.upstream_app import fetch_shadow  # noqa: PLC0415

    api = fleet.api.api
    api.set_limit(1.0, 1.0)
    api.reset()
    try:
        handles = [fetch_shadow.delay(n) for n in range(3)]
        done = [handle.get(timeout=30) for handle in handles]
    finally:
        api.set_limit(20.0, 2.0)
    # Then every task succeeded under its own id, once at the API, without a retry spent:
    # a refused one was sent back (not failed by the Throttled of report_upstream)
    assert sorted(r["n"] for r in done) == [0, 1, 2], log_tail(fleet)
    arrivals = api.arrivals_json()
    allowed = collections.Counter(a["task_id"] for a in arrivals if a["allowed"])
    assert allowed == {h.id: 1 for h in handles}
    refused = fleet.refused_by_id()
    assert sum(refused.values()) >= 1, arrivals
    assert all(r["runs"] == 1 + refused[r["id"]] and r["retries"] == 0 for r in done)
    # after the API's own time (Retry-After: 1 s), there being no slot to take
    for task_id in refused:
        at = [a["at_s"] for a in arrivals if a["task_id"] == task_id]
        assert at[1] - at[0] >= 0.9, arrivals
    # and each refusal is in the record under the limit's own name, with its task id
    book = RefusalBook(fleet.client, fleet.limiter.keyspace)
    assert {entry.task_id for entry in book.read("watch")} == set(refused)
    # while the limit itself was never held (its shadow twin was, as enforced it would be)
    assert all(limit != "watch" for limit, _ in fleet.limiter.holds())


def test_the_fleet_follows_an_api_that_lowers_its_limit_mid_run(fleet: Fleet) -> None:
    # Given the fleet calling at 19.6/s an API that allows 20/s, and 150 tasks queued
    from tests.apps.upstream_app import fetch  # noqa: PLC0415

    api = fleet.api.api
    api.set_limit(20.0, 2.0)
    api.reset()
    try:
        handles = [fetch.delay(n) for n in range(150)]
        # When the API lowers its limit to 10/s after 4 s
        api.set_limit_later(4.0, 10.0, 2.0)
        done = [handle.get(timeout=60) for handle in handles]
        lowered = fleet.rates.overrides()
    finally:
        fleet.rates.clear("api")
    arrivals = api.arrivals_json()
    (changed_at, _, _), *_ = api.stats()["changes"]
    before = [a for a in arrivals if a["at_s"] < changed_at]
    after = [a for a in arrivals if a["at_s"] >= changed_at]
    refused_before = sum(not a["allowed"] for a in before)
    refused_after = [a["at_s"] - changed_at for a in after if not a["allowed"]]
    # Then every task completed once, under its own id, without spending a retry
    assert sorted(r["n"] for r in done) == list(range(150)), log_tail(fleet)
    assert all(r["status"] == 200 and r["retries"] == 0 for r in done)
    allowed = collections.Counter(a["task_id"] for a in arrivals if a["allowed"])
    assert allowed == {h.id: 1 for h in handles}
    refused = fleet.refused_by_id()
    assert all(r["runs"] == 1 + refused[r["id"]] for r in done)
    # and the fleet followed the API's change with at most a handful of 429s
    assert len(refused_after) <= 5, refused_after
    assert lowered == {"api": "10/1s burst 1"}
    # and called it at most at its new rate afterwards (once the hold and refresh are over)
    settled = [a["at_s"] for a in after if a["at_s"] >= changed_at + 2.0]
    assert len(settled) >= 20, (len(settled), log_tail(fleet))
    rate_after = (len(settled) - 1) / (settled[-1] - settled[0])
    assert rate_after <= 10.0 * 1.02, rate_after
    rate_before = (len(before) - 1) / (before[-1]["at_s"] - before[0]["at_s"])
    print(
        f"\nupstream fleet: {len(before)} calls at {rate_before:.2f}/s before the change "
        f"({refused_before} refused), {len(refused_after)} refused after it at "
        f"{[round(t, 3) for t in refused_after]} s, then {rate_after:.2f}/s"
    )


def test_a_hold_beyond_the_tasks_max_wait_ends_it_with_throttle_timeout(fleet: Fleet) -> None:
    # Given an API that allows one call a second, and two tasks of one account whose limit
    # lets them wait at most 0.5 s
    from tests.apps.upstream_app import fetch_keyed  # noqa: PLC0415

    fleet.api.api.set_limit(1.0, 1.0)
    fleet.api.api.reset()
    handles = [fetch_keyed.delay("acct", n) for n in range(2)]
    outcomes: dict[str, Any] = {}
    for handle in handles:
        try:
            outcomes[handle.id] = handle.get(timeout=30)["status"]
        except Exception as exc:
            outcomes[handle.id] = exc
    # Then the one that came second to the API is not re-run after the hold (1 s): it fails,
    # as with the throttler's own deadline
    refused = fleet.refused_by_id()
    assert sorted(refused.values()) == [1], fleet.api.api.arrivals_json()
    ((late, _),) = refused.items()
    error = outcomes.pop(late)
    assert type(error).__name__ == "ThrottleTimeout"
    assert "throttle deadline: hurry would admit the task in 1.000 s" in str(error)
    assert list(outcomes.values()) == [200]
    # and the hold was the account's only: the limit's rate and other accounts untouched
    assert set(fleet.limiter.holds()) == {("hurry", "acct")}
    assert fleet.rates.overrides() == {}
    fleet.limiter.unhold("hurry", "acct")


def test_an_adaptive_limit_learns_a_silent_drop_and_every_task_runs_once(fleet: Fleet) -> None:
    # Given an API that says only "429 Retry-After: 1" (no rate-limit headers), and the
    # fleet calling it at 19.6/s through an adaptive limit
    from tests.apps.upstream_app import fetch_adaptive  # noqa: PLC0415

    api = fleet.api.api
    api.set_limit(20.0, 2.0)
    api.reset()
    api.retry_after_only = True
    learned = LearnedRates(fleet.client, fleet.limiter.keyspace)
    try:
        handles = [fetch_adaptive.delay(n) for n in range(120)]
        # When the API silently lowers its limit to 10/s after 2 s
        api.set_limit_later(2.0, 10.0, 2.0)
        done = [handle.get(timeout=90) for handle in handles]
        states = learned.states()
    finally:
        api.retry_after_only = False
        for name in fleet.client.scan_iter(match=fleet.limiter.keyspace.learned_pattern()):
            fleet.client.delete(name)
    # Then every task completed once, under its own id, without spending a retry
    assert sorted(r["n"] for r in done) == list(range(120)), log_tail(fleet)
    assert all(r["status"] == 200 and r["retries"] == 0 for r in done)
    arrivals = api.arrivals_json()
    allowed = collections.Counter(a["task_id"] for a in arrivals if a["allowed"])
    assert allowed == {h.id: 1 for h in handles}
    refused = fleet.refused_by_id()
    assert sum(refused.values()) >= 1, "the API never refused: the drop was not seen"
    assert all(r["runs"] == 1 + refused[r["id"]] for r in done)
    # and the fleet learned a rate below the one configured, never set as a run-time rate
    assert states[("learn", None)] < 19.6 * 0.9, states
    assert "learn" not in fleet.rates.overrides()
    print(
        f"\nadaptive fleet: {len(arrivals)} calls, {sum(refused.values())} refused, "
        f"learned {states[('learn', None)]:.2f}/s"
    )


def test_an_adaptive_limit_follows_a_stated_policy_down_and_back_up(fleet: Fleet) -> None:
    # Given an API that states its limit (RateLimit-Policy, X-RateLimit-Limit) at 10/s,
    # and the fleet calling it through an adaptive limit of 19.6/s
    from tests.apps.upstream_app import fetch_adaptive  # noqa: PLC0415

    api = fleet.api.api
    api.set_limit(10.0, 2.0)
    api.reset()
    learned = LearnedRates(fleet.client, fleet.limiter.keyspace)
    try:
        first = [fetch_adaptive.delay(n) for n in range(30)]
        done = [handle.get(timeout=60) for handle in first]
        down = learned.states()
        overrides = fleet.rates.overrides()
        # When the API states (and allows) 16/s
        api.set_limit(16.0, 2.0)
        second = [fetch_adaptive.delay(n) for n in range(30, 60)]
        done += [handle.get(timeout=60) for handle in second]
        up = learned.states()
    finally:
        api.set_limit(20.0, 2.0)
        fleet.rates.clear("learn")
        for name in fleet.client.scan_iter(match=fleet.limiter.keyspace.learned_pattern()):
            fleet.client.delete(name)
    # Then the learned rate took the stated 10/s, with no run-time rate stored (one
    # would be the limit's ceiling, never raised by the throttler)
    assert down[("learn", None)] == pytest.approx(10.0), (down, log_tail(fleet))
    assert "learn" not in overrides, overrides
    # and followed the API back up to 16/s
    assert up[("learn", None)] == pytest.approx(16.0), up
    # and every task ran once at the API, under its own id
    assert sorted(r["n"] for r in done) == list(range(60)), log_tail(fleet)
    allowed = collections.Counter(a["task_id"] for a in api.arrivals_json() if a["allowed"])
    assert allowed == {h.id: 1 for h in first + second}
