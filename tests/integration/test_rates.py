"""Run-time rates on a real Redis: stored once, followed by every process after refresh_s."""

from __future__ import annotations

import uuid

import pytest
import redis

from tests.support.clock import FakeClock
from throttle import Algorithm, ConfigError, KeySpace, Limit, Limiter
from throttle.rates import RateBook

REFRESH_S = 2.0


class FakeMonotonic:
    """The book's ``monotonic``: seconds, moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def keyspace(prefix: str) -> KeySpace:
    return KeySpace(prefix, "ns")


@pytest.fixture
def api() -> Limit:
    return Limit.parse("20/s", name="api")


def book_of(client: redis.Redis, keyspace: KeySpace, monotonic: FakeMonotonic) -> RateBook:
    return RateBook(client, keyspace, refresh_s=REFRESH_S, monotonic=monotonic)


def test_nothing_stored_gives_the_configured_limit(
    client: redis.Redis, keyspace: KeySpace, api: Limit
) -> None:
    book = book_of(client, keyspace, FakeMonotonic())
    assert book.current(api) is api
    assert book.overrides() == {}


def test_set_is_seen_by_another_process_after_refresh(
    client: redis.Redis, keyspace: KeySpace, api: Limit
) -> None:
    operator = book_of(client, keyspace, FakeMonotonic())
    time = FakeMonotonic()
    worker = book_of(client, keyspace, time)
    # The worker has read the (empty) book: it now caches it for refresh_s.
    assert worker.current(api) is api

    changed = operator.set(api, "5/s")
    assert (changed.name, changed.algorithm, changed.count, changed.period_s, changed.burst) == (
        "api",
        Algorithm.TOKEN_BUCKET,
        5.0,
        1.0,
        5.0,
    )
    # The operator's own book sees its change at once.
    assert operator.current(api) == changed
    assert operator.overrides() == {"api": "5/s"}

    # The worker keeps its cached view until refresh_s has passed...
    time.now += REFRESH_S - 0.001
    assert worker.current(api) is api
    # ...then follows the change.
    time.now += 0.001
    seen = worker.current(api)
    assert seen == changed
    assert seen.name == api.name
    assert seen.algorithm is api.algorithm
    assert seen.rate_per_s == 5.0
    # Other limits of the namespace are untouched.
    other = Limit.parse("7/m", name="other")
    assert worker.current(other) is other


def test_set_keeps_the_algorithm_of_the_configured_limit(
    client: redis.Redis, keyspace: KeySpace
) -> None:
    github = Limit.parse("5000/h burst 10", name="github", algorithm="gcra")
    book = book_of(client, keyspace, FakeMonotonic())
    changed = book.set(github, "1000/h burst 2")
    assert changed.algorithm is Algorithm.GCRA
    assert (changed.count, changed.period_s, changed.burst) == (1000.0, 3600.0, 2.0)
    assert book.current(github) == changed


@pytest.mark.parametrize(
    ("limit", "rate"),
    [
        pytest.param(Limit.parse("20/s", name="api"), "fast", id="malformed"),
        pytest.param(Limit.parse("20/s", name="api"), "0/s", id="zero"),
        pytest.param(Limit.parse("20/s", name="api"), "5/fortnight", id="unknown-unit"),
        pytest.param(Limit.parse("20/s", name="api"), "5 concurrent", id="concurrency-on-bucket"),
        pytest.param(
            Limit.parse("100/m", name="api", algorithm="fixed_window"),
            "50/m burst 5",
            id="burst-on-window",
        ),
    ],
)
def test_bad_rate_raises_and_stores_nothing(
    client: redis.Redis, keyspace: KeySpace, limit: Limit, rate: str
) -> None:
    book = book_of(client, keyspace, FakeMonotonic())
    book.set(limit, "10/m")
    with pytest.raises(ConfigError) as caught:
        book.set(limit, rate)
    assert f"(got {rate!r})" in str(caught.value)
    # The previous override is still the one in force, in Redis and in the book.
    assert client.hgetall(keyspace.rates_key()) == {b"api": b"10/m"}
    assert book.current(limit).rate_per_s == pytest.approx(10 / 60)


def test_clear_restores_the_configured_limit(
    client: redis.Redis, keyspace: KeySpace, api: Limit
) -> None:
    operator = book_of(client, keyspace, FakeMonotonic())
    time = FakeMonotonic()
    worker = book_of(client, keyspace, time)
    operator.set(api, "5/s")
    assert worker.current(api).count == 5
    operator.clear("api")
    assert operator.current(api) is api
    assert client.exists(keyspace.rates_key()) == 0
    # The worker still holds the change for up to refresh_s, then follows the clear.
    assert worker.current(api).count == 5
    time.now += REFRESH_S
    assert worker.current(api) is api


@pytest.mark.parametrize(
    "garbage",
    [
        pytest.param(b"fast please", id="words"),
        pytest.param(b"0/s", id="zero-rate"),
        pytest.param(b"-5/s", id="negative"),
        pytest.param(b"5 concurrent", id="wrong-algorithm"),
        pytest.param(b"", id="empty"),
        pytest.param(b"\xff\xfe5/s", id="not-utf8"),
    ],
)
def test_garbage_written_by_hand_is_ignored(
    client: redis.Redis, keyspace: KeySpace, api: Limit, garbage: bytes
) -> None:
    other = Limit.parse("7/m", name="other")
    client.hset(keyspace.rates_key(), mapping={"api": garbage, "other": "3/m"})
    book = book_of(client, keyspace, FakeMonotonic())
    # The configured limit stays in force rather than failing every task...
    assert book.current(api) is api
    # ...and the well-formed override of another limit in the same hash still applies.
    assert book.current(other).count == 3


def test_changed_limit_admits_at_the_new_rate(
    client: redis.Redis, keyspace: KeySpace, prefix: str, api: Limit
) -> None:
    clock = FakeClock()
    limiter = Limiter(client, prefix=prefix, namespace="ns", clock_us=clock)
    book = book_of(client, keyspace, FakeMonotonic())
    book.set(api, "5/s")
    limit = book.current(api)

    # 5/s with burst 5: five at once, then one per 200 ms.
    assert [limiter.acquire(limit).allowed for _ in range(6)] == [True] * 5 + [False]
    denied = limiter.acquire(limit)
    assert not denied.allowed
    assert denied.retry_after_s == pytest.approx(0.2, abs=1e-6)
    clock.advance(0.2)
    assert limiter.acquire(limit).allowed
    assert not limiter.acquire(limit).allowed


def test_lowered_rate_caps_a_bucket_filled_under_the_old_rate(
    client: redis.Redis, keyspace: KeySpace, prefix: str, api: Limit
) -> None:
    """The state key is shared by both rates: a full 20-token bucket must shrink to 5."""
    clock = FakeClock()
    limiter = Limiter(client, prefix=prefix, namespace="ns", clock_us=clock)
    assert limiter.acquire(api).allowed  # 19 tokens left under the configured 20/s
    book = book_of(client, keyspace, FakeMonotonic())
    book.set(api, "5/s")
    clock.advance(0.001)
    lowered = book.current(api)
    assert [limiter.acquire(lowered).allowed for _ in range(6)] == [True] * 5 + [False]
    # Clearing the override goes back to 20/s on the same state: 20 in a second.
    book.clear("api")
    clock.advance(1.0)
    restored = book.current(api)
    assert restored is api
    assert sum(limiter.acquire(restored).allowed for _ in range(25)) == 20


def test_a_lowered_burst_caps_the_bucket_in_the_same_microsecond(client: redis.Redis) -> None:
    # The rate lowered between two acquires at the same Redis microsecond (or after a clock
    # step back): the stored level must not exceed the new capacity.
    prefix = f"cap-{uuid.uuid4().hex[:8]}"
    limiter = Limiter(client, prefix=prefix, clock_us=lambda: 1_000_000_000_000)
    wide = Limit.parse("20/s", name="api")
    assert limiter.acquire(wide).remaining == 19
    narrow = Limit.parse("5/s", name="api")
    admitted = sum(limiter.acquire(narrow).allowed for _ in range(10))
    assert admitted == 5


def test_a_rate_set_on_a_limit_s_name_says_to_pass_the_limit(
    client: redis.Redis, keyspace: KeySpace
) -> None:
    book = RateBook(client, keyspace)
    for call in (lambda: book.set("github", "10/s"), lambda: book.set_key("github", "a", "1/s")):
        with pytest.raises(TypeError, match=r"config.rule\('github'\).limit \(got 'github'\)"):
            call()
    assert book.overrides() == {} and book.key_overrides() == {}
