"""throttle.redis.clock: a process's offset to the Redis clock, bounded by the round trip."""

from __future__ import annotations

import time

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tests.support.eager import eager_app
from tests.support.servers import free_port
from throttle.celery.releaser import Releaser
from throttle.redis.clock import REFRESH_S, RedisClock, read_clocks, record_clock
from throttle.redis.keys import KeySpace


def redis_now(client: redis.Redis) -> float:
    seconds, micros = client.time()
    return seconds + micros / 1e6


class Monotonic:
    """A monotonic clock moved by hand, in s."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_offset_of_a_wrong_wall_clock_is_measured_within_half_a_round_trip(
    client: redis.Redis,
) -> None:
    # Given a host whose wall clock is 30 s ahead (Redis runs here, on the true clock)
    clock = RedisClock(client, wall=lambda: time.time() + 30.0)
    offset = clock.measure()
    # Then the offset is -30 s, its error at most half the round trip (+ the clocks' grain)
    assert abs(offset + 30.0) <= clock.error_s + 1e-3, (offset, clock.error_s)
    assert 0 < clock.error_s < 1.0
    # and now() is the Redis clock, whatever the wall clock says
    before = redis_now(client)
    now = clock.now()
    after = redis_now(client)
    assert before - clock.error_s - 1e-3 <= now <= after + clock.error_s + 1e-3
    assert abs(clock.from_wall(time.time() + 30.0) - now) < 0.1


def test_now_runs_on_the_monotonic_clock_and_measures_again_each_minute(
    client: redis.Redis,
) -> None:
    monotonic = Monotonic()
    clock = RedisClock(client, monotonic=monotonic)
    first = clock.now()
    calls = client.info("commandstats").get("cmdstat_time", {}).get("calls", 0)
    monotonic.now += 10.0  # 10 s later on the monotonic clock: no round trip
    assert clock.now() == first + 10.0
    assert client.info("commandstats").get("cmdstat_time", {}).get("calls", 0) == calls
    monotonic.now += REFRESH_S  # a minute later: measured again
    clock.now()
    assert client.info("commandstats")["cmdstat_time"]["calls"] > calls


def test_a_redis_that_never_answered_leaves_the_wall_clock_and_a_later_outage_the_anchor(
    client: redis.Redis,
) -> None:
    dead = redis.Redis(port=free_port(), socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0))
    stand_in = RedisClock(dead, wall=lambda: 123.0)
    assert stand_in.now() == 123.0
    assert not stand_in.measured
    dead.close()
    monotonic = Monotonic()
    clock = RedisClock(client, monotonic=monotonic)
    anchored = clock.now()
    clock.client = gone = redis.Redis(
        port=free_port(), socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0)
    )
    monotonic.now += REFRESH_S + 5.0  # due for a measurement, and Redis is away
    assert clock.now() == anchored + REFRESH_S + 5.0
    gone.close()


def test_workers_record_their_clocks_and_stale_records_are_left_out(
    client: redis.Redis, prefix: str
) -> None:
    key = KeySpace(prefix).clocks_key()
    clock = RedisClock(client, wall=lambda: time.time() - 2.0)
    clock.measure()
    record_clock(clock, key, "w1@host")
    client.hset(key, "w2@host", f"1.0 0.001 {redis_now(client) - 600:.3f}")  # 10 min old
    client.hset(key, "junk", "not a record")
    records = read_clocks(client, key, newer_than_s=300)
    assert [r.worker for r in records] == ["w1@host"]
    assert abs(records[0].offset_s - 2.0) <= records[0].error_s + 1e-3
    assert 0 <= records[0].age_s < 5


def test_a_worker_stopping_cleanly_drops_its_clock_record(
    client: redis.Redis, redis_url: str, prefix: str
) -> None:
    key = KeySpace(prefix).clocks_key()
    with eager_app("clock-forget", redis_url, prefix, {"api": {"rate": "1/s"}}) as app:
        clock = RedisClock(client)
        clock.measure()
        record_clock(clock, key, "w1@host")
        record_clock(clock, key, "w2@host")
        releaser = Releaser(app, worker="w1@host")
        releaser.start()
        releaser.stop()
        releaser.join(timeout=10)
        assert not releaser.is_alive()
    # the stopped worker's clock is no longer listed; another worker's still is
    assert [r.worker for r in read_clocks(client, key, newer_than_s=300)] == ["w2@host"]
