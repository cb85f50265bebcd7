"""The learned state of adaptive limits (lua/adapt.lua) on a real Redis and the test clock:
one decrease per refusal episode, probing up on successes, floor and ceiling, stated rates,
persisting refusals, one state per limit and key."""

from __future__ import annotations

import itertools

import pytest
import redis
from celery import Celery

from tests.support.clock import FakeClock
from throttle import KeySpace, Limit, Limiter, metrics
from throttle.adaptive import (
    EPISODE_S,
    MAX_EPISODE_S,
    PERSIST_S,
    Adaptive,
    LearnedRates,
)
from throttle.celery import Throttler
from throttle.celery.exporter import fleet_state
from throttle.rates import RateBook
from throttle.upstream import UpstreamSignal, apply_upstream, parse_upstream, quota_spent

API = Limit.parse("20/s burst 1", name="api", algorithm="gcra")
LEARN = Adaptive(floor_per_s=2.0, decrease=0.5, recover_s=10.0)


class FakeMonotonic:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def book(client: redis.Redis, prefix: str, clock: FakeClock) -> LearnedRates:
    return LearnedRates(client, KeySpace(prefix, "ns"), clock_us=clock)


def test_a_fresh_limit_runs_at_its_ceiling(book: LearnedRates) -> None:
    assert book.read(API, None, LEARN).rate_per_s == 20.0
    assert book.succeeded(API, None, LEARN).rate_per_s == 20.0
    assert book.current(API, None, LEARN) is API


def test_the_refusals_of_one_episode_decrease_the_rate_once(
    book: LearnedRates, clock: FakeClock
) -> None:
    # Given 12 tasks in flight at 20/s when the upstream starts refusing
    first = book.refused(API, None, LEARN)
    assert first.decreased and first.rate_per_s == pytest.approx(10.0)
    # When the other refusals of the episode come in (within EPISODE_S)
    answers = []
    for _ in range(11):
        clock.advance(EPISODE_S / 12)
        answers.append(book.refused(API, None, LEARN))
    # Then none decreases the rate again
    assert not any(a.decreased for a in answers)
    assert {round(a.rate_per_s, 6) for a in answers} == {10.0}
    # and a refusal after the episode is new evidence: one more decrease
    clock.advance(EPISODE_S)
    again = book.refused(API, None, LEARN)
    assert again.decreased and again.rate_per_s == pytest.approx(5.0)


def test_an_episode_lasts_as_long_as_the_slots_reserved_at_the_old_rate(
    book: LearnedRates, clock: FakeClock
) -> None:
    # Given slots reserved 3 s ahead when the first 429 comes
    assert book.refused(API, None, LEARN, reserved_s=3.0).decreased
    # Then refusals of those calls (up to EPISODE_S + 3 s) are the same episode
    clock.advance(EPISODE_S + 2.9)
    assert not book.refused(API, None, LEARN).decreased
    clock.advance(0.2)
    assert book.refused(API, None, LEARN, reserved_s=3600.0).decreased
    # and a backlog reserved an hour ahead makes an episode of MAX_EPISODE_S at most
    clock.advance(MAX_EPISODE_S - 0.1)
    assert not book.refused(API, None, LEARN).decreased
    clock.advance(0.2)
    assert book.refused(API, None, LEARN).decreased


def test_successes_probe_back_up_to_the_refused_rate_in_recover_then_beyond(
    book: LearnedRates, clock: FakeClock
) -> None:
    capped = Limit.parse("40/s burst 1", name="api", algorithm="gcra")
    book.refused(capped, None, LEARN)  # refused at 40/s: 20/s now
    clock.advance(EPISODE_S)
    rates = []
    for _ in range(20):  # 20 s of successes, 10 a second
        rates.append(succeed_for_limit(book, clock, capped, 1.0))
    # Quickly at first, flat near the refused rate after `recover` (10 s), then above it
    assert rates[0] > 20.0 + 5.0
    assert rates[8] == pytest.approx(40.0, abs=0.1)
    assert all(b >= a for a, b in itertools.pairwise(rates))
    assert rates[-1] == 40.0  # the ceiling, never above
    assert book.current(capped, None, LEARN) is capped


def succeed_for_limit(book: LearnedRates, clock: FakeClock, limit: Limit, seconds: float) -> float:
    rate = 0.0
    for _ in range(round(seconds / 0.1)):
        clock.advance(0.1)
        rate = book.succeeded(limit, None, LEARN).rate_per_s
    return rate


def test_successes_inside_the_episode_or_after_a_long_idle_gap_do_not_probe(
    book: LearnedRates, clock: FakeClock
) -> None:
    book.refused(API, None, LEARN)
    clock.advance(EPISODE_S / 2)
    assert book.succeeded(API, None, LEARN).rate_per_s == pytest.approx(10.0)
    clock.advance(EPISODE_S)  # half a second past the episode's end: probing since then
    book.succeeded(API, None, LEARN)
    # An hour idle counts as one second of probing (GAP_S), not an hour
    clock.advance(3600.0)
    after_idle = book.succeeded(API, None, LEARN).rate_per_s
    assert after_idle == pytest.approx(20.0 - 10.0 * (1 - 1.5 / 10.0) ** 3, abs=1e-3)


def test_the_rate_never_goes_below_the_floor(book: LearnedRates, clock: FakeClock) -> None:
    rates = []
    for _ in range(10):
        rates.append(book.refused(API, None, LEARN).rate_per_s)
        clock.advance(EPISODE_S)
    assert min(rates) == 2.0
    assert book.current(API, None, LEARN).rate_per_s == 2.0


def test_the_default_floor_is_a_tenth_of_the_rate(book: LearnedRates, clock: FakeClock) -> None:
    learn = Adaptive(decrease=0.1)
    for _ in range(5):
        book.refused(API, None, learn)
        clock.advance(EPISODE_S)
    assert book.read(API, None, learn).rate_per_s == pytest.approx(2.0)


def test_a_stated_rate_wins_over_the_learned_one(book: LearnedRates, clock: FakeClock) -> None:
    book.refused(API, None, LEARN)
    # The upstream states 15/s: that is the rate, not the 10/s learned
    assert book.stated(API, None, LEARN, 15.0).rate_per_s == 15.0
    assert book.read(API, None, LEARN).rate_per_s == 15.0
    # a stated rate above the ceiling is the ceiling, below the floor the floor
    assert book.stated(API, None, LEARN, 99.0).rate_per_s == 20.0
    assert book.stated(API, None, LEARN, 0.5).rate_per_s == 2.0
    # and a refusal after it is a new episode (the statement ended the last one)
    assert book.refused(API, None, LEARN).decreased


def test_a_lower_ceiling_caps_the_learned_rate(book: LearnedRates) -> None:
    book.refused(API, None, LEARN)  # 10/s learned under 20/s
    operator = Limit.parse("8/s burst 1", name="api", algorithm="gcra")
    assert book.read(operator, None, LEARN).rate_per_s == 8.0
    assert book.current(operator, None, LEARN) is operator


def test_each_key_learns_its_own_rate(book: LearnedRates, clock: FakeClock) -> None:
    book.refused(API, "acme", LEARN)
    assert book.read(API, "acme", LEARN).rate_per_s == pytest.approx(10.0)
    assert book.read(API, "globex", LEARN).rate_per_s == 20.0
    assert book.read(API, None, LEARN).rate_per_s == 20.0
    assert book.states() == {("api", "acme"): pytest.approx(10.0)}


def test_refusals_persist_at_half_the_calls_of_a_window(
    book: LearnedRates, clock: FakeClock
) -> None:
    # At 20/s, a window of 1 s: 10 refusals (half the calls of the window) persist
    count, window = book.persist_for(20.0)
    assert (count, window) == (10, PERSIST_S)
    # Refusals spread wider than the window never persist: 9 in each, a fifth of the calls
    # at most as scheduling jitter makes against a strict upstream
    for _ in range(3):
        answers = []
        for _ in range(count - 1):
            answers.append(book.refused(API, None, None))
            clock.advance(window / count)
        assert not any(a.persist for a in answers)
        clock.advance(window)
    # count within the window do
    answers = []
    for _ in range(count):
        answers.append(book.refused(API, None, None))
        clock.advance(window / (count + 1))
    assert [a.persist for a in answers] == [False] * (count - 1) + [True]
    assert [a.refusals for a in answers] == list(range(1, count + 1))


def test_the_rate_of_the_call_sets_when_refusals_persist(book: LearnedRates) -> None:
    # A slow limit: ten spacings make the window (half of its 10 calls: 5 refusals)
    assert book.persist_for(1 / 60) == (5, 600.0)
    assert book.persist_for(2.0) == (5, 5.0)
    assert book.persist_for(100.0) == (50, 1.0)
    # The rate the call was made at (a learned one, lower) counts, not the ceiling
    answers = [book.refused(API, None, None, rate_per_s=2.0) for _ in range(5)]
    assert [a.persist for a in answers] == [False] * 4 + [True]


def test_a_limit_that_is_not_adaptive_counts_refusals_and_learns_nothing(
    book: LearnedRates, clock: FakeClock
) -> None:
    answer = book.refused(API, None, None)
    assert not answer.decreased and answer.rate_per_s == 20.0
    assert book.states() == {}


def test_the_cache_follows_the_fleet_within_refresh(
    client: redis.Redis, prefix: str, clock: FakeClock
) -> None:
    monotonic = FakeMonotonic()
    keyspace = KeySpace(prefix, "ns")
    mine = LearnedRates(client, keyspace, clock_us=clock, monotonic=monotonic, refresh_s=2.0)
    other = LearnedRates(client, keyspace, clock_us=clock)
    assert mine.current(API, None, LEARN) is API
    other.refused(API, None, LEARN)  # another worker saw the 429
    assert mine.current(API, None, LEARN) is API  # cached
    monotonic.now += 2.0
    assert mine.current(API, None, LEARN).rate_per_s == pytest.approx(10.0)
    # and a worker that reports an answer has the fleet's rate at once
    other.refused(API, None, LEARN)  # same episode: unchanged
    clock.advance(EPISODE_S)
    other.refused(API, None, LEARN)
    assert mine.succeeded(API, None, LEARN).rate_per_s == pytest.approx(5.0)
    assert mine.current(API, None, LEARN).rate_per_s == pytest.approx(5.0)


def test_the_learned_limit_keeps_algorithm_period_and_burst(book: LearnedRates) -> None:
    hourly = Limit.parse("3600/h burst 5", name="api", algorithm="gcra")
    learn = Adaptive(decrease=0.5)
    book.refused(hourly, None, learn)
    learned = book.current(hourly, None, learn)
    assert (learned.algorithm, learned.period_s, learned.burst) == ("gcra", 3600.0, 5.0)
    assert learned.rate_per_s == pytest.approx(0.5)


# -- the hook's answer to a refusal (apply_upstream with a learned book) ------------------


class Response:
    def __init__(self, status: int, headers: dict[str, str]) -> None:
        self.status_code, self.headers = status, headers


JITTER = Response(429, {"Retry-After": "1"})
"""What a strict upstream answers a call that came a few ms early: the rounded-up second."""


def parse(status: int, headers: dict[str, str]) -> UpstreamSignal:
    signal = parse_upstream(status, headers)
    assert signal is not None
    return signal


@pytest.fixture
def clocked_limiter(client: redis.Redis, prefix: str, clock: FakeClock) -> Limiter:
    return Limiter(client, prefix=prefix, namespace="ns", clock_us=clock)


def test_a_refusal_that_jitter_explains_holds_nothing(
    clocked_limiter: Limiter, book: LearnedRates
) -> None:
    signal = apply_upstream(clocked_limiter, JITTER, API, learned=book)
    assert signal is not None and signal.refused and signal.hold_s == 1.0
    # The fleet goes on: no hold, the next slot is admitted
    assert clocked_limiter.holds() == {}
    assert clocked_limiter.acquire(API).allowed


def test_persisting_refusals_hold_the_whole_limit(
    clocked_limiter: Limiter, book: LearnedRates, clock: FakeClock
) -> None:
    count, window = book.persist_for(API.rate_per_s)
    for _ in range(count - 1):
        apply_upstream(clocked_limiter, JITTER, API, learned=book)
        clock.advance(window / count)
        assert clocked_limiter.holds() == {}
    apply_upstream(clocked_limiter, JITTER, API, learned=book)
    assert clocked_limiter.holds() == {("api", None): pytest.approx(1.0)}
    assert not clocked_limiter.acquire(API).allowed


def test_a_keyed_limit_persists_and_holds_per_key(
    clocked_limiter: Limiter, book: LearnedRates
) -> None:
    count, _ = book.persist_for(API.rate_per_s)
    for _ in range(count - 1):
        apply_upstream(clocked_limiter, JITTER, API, "acme", learned=book)
    apply_upstream(clocked_limiter, JITTER, API, "globex", learned=book)
    assert clocked_limiter.holds() == {}
    apply_upstream(clocked_limiter, JITTER, API, "acme", learned=book)
    assert set(clocked_limiter.holds()) == {("api", "acme")}


@pytest.mark.parametrize(
    "headers",
    [
        pytest.param({"Retry-After": "30"}, id="retry-after-far-beyond-the-spacing"),
        pytest.param({"RateLimit-Remaining": "0", "RateLimit-Reset": "60"}, id="quota-spent"),
        pytest.param({"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": "3600"}, id="hourly"),
    ],
)
def test_a_refusal_that_says_the_quota_is_spent_holds_at_once(
    clocked_limiter: Limiter, book: LearnedRates, headers: dict[str, str]
) -> None:
    signal = apply_upstream(clocked_limiter, Response(429, headers), API, learned=book)
    assert signal is not None and signal.hold_s >= 30
    assert clocked_limiter.holds() == {("api", None): pytest.approx(signal.hold_s)}


def test_a_retry_after_within_rounding_or_a_slow_limits_spacing_is_not_a_spent_quota() -> None:
    slow = Limit.parse("1/m burst 1", name="slow", algorithm="gcra")
    assert not quota_spent(parse(429, {"Retry-After": "60"}), slow)
    assert quota_spent(parse(429, {"Retry-After": "121"}), slow)
    # At 20/s a call a few ms early is told "Retry-After: 1" (its wait rounded up to a
    # whole second); two seconds is more than rounding explains: the quota is spent
    assert not quota_spent(parse(429, {"Retry-After": "1"}), API)
    assert quota_spent(parse(429, {"Retry-After": "2"}), API)
    assert quota_spent(parse(429, {"Retry-After-Ms": "2000"}), API)
    # and at 1/s, where one spacing is already a second, two are not enough
    second = Limit.parse("1/s burst 1", name="second", algorithm="gcra")
    assert not quota_spent(parse(429, {"Retry-After": "2"}), second)
    assert quota_spent(parse(429, {"Retry-After": "3"}), second)


def test_an_adaptive_limit_learns_from_the_hook_and_a_stated_policy_wins(
    clocked_limiter: Limiter, book: LearnedRates, clock: FakeClock
) -> None:
    apply_upstream(clocked_limiter, JITTER, API, learned=book, adaptive=LEARN)
    assert book.read(API, None, LEARN).rate_per_s == pytest.approx(10.0)
    assert clocked_limiter.holds() == {}
    clock.advance(EPISODE_S + 1.0)
    apply_upstream(clocked_limiter, Response(200, {}), API, learned=book, adaptive=LEARN)
    assert book.read(API, None, LEARN).rate_per_s > 10.0
    stated = Response(200, {"RateLimit-Policy": '"default";q=15;w=1'})
    apply_upstream(clocked_limiter, stated, API, learned=book, adaptive=LEARN)
    assert book.read(API, None, LEARN).rate_per_s == 15.0


def test_without_a_learned_book_every_refusal_holds_as_before(clocked_limiter: Limiter) -> None:
    apply_upstream(clocked_limiter, JITTER, API)
    assert clocked_limiter.holds() == {("api", None): pytest.approx(1.0)}


def test_a_limit_faster_than_the_stated_policy_holds_at_the_first_refusal(
    clocked_limiter: Limiter, book: LearnedRates
) -> None:
    # Stated 10/s, the limit at 20/s: the refusal is not jitter, the rate is wrong
    stated = Response(429, {"Retry-After": "1", "RateLimit-Policy": '"default";q=10;w=1'})
    apply_upstream(clocked_limiter, stated, API, learned=book)
    assert clocked_limiter.holds() == {("api", None): pytest.approx(1.0)}
    # while a limit within the stated policy is answered in proportion
    within = Response(429, {"Retry-After": "1", "RateLimit-Policy": '"default";q=20;w=1'})
    other = Limit.parse("20/s burst 1", name="other", algorithm="gcra")
    apply_upstream(clocked_limiter, within, other, learned=book)
    assert set(clocked_limiter.holds()) == {("api", None)}


# -- visible: the metrics ------------------------------------------------------------------


def test_the_metrics_show_the_learned_rate_next_to_the_configured_one(
    redis_url: str, prefix: str
) -> None:
    # Given a Celery app whose limits file has an adaptive limit, and one refusal of it
    app = Celery("adaptive_metrics", set_as_current=False)
    app.conf.throttle_config = {
        "settings": {"prefix": prefix, "metrics": True},
        "limits": {
            "learner": {"algorithm": "gcra", "rate": "20/s", "burst": 1, "adaptive": True},
            "plain": {"rate": "5/s"},
        },
    }
    app.conf.throttle_redis_url = redis_url
    throttler = Throttler.of(app)
    try:
        rule = throttler.config.rules["learner"]
        assert rule.adaptive is not None
        throttler.learned.refused(rule.limit, None, rule.adaptive)
        # When the metrics are scraped
        collector = metrics.ThrottleCollector(lambda: [], lambda: fleet_state(app))
        samples = {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in collector.collect()
            for sample in family.samples
        }
    finally:
        throttler.limiter.client.close()
    # Then the learned rate shows beside the configured one, for the adaptive limit only
    assert samples[("throttle_configured_rate", (("limit", "learner"),))] == 20.0
    assert samples[("throttle_learned_rate", (("limit", "learner"),))] == pytest.approx(16.0)
    assert ("throttle_learned_rate", (("limit", "plain"),)) not in samples


def test_a_success_at_the_ceiling_is_not_reported_while_the_cache_is_fresh(
    client: redis.Redis, prefix: str, clock: FakeClock
) -> None:
    monotonic = FakeMonotonic()
    keyspace = KeySpace(prefix, "ns")
    mine = LearnedRates(client, keyspace, clock_us=clock, monotonic=monotonic, refresh_s=2.0)
    other = LearnedRates(client, keyspace, clock_us=clock)
    assert mine.current(API, None, LEARN) is API  # read: at the ceiling, fresh
    other.refused(API, None, LEARN)  # another worker lowers the fleet's rate
    # A success at the ceiling costs no round trip: it does not see the change yet
    assert mine.succeeded(API, None, LEARN).rate_per_s == 20.0
    # once the cache is stale, it is reported, and answered with the fleet's rate
    monotonic.now += 2.0
    assert mine.succeeded(API, None, LEARN).rate_per_s == pytest.approx(10.0)
    # and below the ceiling every success is reported (it probes)
    clock.advance(EPISODE_S + 1.0)
    assert mine.succeeded(API, None, LEARN).rate_per_s > 10.0


def test_an_adaptive_limit_follows_a_stated_policy_back_up_and_stores_no_run_time_rate(
    clocked_limiter: Limiter, book: LearnedRates, client: redis.Redis, prefix: str
) -> None:
    # Given an adaptive limit (20/s) and an upstream that states 10/s, then 15/s
    rates = RateBook(client, KeySpace(prefix, "ns"))

    def answer(quota: int) -> float:
        stated = Response(200, {"RateLimit-Policy": f'"default";q={quota};w=1'})
        apply_upstream(clocked_limiter, stated, API, rates=rates, learned=book, adaptive=LEARN)
        return book.current(rates.current(API), None, LEARN).rate_per_s

    # Then the rate in force follows the stated policy down and back up
    assert answer(10) == pytest.approx(10.0)
    assert answer(15) == pytest.approx(15.0)
    # through the learned rate only: no run-time rate pins it (that one is never raised)
    assert rates.overrides() == {}
    # and a policy above the configured rate is the configured rate, never more
    assert answer(40) == pytest.approx(20.0)
