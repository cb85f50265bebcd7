"""The restart fence (lua/prelude.lua) and the call-time spacing guard (lua/space.lua),
against a real Redis on the test clock.

A Redis that loses its data (a restart without persistence, a flush, an empty replica
promoted) loses the fence marker with the states; slots the lost state granted may still be
slept to, up to ``fence_s`` ahead. The scripts then admit nothing new before the fence ends.
"""

from __future__ import annotations

import pytest
import redis

from tests.support.clock import FakeClock
from throttle import Limit, Limiter, RequestError
from throttle.memory import MemoryLimiter

SHAPER = Limit.parse("20/s burst 1", name="shaper", algorithm="gcra")
BUCKET = Limit.parse("20/s burst 3", name="bucket")
WIDE = Limit.parse("20/s burst 3", name="wide", algorithm="gcra")
DAILY = Limit.parse("100/d", name="daily", algorithm="fixed_window")
FENCE_S = 1.0


@pytest.fixture
def fenced(client: redis.Redis, prefix: str, clock: FakeClock) -> Limiter:
    """A limiter with a fence of 1 s on a Redis that knows its marker (as a worker's start
    writes it: a fence that has ended)."""
    limiter = Limiter(client, prefix=prefix, clock_us=clock)
    limiter.fence_s = FENCE_S
    client.set(limiter.keyspace.fence_key(), 0)
    return limiter


def lose_the_data(client: redis.Redis, prefix: str) -> None:
    """What a restart without persistence does to the namespace: every key gone."""
    keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
    if keys:
        client.delete(*keys)


def test_slots_granted_before_a_loss_are_not_granted_again(
    fenced: Limiter, client: redis.Redis, prefix: str, clock: FakeClock
) -> None:
    """Given tasks holding slots 0, 50, ..., 950 ms ahead (sleeping to them), when the
    limiter's Redis loses its data, then the next slot comes a spacing after the fence's
    end (1 s after the loss was seen): after every slot the lost state may have granted."""
    slots = [fenced.acquire(SHAPER, max_wait_s=FENCE_S).wait_s for _ in range(20)]
    assert slots[-1] == pytest.approx(0.95)
    lose_the_data(client, prefix)
    clock.advance(0.01)
    after = fenced.acquire(SHAPER, max_wait_s=5.0)
    assert after.allowed and after.wait_s == pytest.approx(FENCE_S + 0.05)
    assert fenced.acquire(SHAPER, max_wait_s=5.0).wait_s == pytest.approx(FENCE_S + 0.1)
    # Every key of every limit (this one was never seen): denied until then.
    assert fenced.acquire(SHAPER, "tenant").retry_after_s == pytest.approx(FENCE_S + 0.05)
    clock.advance(FENCE_S)
    assert not fenced.acquire(SHAPER, "tenant").allowed
    clock.advance(0.05)
    assert fenced.acquire(SHAPER, "tenant").allowed


def test_without_a_fence_the_lost_state_reads_as_new(
    client: redis.Redis, prefix: str, clock: FakeClock
) -> None:
    """Today's default, the mechanism of issue 17: the slots the lost state granted are
    handed out again at once."""
    plain = Limiter(client, prefix=prefix, clock_us=clock)
    for _ in range(20):
        plain.acquire(SHAPER, max_wait_s=FENCE_S)
    lose_the_data(client, prefix)
    assert plain.acquire(SHAPER, max_wait_s=5.0).wait_s == 0.0
    assert not client.exists(f"{prefix}:{{default}}:fence")


@pytest.mark.parametrize("limit", [BUCKET, WIDE], ids=["token_bucket", "gcra-burst-3"])
def test_a_burst_comes_at_the_fence_end_not_before(
    fenced: Limiter, client: redis.Redis, prefix: str, clock: FakeClock, limit: Limit
) -> None:
    """The lost state may have spent its burst up to the fence's end: it refills from
    there, at the limit's rate."""
    lose_the_data(client, prefix)
    waits = [fenced.acquire(limit, max_wait_s=5.0).wait_s for _ in range(4)]
    assert waits == pytest.approx([FENCE_S + 0.05 * i for i in (1, 2, 3, 4)])
    clock.advance(FENCE_S + 3.0)  # refilled: a burst again
    assert [fenced.acquire(limit, "k").wait_s for _ in range(3)] == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("limit", [BUCKET, WIDE], ids=["token_bucket", "gcra-burst-3"])
def test_a_peek_reads_the_fence_as_the_acquires_do(
    fenced: Limiter, client: redis.Redis, prefix: str, clock: FakeClock, limit: Limit
) -> None:
    """status and the gauges show what an acquire would be told: nothing before the fence
    ends, on a key never seen since the loss; and a peek writes no marker of its own."""
    lose_the_data(client, prefix)
    peeked = fenced.peek(limit, "k")
    assert peeked.allowed and not client.exists(fenced.keyspace.fence_key())
    fenced.acquire(limit, "other")  # the first acquire finds the marker missing
    peeked = fenced.peek(limit, "k")
    denied = fenced.acquire(limit, "k")
    assert not peeked.allowed and not denied.allowed
    assert peeked.retry_after_s == pytest.approx(denied.retry_after_s)
    clock.advance(FENCE_S + 0.05)
    assert fenced.peek(limit, "k").allowed


def test_a_recorded_acquisition_is_fenced_and_settles(
    fenced: Limiter, client: redis.Redis, prefix: str, clock: FakeClock
) -> None:
    lose_the_data(client, prefix)
    decision = fenced.acquire_many([(SHAPER, None), (DAILY, "acme")], max_wait_s=5.0,
                                   acquisition_id="task-1")  # fmt: skip
    assert decision.allowed and decision.wait_s == pytest.approx(FENCE_S + 0.05)
    # The lease record is where settle finds it (the marker is not one of its keys), and
    # acquiring again with the id takes nothing twice.
    assert fenced.acquire_many([(SHAPER, None), (DAILY, "acme")], max_wait_s=5.0,
                               acquisition_id="task-1").held  # fmt: skip
    assert decision.acquisition is not None
    assert fenced.settle(decision.acquisition, None).status == "settled"
    again = fenced.acquire_many([(SHAPER, None), (DAILY, "acme")], max_wait_s=5.0,
                                acquisition_id="task-2")  # fmt: skip
    assert again.wait_s == pytest.approx(FENCE_S + 0.1)


def test_the_fence_ends_and_a_found_marker_fences_nothing(
    fenced: Limiter, client: redis.Redis, prefix: str, clock: FakeClock
) -> None:
    """The marker is written once: a state that expires later (an idle limit) is new, not
    lost; and windows never reserve, so no fence."""
    client.delete(fenced.keyspace.fence_key())  # a new Redis
    assert fenced.acquire(SHAPER, max_wait_s=5.0).wait_s == pytest.approx(FENCE_S + 0.05)
    clock.advance(10.0)
    client.delete(f"{prefix}:{{default}}:gcra:shaper:")
    assert fenced.acquire(SHAPER).allowed
    lose_the_data(client, prefix)
    assert fenced.acquire(DAILY, "acme").allowed


def test_a_limiter_marked_started_on_a_new_redis_is_not_fenced(
    client: redis.Redis, prefix: str, clock: FakeClock
) -> None:
    """A limiter of one's own with a fence, started on a new Redis: marked started, its
    first calls are admitted (not fenced for fence_s as a loss of data would be); a marker
    already there (a fence another process wrote) is left as it is."""
    limiter = Limiter(client, prefix=prefix, clock_us=clock)
    limiter.fence_s = FENCE_S
    limiter.mark_started()
    assert limiter.acquire(SHAPER, max_wait_s=FENCE_S).wait_s == 0.0
    client.set(limiter.keyspace.fence_key(), 123)
    limiter.mark_started()
    assert client.get(limiter.keyspace.fence_key()) == b"123"


def test_the_guard_spaces_calls_that_started_late(
    fenced: Limiter, client: redis.Redis, prefix: str, clock: FakeClock
) -> None:
    """Given a late call stamped at 5 ms past its slot, the next one, on time at 50 ms, is
    held back to 55 ms; a call a spacing or more later waits for nothing."""
    plain = Limiter(client, prefix=prefix, clock_us=clock)
    target = [(SHAPER, None, 1.0)]
    assert plain.space(target) == 0.0
    clock.advance(0.045)
    assert plain.space(target) == pytest.approx(0.005)
    clock.advance(0.2)
    assert plain.space(target) == 0.0
    # Per key; several limits at once wait for the latest; the cost scales the spacing.
    assert plain.space([(SHAPER, "a", 2.0), (BUCKET, None, 1.0)]) == 0.0
    clock.advance(0.06)
    assert plain.space([(SHAPER, "a", 1.0), (BUCKET, None, 1.0)]) == pytest.approx(0.04)
    # Lost with the data: read as a call at the fence's end.
    lose_the_data(client, prefix)
    assert fenced.space(target) == pytest.approx(FENCE_S + 0.05)


def test_the_guard_refuses_what_has_no_spacing(limiter: Limiter) -> None:
    with pytest.raises(RequestError, match="rate limit"):
        limiter.space([(Limit.parse("3 concurrent", name="c"), None, 1.0)])
    with pytest.raises(RequestError, match="at least one"):
        limiter.space([])


def test_the_memory_limiter_guards_as_the_script(
    client: redis.Redis, prefix: str, clock: FakeClock
) -> None:
    scripts = Limiter(client, prefix=prefix, clock_us=clock)
    memory = MemoryLimiter(clock_us=clock)
    calls = [(0.0, "a", 1.0), (0.01, "a", 1.0), (0.02, None, 3.0), (0.1, "a", 1.0),
             (0.4, None, 1.0), (0.41, "b", 2.0)]  # fmt: skip
    for advance, key, cost in calls:
        clock.advance(advance)
        target = [(SHAPER, key, cost)]
        assert memory.space(target) == scripts.space(target)
