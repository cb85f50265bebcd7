"""Plans and per-key rates on a real Redis: each key's state runs at its own rate, and a
rate set for one key reaches other processes within ``refresh_s``."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import redis
import redis.asyncio

from tests.support.clock import FakeClock
from throttle import ConfigError, KeySpace, Limit, Limiter, RequestError
from throttle.rates import RATES_CHANGED, RateBook
from throttle.rules import Rule, targets

REFRESH_S = 2.0
PLANS = {"free": "10/s burst 5", "pro": "100/s burst 50", "enterprise": "1000/s"}


class FakeMonotonic:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def call(tenant_id: str, plan: str) -> None:
    """A task function of the rule below."""


@pytest.fixture
def keyspace(prefix: str) -> KeySpace:
    return KeySpace(prefix, "ns")


@pytest.fixture
def limiter(client: redis.Redis, prefix: str, clock: FakeClock) -> Limiter:
    return Limiter(client, prefix=prefix, namespace="ns", clock_us=clock)


@pytest.mark.parametrize("algorithm", ["gcra", "token_bucket", "sliding_window", "fixed_window"])
def test_each_key_admits_at_its_plan_s_rate_over_one_second(
    limiter: Limiter, clock: FakeClock, algorithm: str
) -> None:
    """Given keys on three plans of one limit, each flooding, when a second of the Redis
    clock passes in 10 ms steps, then each key got its plan's count (its burst + its rate),
    whatever the others took: the state of a key is its own."""
    windowed = algorithm.endswith("window")
    plans = {"free": "10/s", "pro": "100/s", "enterprise": "1000/s"} if windowed else PLANS
    rule = Rule(
        Limit.parse("10/s", name="api", algorithm=algorithm), key="{tenant_id}", plan="{plan}",
        plans=plans,
    )  # fmt: skip
    tenants = {"a": "free", "b": "pro", "c": "enterprise"}
    admitted = dict.fromkeys(tenants, 0)
    for _ in range(100):
        for tenant, plan in tenants.items():
            ((limit, key, cost),) = targets([rule], call, (tenant, plan), {})
            while limiter.acquire(limit, key, cost=cost).allowed:
                admitted[tenant] += 1
        clock.advance(0.01)
    if windowed:  # one window of the plan's count (the second may straddle two windows)
        assert 10 <= admitted["a"] <= 20 and 100 <= admitted["b"] <= 200
        assert 1000 <= admitted["c"] <= 2000
    else:  # the burst, then the rate for 0.99 s
        assert admitted["a"] == pytest.approx(5 + 9.9, abs=1)
        assert admitted["b"] == pytest.approx(50 + 99, abs=1)
        assert admitted["c"] == pytest.approx(1000 + 990, abs=1)


def test_a_key_that_changes_plan_keeps_its_state(limiter: Limiter, clock: FakeClock) -> None:
    """A key's state is per key, not per plan: upgrading a drained key from free to pro does
    not hand it a fresh burst, it continues from its debt at the new rate."""
    rule = Rule(Limit.parse("10/s", name="api", algorithm="gcra"), key="{tenant_id}",
                plan="{plan}", plans=PLANS)  # fmt: skip
    ((free, key, _),) = targets([rule], call, ("acme", "free"), {})
    assert sum(limiter.acquire(free, key).allowed for _ in range(10)) == 5
    ((pro, _, _),) = targets([rule], call, ("acme", "pro"), {})
    got = sum(limiter.acquire(pro, key).allowed for _ in range(100))
    assert got < 50  # not a fresh 50: the free burst was spent on the same state
    clock.advance(1.0)  # idle: the key refills to pro's burst, 50, not beyond
    assert sum(limiter.acquire(pro, key).allowed for _ in range(200)) == 50


def test_a_key_s_rate_reaches_another_process_within_refresh_and_clears(
    client: redis.Redis, keyspace: KeySpace
) -> None:
    rule = Rule(Limit.parse("10/s", name="api", algorithm="gcra"), key="{tenant_id}",
                plan="{plan}", plans=PLANS)  # fmt: skip
    operator = RateBook(client, keyspace, refresh_s=REFRESH_S, monotonic=FakeMonotonic())
    time = FakeMonotonic()
    worker = RateBook(client, keyspace, refresh_s=REFRESH_S, monotonic=time)
    ((pro, _, _),) = targets([rule], call, ("acme", "pro"), {}, worker.current)
    assert (pro.count, pro.capacity) == (100.0, 50.0)

    # Without "burst", a key's rate is no burstier than its plan: 250/s keeps pro's 50.
    operator.set_key(rule.limit, "acme", "250/s")
    assert operator.key_overrides() == {("api", "acme"): "250/s"}
    time.now += REFRESH_S - 0.001
    assert targets([rule], call, ("acme", "pro"), {}, worker.current)[0][0] == pro
    time.now += 0.001
    ((seen, _, _),) = targets([rule], call, ("acme", "pro"), {}, worker.current)
    assert (seen.name, seen.algorithm, seen.count, seen.capacity) == (
        "api",
        pro.algorithm,
        250.0,
        50.0,
    )
    # ... on the free plan, the same override keeps free's burst 5; other keys keep plans.
    ((free, _, _),) = targets([rule], call, ("acme", "free"), {}, worker.current)
    assert (free.count, free.capacity) == (250.0, 5.0)
    ((other, _, _),) = targets([rule], call, ("bigco", "pro"), {}, worker.current)
    assert other == pro
    # A rate that says its burst gets it.
    operator.set_key(rule.limit, "acme", "250/s burst 100")
    time.now += REFRESH_S
    assert targets([rule], call, ("acme", "pro"), {}, worker.current)[0][0].capacity == 100.0
    # A rate for the whole limit does not touch the key's own.
    operator.set(rule.limit, "5/s")
    time.now += REFRESH_S
    assert targets([rule], call, ("acme", "pro"), {}, worker.current)[0][0].count == 250.0
    assert targets([rule], call, ("bigco", "pro"), {}, worker.current)[0][0].count == 5.0

    assert operator.clear_key("api", "acme") is True
    assert operator.clear_key("api", "acme") is False
    operator.clear("api")
    time.now += REFRESH_S
    assert targets([rule], call, ("acme", "pro"), {}, worker.current)[0][0] == pro
    assert operator.key_overrides() == {}


def test_a_key_s_rate_is_validated_and_a_fair_limit_refuses_one(
    client: redis.Redis, keyspace: KeySpace
) -> None:
    book = RateBook(client, keyspace, refresh_s=REFRESH_S, monotonic=FakeMonotonic())
    limit = Limit.parse("10/s", name="api")
    with pytest.raises(ConfigError, match="malformed rate"):
        book.set_key(limit, "acme", "fast")
    fair = Limit.parse("10/s", name="llm", fair=True)
    with pytest.raises(ConfigError, match="weight") as caught:
        book.set_key(fair, "acme", "5/s")
    assert (caught.value.limit, caught.value.field) == ("llm", "key")
    with pytest.raises(RequestError, match="needs the key"):
        book.set_key(limit, None, "5/s")  # type: ignore[arg-type]
    assert client.exists(keyspace.key_rates_key()) == 0


def test_a_key_rate_stored_for_a_fair_limit_is_ignored_not_a_way_out_of_its_share(
    client: redis.Redis, keyspace: KeySpace
) -> None:
    # Given a fair limit, and a key rate stored for it anyway: set while the limit was not
    # fair yet, or through set_key with a Limit built without fair=True
    fair = Limit.parse("20/s", name="llm", fair=True, weights={"acme": 4})
    RateBook(client, keyspace).set_key(Limit.parse("20/s", name="llm"), "acme", "100/s")
    book = RateBook(client, keyspace, refresh_s=REFRESH_S, monotonic=FakeMonotonic())
    # Then the key's tasks still take the fair limit, their share of its rate, not a
    # plain limit of their own at 100/s, outside the shared rate
    assert book.current(fair, "acme") is fair
    # as do a fair plan's (its weight)
    pro = dataclasses.replace(fair, default_weight=8.0)
    assert book.current(pro, "acme") is pro


def test_a_key_rate_written_by_hand_that_does_not_parse_is_ignored(
    client: redis.Redis, keyspace: KeySpace
) -> None:
    limit = Limit.parse("10/s", name="api")
    field = keyspace.hold_fields("api", "acme")[1]
    client.hset(keyspace.key_rates_key(), field, "fast please")
    book = RateBook(client, keyspace, refresh_s=REFRESH_S, monotonic=FakeMonotonic())
    assert book.current(limit, "acme") is limit


def test_the_metrics_show_each_key_s_own_rate(redis_url: str, prefix: str) -> None:
    from celery import Celery  # noqa: PLC0415

    from throttle import metrics  # noqa: PLC0415
    from throttle.celery.exporter import fleet_state  # noqa: PLC0415
    from throttle.celery.runtime import Throttler  # noqa: PLC0415

    app = Celery("plan_metrics", set_as_current=False)
    app.conf.throttle_config = {
        "settings": {"prefix": prefix, "metrics": True},
        "limits": {"api": {"rate": "10/s", "key": "{tenant_id}", "plan": "{plan}",
                           "plans": {"pro": "100/s"}},
                   "llm": {"rate": "20/s", "key": "{tenant_id}", "fair": True}},
    }  # fmt: skip
    app.conf.throttle_redis_url = redis_url
    throttler = Throttler.of(app)
    try:
        throttler.rates.set_key(throttler.config.rules["api"].limit, "acme", "250/s")
        # a key rate stored for a fair limit (the workers ignore it: not a rate in force)
        throttler.rates.set_key(Limit.parse("20/s", name="llm"), "acme", "100/s")
        collector = metrics.ThrottleCollector(lambda: [], lambda: fleet_state(app))
        samples = {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in collector.collect()
            for sample in family.samples
        }
    finally:
        throttler.limiter.client.close()
    assert samples[("throttle_key_rate", (("key", "acme"), ("limit", "api")))] == 250.0
    assert ("throttle_key_rate", (("key", "acme"), ("limit", "llm"))) not in samples


def test_a_fair_limit_s_plan_weight_survives_a_rate_set_for_the_whole_limit(
    client: redis.Redis, keyspace: KeySpace
) -> None:
    fair = Limit.parse("10/s", name="llm", fair=True)
    rule = Rule(fair, key="{tenant_id}", plan="{plan}", plans={"pro": 4})
    book = RateBook(client, keyspace, refresh_s=REFRESH_S, monotonic=FakeMonotonic())
    book.set(fair, "20/s")
    ((limit, key, _),) = targets([rule], call, ("acme", "pro"), {}, book.current)
    assert (limit.rate_per_s, limit.weight(key), limit.fair) == (20.0, 4.0, True)


def test_a_key_too_long_for_a_field_name_reads_back_as_itself(
    client: redis.Redis, keyspace: KeySpace, redis_url: str
) -> None:
    """A key of more than 100 characters is kept hashed in the per-key hash's field
    (``#`` + SHA-256); the operator reads it back as the key itself, from either client,
    and clearing it forgets its name too."""
    import asyncio  # noqa: PLC0415

    import throttle.aio as throttle_aio  # noqa: PLC0415

    limit = Limit.parse("10/s", name="api")
    long_key = "tenant-" + "x" * 120
    book = RateBook(client, keyspace, refresh_s=REFRESH_S, monotonic=FakeMonotonic())
    book.set_key(limit, long_key, "50/s")
    book.set_key(limit, "acme", "20/s")
    assert book.key_overrides() == {("api", long_key): "50/s", ("api", "acme"): "20/s"}
    (field,) = [f for f in client.hkeys(keyspace.key_rates_key()) if b"#" in f]
    assert client.hgetall(keyspace.key_names_key()) == {field: long_key.encode()}

    async def from_asyncio() -> dict[tuple[str, str | None], str]:
        aclient = redis.asyncio.Redis.from_url(redis_url)
        try:
            abook = throttle_aio.RateBook(aclient, keyspace, refresh_s=0)
            seen = await abook.key_overrides()
            assert await abook.clear_key("api", long_key) is True
            return seen
        finally:
            await aclient.aclose()

    assert asyncio.run(from_asyncio())[("api", long_key)] == "50/s"
    assert book.key_overrides() == {("api", "acme"): "20/s"}
    assert client.exists(keyspace.key_names_key()) == 0
    assert book.clear_key("api", "acme") is True


def announced(pubsub: redis.client.PubSub) -> list[str]:
    """The announcements a subscriber of the capacity channel has heard so far."""
    heard = []
    while (message := pubsub.get_message(timeout=0.5)) is not None:
        if message["type"] == "message":
            heard.append(message["data"].decode())
    return heard


def test_each_rate_change_of_either_book_is_announced_to_the_waiting_tasks(
    client: redis.Redis, keyspace: KeySpace, redis_url: str
) -> None:
    """A worker's line wakes its waiting tasks when a rate change is announced on the
    capacity channel; unannounced, a key's tasks waited until the time the old, lower rate
    named (up to line_max) after `celery throttle clear LIMIT --key KEY`, and so did every
    limit's after a change through the asyncio book, or of the rate the upstream states."""
    limit = Limit.parse("10/s", name="api", algorithm="gcra")
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(keyspace.capacity_channel())
    try:
        assert announced(pubsub) == []
        # When each change is made through the blocking book
        book = RateBook(client, keyspace)
        book.set_key(limit, "acme", "1/m")
        book.clear_key("api", "acme")
        book.set(limit, "1/m")
        book.clear("api")
        book.follow(limit, "5/s")  # the upstream's stated rate, then back to the configured
        book.follow(limit, None)
        # and through the asyncio one
        from throttle.aio import RateBook as AsyncRateBook  # noqa: PLC0415

        async def changes() -> None:
            async_client = redis.asyncio.Redis.from_url(redis_url)
            try:
                async_book = AsyncRateBook(async_client, keyspace)
                await async_book.set_key(limit, "acme", "1/m")
                await async_book.clear_key("api", "acme")
                await async_book.set(limit, "1/m")
                await async_book.clear("api")
                await async_book.follow(limit, "5/s")
                await async_book.follow(limit, None)
            finally:
                await async_client.aclose()

        asyncio.run(changes())
        # Then each is announced, naming the limit
        assert announced(pubsub) == [f"{RATES_CHANGED} api"] * 12
    finally:
        pubsub.close()
