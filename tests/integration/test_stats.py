"""StatsBook: fleet-wide per-minute counts of throttle events, against a real redis-server."""

from __future__ import annotations

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tests.support.servers import free_port
from tests.support.waits import wait_for
from throttle.errors import BackendUnavailable, RequestError
from throttle.redis.keys import KeySpace
from throttle.stats import MAX_MINUTES, TTL_S, StatsBook, Tally

T0 = 1_763_776_800.0  # 2025-11-22 02:00:00 UTC, the start of a minute


class Clock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def book(client: redis.Redis, prefix: str, clock: Clock) -> StatsBook:
    return StatsBook(client, KeySpace(prefix), clock=clock)


def test_counts_are_averaged_over_the_last_whole_minutes(book: StatsBook, clock: Clock) -> None:
    # Given three minutes of events from "several workers" (several books, one keyspace)
    other = StatsBook(book.client, book.keyspace, clock=clock)
    book.record(["github"], "denied", 6)  # minute 0
    other.record(["github", "stripe"], "denied")
    clock.now += 60  # minute 1
    book.record(["github"], "denied", 2)
    other.record(["github"], "parked", 3)
    clock.now += 60  # minute 2
    book.record(["stripe"], "timeout")
    clock.now += 90  # half-way through minute 3: minute 2 is the last whole one
    book.record(["github"], "denied", 100)  # the unfinished minute is not counted
    # Then the last whole minute, and the mean of the last two and three
    assert book.per_minute(1) == {
        "stripe": {"denied": 0.0, "parked": 0.0, "timeout": 1.0, "waited": 0.0}
    }
    assert book.per_minute(2) == {
        "github": {"denied": 1.0, "parked": 1.5, "timeout": 0.0, "waited": 0.0},
        "stripe": {"denied": 0.0, "parked": 0.0, "timeout": 0.5, "waited": 0.0},
    }
    assert book.per_minute(3) == {
        "github": {"denied": 3.0, "parked": 1.0, "timeout": 0.0, "waited": 0.0},
        "stripe": {"denied": 1 / 3, "parked": 0.0, "timeout": 1 / 3, "waited": 0.0},
    }


def test_buckets_live_in_the_namespace_hash_tag_and_expire(
    book: StatsBook, client: redis.Redis, prefix: str, clock: Clock
) -> None:
    book.record(["a:b{c}"], "denied")  # any limit name, braces and colons included
    key = book.keyspace.stats_key(int(T0 // 60))
    assert key.startswith(f"{prefix}:{{default}}:")
    assert client.hgetall(key) == {b"denied:a:b{c}": b"1"}
    assert TTL_S - 5 <= client.ttl(key) <= TTL_S
    assert TTL_S > (MAX_MINUTES + 1) * 60  # per_minute(60) still finds its oldest minute
    clock.now += 60
    assert book.per_minute() == {
        "a:b{c}": {"denied": 1.0, "parked": 0.0, "timeout": 0.0, "waited": 0.0}
    }


def test_a_park_counts_as_denied_and_parked(book: StatsBook, clock: Clock) -> None:
    book.record_events(["x", "y"], ("denied", "parked"))
    clock.now += 60
    assert book.per_minute() == {
        "x": {"denied": 1.0, "parked": 1.0, "timeout": 0.0, "waited": 0.0},
        "y": {"denied": 1.0, "parked": 1.0, "timeout": 0.0, "waited": 0.0},
    }


def test_nothing_recorded_is_an_empty_answer(book: StatsBook) -> None:
    book.record([], "denied")
    book.record(["x"], "denied", 0)
    assert book.per_minute(MAX_MINUTES) == {}


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda b: b.record(["x"], "refused"), "unknown stats event 'refused'"),
        (lambda b: b.record(["x"], "denied", -1), "integer >= 0 (got -1)"),
        (lambda b: b.record(["x"], "denied", 1.5), "integer >= 0 (got 1.5)"),
        (lambda b: b.per_minute(0), "from 1 to 60 (got 0)"),
        (lambda b: b.per_minute(61), "from 1 to 60 (got 61)"),
        (lambda b: b.per_minute(True), "from 1 to 60 (got True)"),
    ],
    ids=["event", "negative", "fraction", "zero-minutes", "too-many-minutes", "bool"],
)
def test_bad_arguments_are_clear_errors(book: StatsBook, call: object, message: str) -> None:
    with pytest.raises(RequestError, match=message.replace("(", r"\(").replace(")", r"\)")):
        call(book)  # type: ignore[operator]


def test_an_unreachable_redis_raises_the_package_error(prefix: str) -> None:
    # No retries: redis-py would back off for seconds before giving up.
    dead = redis.Redis(port=free_port(), socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
    book = StatsBook(dead, KeySpace(prefix))
    with pytest.raises(BackendUnavailable):
        book.record(["x"], "denied")
    with pytest.raises(BackendUnavailable):
        book.per_minute()
    dead.close()


def test_a_tally_writes_its_counts_together_after_its_interval(
    book: StatsBook, clock: Clock
) -> None:
    # Given a tally gathering waits, written every 50 ms
    tally = Tally(book, every_s=0.05)
    for _ in range(5):
        tally.add(["github", "github", "stripe"], "waited")  # a limit listed twice: once
    clock.now += 60  # the next minute: the counted one is whole
    # Then soon after (one write), all of it is in the minute it was counted in, with a TTL
    key = book.keyspace.stats_key(int(T0 // 60))
    wait_for(lambda: book.client.hlen(key) == 2, 5)
    assert book.per_minute(1)["github"]["waited"] == 5.0
    assert book.per_minute(1)["stripe"]["waited"] == 5.0
    assert 0 < book.client.ttl(key) <= TTL_S


def test_a_tally_flushed_at_once_and_its_failures_reported(book: StatsBook, prefix: str) -> None:
    # Given a tally with counts, not written before its interval (a minute here)
    tally = Tally(book, every_s=60)
    tally.add(["github"], "waited")
    key = book.keyspace.stats_key(int(T0 // 60))
    assert book.client.hgetall(key) == {}
    # When it is flushed by hand, they are written
    tally.flush()
    assert book.client.hgetall(key) == {b"waited:github": b"1"}
    tally.flush()  # nothing gathered: nothing written
    assert book.client.hgetall(key) == {b"waited:github": b"1"}
    # When its Redis is unreachable, the failure goes to on_error with the limits, and
    # the counts of that write are dropped
    dead = redis.Redis(port=free_port(), socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
    failed: list[tuple[list[str], Exception]] = []
    lost = Tally(
        StatsBook(dead, KeySpace(prefix), clock=lambda: T0),
        every_s=60,
        on_error=lambda limits, exc: failed.append((limits, exc)),
    )
    lost.add(["stripe", "github"], "waited")
    lost.flush()
    assert [limits for limits, _ in failed] == [["github", "stripe"]]
    assert isinstance(failed[0][1], BackendUnavailable)
    with pytest.raises(RequestError, match="unknown stats event 'waits'"):
        lost.add(["github"], "waits")
    dead.close()


def test_a_tally_whose_write_failed_writes_the_next_counts_on_its_own(
    book: StatsBook, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a tally (no on_error) whose first write, by its own thread, finds Redis away
    dead = redis.Redis(port=free_port(), socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
    tally = Tally(StatsBook(dead, KeySpace(prefix), clock=lambda: T0), every_s=0.05)
    tally.add(["github"], "waited")
    wait_for(lambda: "could not write" in caplog.text, 5)
    # When Redis is back (its book reaches the live one) and more is counted
    tally.book = book
    tally.add(["stripe"], "waited")
    # Then the same thread writes it, without a flush by hand
    key = book.keyspace.stats_key(int(T0 // 60))
    wait_for(lambda: book.client.hgetall(key) == {b"waited:stripe": b"1"}, 5)
    dead.close()


def test_the_fleet_reporter_counts_each_delayed_task_once(book: StatsBook, clock: Clock) -> None:
    from types import SimpleNamespace  # noqa: PLC0415

    from throttle.celery.message import H_DEFERRALS  # noqa: PLC0415
    from throttle.celery.observe import FleetStatsReporter, Observer  # noqa: PLC0415
    from throttle.rules import Rule  # noqa: PLC0415
    from throttle.spec import Limit  # noqa: PLC0415

    reporter = FleetStatsReporter(book, on_error=Observer())
    rules = (Rule(Limit.parse("5/s", name="api")),)
    first = SimpleNamespace(rules=rules, message_headers={})
    back = SimpleNamespace(rules=rules, message_headers={H_DEFERRALS: 1})
    # One task deferred twice (parked the second time), then held for its slot; another
    # that only waited for its slot; a third admitted at once
    reporter.deferred(first, ["api"], "republish", 2.0, 1)
    reporter.deferred(back, ["api"], "park", 2.0, 2)
    reporter.allowed(back, 0.2)
    reporter.allowed(first, 0.2)
    reporter.allowed(first, 0.0)
    reporter.tally.flush()
    clock.now += 60
    # Then two tasks were delayed, and one parking happened
    counts = book.per_minute(1)["api"]
    assert (counts["denied"] + counts["waited"], counts["parked"]) == (2.0, 1.0)
