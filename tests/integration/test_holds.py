"""Holds and pauses (lua/hold.lua) and peek (lua/peek.lua), against a real Redis."""

from __future__ import annotations

import math

import pytest

from tests.support.clock import FakeClock
from throttle import Limit, Limiter, RequestError
from throttle.limiter import HOLD_PLACED

API = Limit.parse("10/s burst 2", name="api")
SHAPER = Limit.parse("10/s burst 1", name="shaper", algorithm="gcra")
DAILY = Limit.parse("100/d", name="daily", algorithm="fixed_window")


def test_a_hold_denies_every_key_until_it_ends(clocked: Limiter, clock: FakeClock) -> None:
    assert clocked.hold(API, None, 2.5) == pytest.approx(2.5)
    for key in (None, "tenant-a"):
        denied = clocked.acquire(API, key)
        assert not denied.allowed
        assert denied.retry_after_s == pytest.approx(2.5)
        assert denied.denied_by == ("api",)
        assert denied.remaining == 0
    clock.advance(2.5)
    assert clocked.acquire(API, "tenant-a").allowed
    # The denials took nothing: the bucket is full (burst 2) after the hold.
    assert clocked.acquire(API, "tenant-a").allowed
    assert not clocked.acquire(API, "tenant-a").allowed


def test_a_key_hold_leaves_other_keys_alone(clocked: Limiter, clock: FakeClock) -> None:
    clocked.hold(API, "tenant-a", 1.0)
    assert not clocked.acquire(API, "tenant-a").allowed
    assert clocked.acquire(API, "tenant-b").allowed
    assert clocked.acquire(API).allowed
    # Recorded acquisitions (acquire.lua) honour it as well.
    assert not clocked.acquire(API, "tenant-a", acquisition_id="t1").allowed
    assert clocked.acquire(API, "tenant-b", acquisition_id="t2").allowed


def test_a_held_limit_denies_a_multi_limit_acquisition_and_takes_nothing(
    clocked: Limiter, clock: FakeClock
) -> None:
    clocked.hold(SHAPER, None, 3.0)
    denied = clocked.acquire_many([(DAILY, "acme"), (SHAPER, None)], acquisition_id="t1")
    assert not denied.allowed
    assert denied.denied_by == ("shaper",)
    assert denied.retry_after_s == pytest.approx(3.0)
    assert clocked.peek(DAILY, "acme").remaining == 100  # nothing taken from the daily limit
    clock.advance(3.0)
    assert clocked.acquire_many([(DAILY, "acme"), (SHAPER, None)], acquisition_id="t1").allowed
    assert clocked.peek(DAILY, "acme").remaining == 99


def test_a_pause_lasts_until_lifted(clocked: Limiter, clock: FakeClock) -> None:
    assert clocked.hold("api", None, None) == math.inf
    clock.advance(86400 * 365)
    denied = clocked.acquire(API)
    assert not denied.allowed and denied.retry_after_s == math.inf
    assert clocked.acquire_many([(API, None)], acquisition_id="x").retry_after_s == math.inf
    assert clocked.peek(API).retry_after_s == math.inf
    assert clocked.holds() == {("api", None): math.inf}
    clocked.unhold("api")
    assert clocked.acquire(API).allowed
    assert clocked.holds() == {}


def test_a_hold_only_lengthens(clocked: Limiter, clock: FakeClock) -> None:
    clocked.hold(API, None, 10.0)
    assert clocked.hold(API, None, 1.0) == pytest.approx(10.0)  # a shorter 429 changes nothing
    clocked.hold(API, None, None)
    assert clocked.hold(API, None, 5.0) == math.inf  # nor does an upstream hold end a pause
    clock.advance(20.0)
    assert not clocked.acquire(API).allowed


def test_ended_holds_are_swept(clocked: Limiter, clock: FakeClock) -> None:
    for i in range(30):
        clocked.hold(API, f"tenant-{i}", 1.0)
    clocked.hold(API, "tenant-{x}:y", 5.0)  # braces and the separator survive the round trip
    holds_key = clocked.keyspace.holds_key()
    assert clocked.client.hlen(holds_key) == 31
    clock.advance(2.0)
    assert clocked.holds() == {("api", "tenant-{x}:y"): pytest.approx(3.0)}
    clocked.hold(SHAPER, None, 1.0)  # every hold sweeps the ended ones
    assert clocked.client.hlen(holds_key) == 2
    clocked.unhold(API, "tenant-{x}:y")
    clocked.unhold(SHAPER)
    assert clocked.client.hlen(holds_key) == 0


def test_a_hold_voids_a_reserved_slot_it_covers(clocked: Limiter, clock: FakeClock) -> None:
    # Three tasks reserve the next slots (0, 0.1 s, 0.2 s); then the upstream says 429,
    # retry after 0.15 s.
    for i in range(3):
        assert clocked.acquire(SHAPER, acquisition_id=f"t{i}", max_wait_s=1.0).allowed
    clocked.hold(SHAPER, None, 0.15)
    # At its slot, t1 acquires again with its id (as a throttled task does): voided.
    clock.advance(0.1)
    voided = clocked.acquire(SHAPER, acquisition_id="t1", max_wait_s=1.0)
    assert not voided.allowed and voided.held
    assert voided.retry_after_s == pytest.approx(0.05)
    assert voided.acquisition is not None and voided.acquisition.id == "t1"
    assert clocked.settle(voided.acquisition, None).status == "settled"
    # t2's slot (0.2 s) comes after the hold's end (0.15 s): it stands.
    clock.advance(0.05)
    kept = clocked.acquire(SHAPER, acquisition_id="t2", max_wait_s=1.0)
    assert kept.allowed and kept.held
    assert kept.wait_s == pytest.approx(0.05)


def test_peek_takes_nothing(clocked: Limiter, clock: FakeClock) -> None:
    limit = Limit.parse("10/s burst 5", name="peeked")
    assert clocked.peek(limit).remaining == 5
    assert clocked.acquire(limit, cost=4).allowed
    assert clocked.peek(limit).remaining == 1
    assert clocked.acquire(limit).allowed
    empty = clocked.peek(limit)
    assert not empty.allowed
    assert empty.retry_after_s == pytest.approx(0.1)
    assert clocked.peek(limit).remaining == 0  # still: peeking took nothing
    clock.advance(0.3)
    assert clocked.peek(limit).remaining == pytest.approx(3.0)
    # GCRA: the next free slot.
    assert clocked.acquire(SHAPER, max_wait_s=1.0).allowed
    assert clocked.acquire(SHAPER, max_wait_s=1.0).wait_s == pytest.approx(0.1)
    assert clocked.peek(SHAPER).retry_after_s == pytest.approx(0.2)
    # Concurrency: units free.
    conc = Limit.parse("3 concurrent", name="conc")
    clocked.acquire(conc, acquisition_id="c1")
    assert clocked.peek(conc).remaining == 2
    assert clocked.peek(conc, cost=3).retry_after_s > 0


def test_hold_arguments_are_checked(clocked: Limiter) -> None:
    with pytest.raises(RequestError, match="seconds"):
        clocked.hold(API, None, -1.0)
    with pytest.raises(RequestError, match="seconds"):
        clocked.hold(API, None, math.nan)
    with pytest.raises(RequestError, match="limit"):
        clocked.hold("", None, 1.0)
    with pytest.raises(RequestError, match="key"):
        clocked.hold(API, "", 1.0)
    with pytest.raises(RequestError, match="Limit"):
        clocked.peek("api")  # type: ignore[arg-type]


def test_placing_and_lifting_a_hold_are_announced_to_the_waiting_workers(
    clocked: Limiter,
) -> None:
    # Given a worker listening on the namespace's capacity channel
    listener = clocked.client.pubsub(ignore_subscribe_messages=True)
    listener.subscribe(clocked.keyspace.capacity_channel())
    listener.get_message(timeout=1.0)  # the subscription's confirmation

    def heard() -> list[str]:
        messages = []
        while (message := listener.get_message(timeout=0.2)) is not None:
            messages.append(message["data"].decode())
        return messages

    # A hold placed (of the limit or of one key) is announced with its limit's name; one
    # that a longer hold already covers is not (nothing changed)
    clocked.hold(API, None, 2.0)
    clocked.hold(API, "tenant-a", 1.0)
    clocked.hold(API, None, 1.0)
    assert heard() == [f"{HOLD_PLACED} api", f"{HOLD_PLACED} api"]
    # and its lifting is announced as capacity given back (the name alone)
    clocked.unhold(API)
    assert heard() == ["api"]
    listener.close()
