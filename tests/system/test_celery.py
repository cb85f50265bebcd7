"""@throttled and ThrottledTask with real ``celery worker`` subprocesses, a real Redis broker,
result backend and limiter, and the mock API judging the calls it receives."""

from __future__ import annotations

import collections
import contextlib
import datetime
import itertools
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import chain, chord

from tests.support.servers import RedisServer
from tests.support.upstream import api_lateness, violations_explained
from throttle import Limit, Limiter
from throttle.celery.stock import FRESH_S
from throttle.parking import ParkingLot
from throttle.rates import RateBook
from throttle.redis.keys import KeySpace
from workers.harness import ROOT, Api, Worker, running, start_api

CONFIG = """
settings:
  refresh: 0.5s
  sleep_max: 0.5s
  park_after: 3s
  line_max: 0s  # this module tests rescheduling (re-publish, park, lanes); the line: test_capacity
  park_lead: 1s
limits:
  upstream: {algorithm: gcra, rate: 20/s, burst: 1}
  slow: {algorithm: gcra, rate: 4/s, burst: 1}
  tokens: {rate: 10000/d, key: "{tenant}", cost: estimate, on_error: refund}
  deadline: {algorithm: gcra, rate: 1/h, burst: 1, max_wait: 2s}
  dlq: {algorithm: gcra, rate: 1/h, burst: 1, max_wait: 1s, on_timeout: "dead_letter:dead"}
  shaped: {algorithm: gcra, rate: 4/s, burst: 1}
  parked: {algorithm: gcra, rate: 2/s, burst: 1}
  live: {algorithm: gcra, rate: 10/s, burst: 1}
  strict: {algorithm: gcra, rate: 10/s, burst: 1}
  held: {algorithm: gcra, rate: 4/s, burst: 1}
  fair: {algorithm: gcra, rate: 10/s, burst: 1, key: "{tenant}", fair: true}
queues:
  upstream: [upstream]
  shaped: [shaped]
"""
# The API allows the fleet's rate with one call of headroom (burst 2 against our burst 1):
# a few ms of scheduling jitter between Redis admitting a call and the call reaching the
# API must not count as a violation here (bench/celery_fleet.py measures the strict case).
API_RATE, API_BURST = 20.0, 2.0


class Fleet:
    def __init__(self, server: RedisServer, api: Api, config: Path, tmp: Path) -> None:
        self.server, self.api, self.config = server, api, config
        self.env = {
            "DEMO_BROKER_URL": server.url,
            "MOCK_API_URL": api.url,
            "THROTTLE_CONFIG": str(config),
        }
        self.workers = [
            Worker(f"w{i}", self.env, app="tests.apps.celery_app", queues="celery,upstream,shaped",
                   log=tmp / f"w{i}.log")
            for i in (1, 2)
        ]  # fmt: skip
        self.client = redis.Redis.from_url(server.url)
        self.limiter = Limiter(self.client)
        self.keyspace = KeySpace()

    def runs(self, task_id: str) -> int:
        return int(self.client.get(f"test:runs:{task_id}") or 0)


@contextlib.contextmanager
def started(tmp: Path, config_text: str) -> Iterator[Fleet]:
    config = tmp / "limits.yaml"
    config.write_text(config_text)
    with RedisServer() as server:
        api = start_api(API_RATE, API_BURST)
        fleet = Fleet(server, api, config, tmp)
        # The test process is the producer: it imports the same app with the same settings.
        os.environ.update(fleet.env)
        from tests.apps.celery_app import app  # noqa: PLC0415

        app.conf.broker_url = app.conf.result_backend = server.url
        try:
            with running(app, fleet.workers):
                yield fleet
        finally:
            api.stop()
            fleet.client.close()
            cached = getattr(app, "_throttler", None)
            if cached is not None:  # the producer side built one (Releaser.publish)
                cached[1].limiter.client.close()
            for name in ("DEMO_BROKER_URL", "MOCK_API_URL", "THROTTLE_CONFIG"):
                os.environ.pop(name, None)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """The fleet with the line off: every wait beyond ``sleep_max`` is rescheduled."""
    with started(tmp_path_factory.mktemp("fleet"), CONFIG) as fleet:
        yield fleet


def results(handles: list[Any], timeout: float = 60) -> list[Any]:
    return [handle.get(timeout=timeout) for handle in handles]


def test_a_fleet_calls_the_api_at_the_limit_with_no_violation(fleet: Fleet) -> None:
    # Given two workers of 4 prefork children each and a backlog 10 s deep at 20/s
    from tests.apps.celery_app import call_api  # noqa: PLC0415

    fleet.api.api.reset()
    handles = [call_api.delay(n) for n in range(200)]
    done = results(handles, timeout=120)
    stats = fleet.api.api.stats()
    arrivals = fleet.api.api.arrivals_json()
    # Then every task ran once, under its own id, and called the API once
    assert sorted(r["n"] for r in done) == list(range(200))
    assert [r["id"] for r in done] == [h.id for h in handles]
    assert all(r["runs"] == 1 for r in done)
    assert collections.Counter(a["task_id"] for a in arrivals) == {h.id: 1 for h in handles}
    # on slots the limiter granted 1/20 s apart (GCRA burst 1; Redis time, from the leases)
    slots = sorted(r["slot"] for r in done)
    assert min(b - a for a, b in itertools.pairwise(slots)) >= SPACING_S - SLOT_ROUNDING_S
    # and no call reached the API before its slot, nor was refused unless a call of the
    # API's window reached it more than SPACING_S late (see api_violations_explained)
    slot_of = {r["id"]: r["slot"] for r in done}
    late = api_lateness(fleet.api, arrivals, slot_of)
    assert min(late) >= -CLOCK_S, min(late)
    unexplained = api_violations_explained(arrivals, late)
    assert unexplained == [], (stats, unexplained)
    # at close to the limit: slots back to back (one lost per slot given up by a late task)
    utilization = len(slots) / (1 + 20 * (slots[-1] - slots[0]))
    assert utilization > 0.9, (utilization, slots[-1] - slots[0])
    # and rescheduled about once each, not bounced again and again
    deferrals = sum(r["deferrals"] for r in done)
    assert deferrals / len(done) <= 1.1, deferrals
    print(f"\nfleet: 200 calls, slots over {slots[-1] - slots[0]:.2f} s, utilization "
          f"{utilization:.3f}, {stats['violations']} violations, latest call "
          f"{1000 * max(late):.1f} ms after its slot, {deferrals / 200:.2f} reschedules "
          "per task")  # fmt: skip


SPACING_S = 1 / API_RATE
"""The fleet's limit, 20/s burst 1: its slots are 50 ms apart."""
SLOT_ROUNDING_S = 1e-4
"""A slot as the lease record stores it (a Lua number: 14 significant digits of us)."""
RAN_LATE_S = 0.5
"""The most a body may start after its slot in these tests: the throttle's late_tolerance
(20 ms) at its last check, then however long a loaded 2-core host keeps the pool child from
reaching the body. Faults that run a task on a passed slot are seconds late here."""
CLOCK_S = 0.002
"""A margin for converting between clocks (the Redis clock of the slots is this host's
clock): the API stamps arrivals on its monotonic clock, converted here to epoch s; a pool
child converts a task's expiry to the Redis clock with its measured offset."""


def api_violations_explained(arrivals: list[dict[str, Any]], late: list[float]) -> list[int]:
    """The refused arrivals that calls on time cannot explain, at this fleet's API (see
    :func:`tests.support.upstream.violations_explained`)."""
    return violations_explained(arrivals, late, API_RATE, API_BURST)


def test_a_fair_limit_serves_tenants_that_came_later_beside_the_first(fleet: Fleet) -> None:
    # Given tenant a's 60 tasks queued before b's 20 and c's 20, on a fair 10/s burst-1 limit
    from tests.apps.celery_app import fair_call  # noqa: PLC0415

    handles = [fair_call.delay("a", n) for n in range(60)]
    handles += [fair_call.delay(tenant, n) for tenant in "bc" for n in range(20)]
    done = results(handles, timeout=180)
    slots = {t: sorted(r["slot"] for r in done if r["tenant"] == t) for t in "abc"}
    # Then every task ran once
    assert all(r["runs"] == 1 for r in done)
    assert [len(slots[t]) for t in "abc"] == [60, 20, 20]
    # on slots 1/10 s apart (the total, on Redis time, from the leases)
    every = sorted(s for t in "abc" for s in slots[t])
    assert min(b - a for a, b in itertools.pairwise(every)) >= 0.1 - SLOT_ROUNDING_S
    # and b and c did not wait behind a's backlog, as first come first served would make
    # them (a's 60 slots first, 6 s): they finished before a, sharing the rate with it.
    assert slots["b"][-1] < slots["a"][-1]
    assert slots["c"][-1] < slots["a"][-1]
    # While all three were active, a had no more than about a third of the slots.
    both = max(slots["b"][0], slots["c"][0])
    window = [s for s in every if both <= s <= slots["c"][-1] and s <= slots["b"][-1]]
    mine = [s for s in slots["a"] if s in window]
    assert len(window) >= 10, (both, slots)
    assert len(mine) <= 0.5 * len(window), (len(mine), len(window))


def test_throttled_tasks_keep_their_id_and_result_and_retry_budget(fleet: Fleet) -> None:
    from tests.apps.celery_app import flaky, slow  # noqa: PLC0415

    # max_retries=0 and 4/s: most of these are throttled, none may fail for it
    handles = [slow.delay(x) for x in range(8)]
    done = results(handles)
    assert [r["x"] for r in done] == list(range(8))
    assert [r["id"] for r in done] == [h.id for h in handles]
    assert all(r["retries"] == 0 and r["runs"] == 1 for r in done)
    assert sum(r["deferrals"] for r in done) >= 4  # they were throttled
    assert all(h.state == "SUCCESS" for h in handles)
    # The task's own self.retry still counts and still ends at max_retries
    assert flaky.delay(2).get(timeout=60)["retries"] == 2
    over = flaky.delay(3)
    with pytest.raises(Exception, match=r"Retry in|MaxRetries|retry"):
        over.get(timeout=60)
    assert over.state == "FAILURE"


def test_chains_and_chords_survive_throttling(fleet: Fleet) -> None:
    from tests.apps.celery_app import add, total  # noqa: PLC0415

    assert chain(add.s(1, 2), add.s(3), add.s(4)).delay().get(timeout=60) == 10
    assert chord([add.s(i, i) for i in range(6)])(total.s()).get(timeout=60) == 30


def test_reserved_cost_is_refunded_or_charged(fleet: Fleet) -> None:
    from tests.apps.celery_app import spend  # noqa: PLC0415

    tokens = Limit.parse("10000/d", name="tokens")

    def left(tenant: str) -> float:
        return fleet.limiter.acquire(tokens, tenant, cost=0).remaining

    # Refund: 1000 reserved, 200 used
    spend.delay("refund", 1000, 200).get(timeout=30)
    assert left("refund") == pytest.approx(9800, abs=1)
    # Charge: 1000 reserved, 1500 used
    spend.delay("charge", 1000, 1500).get(timeout=30)
    assert left("charge") == pytest.approx(8500, abs=1)
    # The body raised before the call: on_error: refund gives it all back
    with pytest.raises(ValueError):
        spend.delay("failed", 1000, None, True).get(timeout=30)
    assert left("failed") == pytest.approx(10000, abs=1)
    # Nothing reported: the estimate stays
    spend.delay("kept", 1000, None).get(timeout=30)
    assert left("kept") == pytest.approx(9000, abs=1)


def test_an_admitted_task_settles_only_what_changed(fleet: Fleet) -> None:
    from tests.apps.celery_app import roomy, spend  # noqa: PLC0415

    def alone(task: Any, *args: Any) -> Any:
        """Send a task alone: one sent within FRESH_S of a decision that left room could
        draw from its pool child's stock (throttle/celery/stock.py), and acquire nothing."""
        time.sleep(FRESH_S * 2)
        return task.delay(*args)

    def script_calls(handle: Any) -> int:
        """The FCALL/EVALSHA/EVAL calls naming the task's id (its lease record is among
        their keys), read from the server's slow log, which records every command here."""
        handle.get(timeout=30, propagate=False)
        entries = fleet.client.slowlog_get(1_000_000)
        return sum(
            1
            for entry in entries
            if entry["command"].split(b" ", 1)[0].upper() in (b"FCALL", b"EVALSHA", b"EVAL")
            and handle.id.encode() in entry["command"]
        )

    previous = fleet.client.config_get("slowlog-*")
    fleet.client.config_set("slowlog-max-len", 1_000_000)
    fleet.client.config_set("slowlog-log-slower-than", 0)
    try:
        # The library loaded first (a first call is answered "function not found", the
        # library loaded and the call sent again)
        roomy.delay(0).get(timeout=30)
        spend.delay("warm", 100, 40).get(timeout=30)
        fleet.client.slowlog_reset()
        # A fixed cost, and an estimate not corrected: the acquire alone
        assert script_calls(alone(roomy, 1)) == 1
        assert script_calls(alone(spend, "once", 100, None)) == 1
        # A reported cost, and a body that raised under on_error: refund: one settle more
        assert script_calls(alone(spend, "twice", 100, 40)) == 2
        failed = alone(spend, "refunded", 100, None, True)
        with pytest.raises(ValueError):
            failed.get(timeout=30)
        assert script_calls(failed) == 2
    finally:
        for name, value in previous.items():
            fleet.client.config_set(name, value)
        fleet.client.slowlog_reset()


def test_a_deadline_ends_in_throttle_timeout_or_the_dead_letter_queue(fleet: Fleet) -> None:
    from tests.apps.celery_app import doomed, hurry  # noqa: PLC0415

    assert hurry.delay(1).get(timeout=30) == 1  # takes the one slot of the hour
    late = hurry.delay(2)
    with pytest.raises(Exception, match="throttle deadline") as info:
        late.get(timeout=30)
    assert type(info.value).__name__ == "ThrottleTimeout"
    assert late.state == "FAILURE"
    # on_timeout: dead_letter:dead sends the task, unchanged, to queue "dead"
    assert doomed.delay(1).get(timeout=30) == 1
    sent = doomed.delay(2)
    deadline = time.monotonic() + 30
    while fleet.client.llen("dead") < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert fleet.client.llen("dead") == 1
    assert sent.id.encode() in fleet.client.lindex("dead", 0)


def test_a_task_that_would_expire_before_its_slot_is_revoked_at_once(fleet: Fleet) -> None:
    from tests.apps.celery_app import slow  # noqa: PLC0415

    # 4/s: the 12th slot is ~3 s away, beyond the tasks' expiry 1.5 s from now
    expires_at = time.time() + 1.5
    expiry = datetime.datetime.fromtimestamp(expires_at, tz=datetime.UTC)
    handles = [slow.apply_async((x,), expires=expiry) for x in range(12)]
    outcomes, ran = [], []
    for handle in handles:
        try:
            ran.append(handle.get(timeout=30))
            outcomes.append("ran")
        except Exception as exc:
            outcomes.append(type(exc).__name__)
    # The tasks whose slots (250 ms apart, from the first the fleet took, whenever a busy
    # host let it) fall before the expiry ran; the rest were revoked as expired at once, as
    # Celery does with an expired task (state REVOKED), rather than wait for a slot past
    # their expiry.
    assert outcomes.count("TaskRevokedError") == 12 - len(ran), outcomes
    assert all(h.state == "REVOKED" for h, o in zip(handles, outcomes, strict=True) if o != "ran")
    # No slot after the expiry: the script gets it as a time on its own clock (the call's
    # latency does not move it); CLOCK_S for the pool child's offset to Redis, which this
    # test's host clock stands in for.
    slots = sorted(r["slot"] for r in ran)
    assert slots and slots[-1] <= expires_at + SLOT_ROUNDING_S + CLOCK_S, (slots, expires_at)
    fit = 1 + int((expires_at - slots[0]) / 0.25)
    # All that fit, but one: a task the host made late gives its slot up (late_tolerance)
    assert fit - 1 <= len(ran) <= fit, (fit, slots, expires_at, outcomes)


def test_queue_limits_apply_to_undecorated_tasks(fleet: Fleet) -> None:
    from tests.apps.celery_app import plain  # noqa: PLC0415

    handles = [plain.apply_async((x,), queue="shaped") for x in range(6)]
    done = results(handles)
    # 4/s burst 1: the limiter granted them slots 250 ms apart (Redis time, from the
    # leases), and no body started before its slot (this host's clock is Redis's)
    slots = sorted(r["slot"] for r in done)
    gaps = [b - a for a, b in itertools.pairwise(slots)]
    assert min(gaps) >= 0.25 - SLOT_ROUNDING_S, gaps
    assert all(r["at"] >= r["slot"] - CLOCK_S for r in done), done
    assert all(r["runs"] == 1 for r in done)


def test_long_waits_are_parked_in_redis_and_released_once(fleet: Fleet) -> None:
    from tests.apps.celery_app import far  # noqa: PLC0415

    lot = ParkingLot(fleet.client, fleet.keyspace)
    handles = [far.delay(x) for x in range(14)]  # 2/s: the last slot is ~6.5 s away
    parked_seen = 0
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        parked_seen = max(parked_seen, lot.counts()[0])
        time.sleep(0.05)
    done = results(handles)
    assert parked_seen >= 3  # waits beyond park_after (3 s) went to Redis
    assert all(r["runs"] == 1 for r in done)
    assert [r["x"] for r in done] == list(range(14))
    assert lot.counts() == (0, 0)


def test_parked_tasks_survive_a_releaser_that_dies_and_run_once(fleet: Fleet) -> None:
    # A releaser that claims parked tasks and dies, some after publishing them (two copies
    # will exist), some before: the fleet's releasers take them again when the claims
    # expire, and the worker that starts a copy first is the only one to run it.
    from tests.apps.celery_app import app, far  # noqa: PLC0415
    from throttle.celery.releaser import Releaser  # noqa: PLC0415

    lot = ParkingLot(fleet.client, fleet.keyspace)
    handles = [far.delay(x) for x in range(12)]
    deadline = time.monotonic() + 10
    while lot.counts()[0] < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    grabbed = lot.claim(lead_s=3600, claim_s=1.0)  # the doomed releaser's claims
    assert len(grabbed) >= 4
    Releaser(app).publish(grabbed[: len(grabbed) // 2])  # published, never committed
    done = results(handles)
    assert [r["x"] for r in done] == list(range(12))
    assert all(fleet.runs(h.id) == 1 for h in handles)
    assert lot.counts() == (0, 0)


def test_a_late_batch_does_not_burst_when_the_workers_were_saturated(fleet: Fleet) -> None:
    # Given tasks that reserved slots 100 ms apart and were re-published for them, and then
    # every pool child busy for 2 s, so that many slots pass while nobody can run them
    from tests.apps.celery_app import block, strict  # noqa: PLC0415

    handles = [strict.delay(x) for x in range(30)]
    time.sleep(0.3)
    blockers = [block.delay(2.0) for _ in range(8)]
    done = results(handles)
    results(blockers)
    # Then the tasks that come due together when the children free up do not run together:
    # a task later than late_tolerance (20 ms) gives its passed slot up and takes a new one,
    # so each body runs on a slot of its own (100 ms apart: GCRA), shortly after it. Without
    # that, the tasks whose slots passed during the blockers ran up to 2 s after them (and
    # 0.1 ms apart). "Shortly": late_tolerance plus the time from the last check to the
    # body, which a loaded host stretches; RAN_LATE_S is far from the 2 s of the fault.
    slots = sorted(r["slot"] for r in done)
    assert min(b - a for a, b in itertools.pairwise(slots)) >= 0.1 - SLOT_ROUNDING_S
    late = sorted(r["at"] - r["slot"] for r in done)
    assert late[0] >= -CLOCK_S, late
    assert late[-1] < RAN_LATE_S, [round(x, 3) for x in late]
    assert all(r["runs"] == 1 for r in done)
    assert sum(r["deferrals"] for r in done) >= 10  # they were rescheduled, some twice


def test_deferred_tasks_come_back_through_the_lane_not_behind_the_backlog(fleet: Fleet) -> None:
    # Given throttled tasks deferred for their slots (2/s), then a flood of 2,000 short
    # tasks on the same queue: about 5 s of work for the 8 children
    from tests.apps.celery_app import BLOCKS, block, far  # noqa: PLC0415

    handles = [far.delay(x) for x in range(6)]
    time.sleep(0.2)
    before = int(fleet.client.get(BLOCKS) or 0)
    flood = [block.delay(0.02) for _ in range(2000)]
    done = results(handles)
    results(flood, timeout=120)
    # Then the deferred tasks came back through queue "celery.throttled", which the workers
    # serve in turn with "celery", and ran at their slots while the flood was still queued:
    # fewer than 1,500 of it had started when the last one started (read by its body: the
    # 8 children start at most 8 x 3 s / 20 ms = 1,200 in the 2.5 s of slots plus a late
    # start; behind the backlog it starts after nearly all 2,000)
    assert {r["queue"] for r in done if r["deferrals"]} == {"celery.throttled"}
    late = [r["at"] - r["slot"] for r in done]
    assert min(late) >= -CLOCK_S and max(late) < RAN_LATE_S, late
    started = max(r["blocks"] for r in done) - before
    assert started < 1500, started
    print(f"\nlane: ran {[round(x * 1000) for x in late]} ms after their slots, "
          f"{started} of the flood started by then")  # fmt: skip


def test_a_rate_changed_at_run_time_is_followed_by_the_fleet(fleet: Fleet) -> None:
    from tests.apps.celery_app import live  # noqa: PLC0415

    book = RateBook(fleet.client, fleet.keyspace)
    first = results([live.delay(x) for x in range(10)])
    book.set(Limit.parse("10/s burst 1", name="live", algorithm="gcra"), "2/s burst 1")
    try:
        time.sleep(1.0)  # two refresh periods of the workers
        second = results([live.delay(x) for x in range(6)])
    finally:
        book.clear("live")

    def gaps(rs: list[dict[str, Any]]) -> list[float]:
        """The spacing of the slots the limiter granted (Redis time, from the leases)."""
        slots = sorted(r["slot"] for r in rs)
        return [b - a for a, b in itertools.pairwise(slots)]

    # 10 at 10/s: 0.1 s apart, 0.9 s in all (unless a late task gave a slot up: not 4.5 s)
    assert min(gaps(first)) >= 0.1 - SLOT_ROUNDING_S and sum(gaps(first)) < 1.5, gaps(first)
    assert min(gaps(second)) >= 0.5 - SLOT_ROUNDING_S, gaps(second)  # 6 at 2/s


def test_a_hold_stops_tasks_already_sleeping_to_their_slots(fleet: Fleet) -> None:
    # Given three tasks at 4/s burst 1: the first runs at once, the others reserve the next
    # slots (0.25 s and 0.5 s later, within sleep_max) and sleep in their pool children
    from tests.apps.celery_app import held_call  # noqa: PLC0415
    from throttle.celery.gate import RECHECK_LEAD_S  # noqa: PLC0415

    def redis_now_s() -> float:
        seconds, micros = fleet.client.time()
        return float(seconds + micros / 1e6)

    for _ in range(3):  # until the hold comes while a task sleeps (a busy host may be late)
        handles = [held_call.delay(x) for x in range(3)]
        deadline = time.monotonic() + 20
        leases = [fleet.keyspace.lease_key(h.id) for h in handles]
        while fleet.client.exists(*leases) < 3:
            assert time.monotonic() < deadline, "the tasks never acquired"
            time.sleep(0.005)
        slots = [float(fleet.client.hget(lease, "at") or 0) / 1e6 for lease in leases]
        # When the upstream's word holds the limit for 1.5 s while they sleep
        placed_from = redis_now_s()
        fleet.limiter.hold("held", None, 1.5)
        placed_by = redis_now_s()
        done = results(handles)
        # (asleep: the tasks that had yet to look again, RECHECK_LEAD_S before their slots,
        # when the hold was in place; Redis time, as the slots)
        asleep = [
            r for r, slot in zip(done, slots, strict=True) if slot - RECHECK_LEAD_S > placed_by
        ]
        assert [r["runs"] for r in done] == [1, 1, 1]
        assert [r["id"] for r in done] == [h.id for h in handles]
        if asleep:
            break
    assert asleep, "the hold never came before a sleeper's slot (the host was too slow)"
    # Then no call lands inside the hold: the sleepers looked again before their slots,
    # gave them up and came back after it, once each, under their own ids
    assert all(r["at"] >= placed_from + 1.5 - CLOCK_S for r in asleep), (placed_from, done)
    assert sum(r["deferrals"] for r in asleep) >= len(asleep)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("{rate: 10/fortnight}", "field 'rate': unknown time unit 'fortnight'"),
        ("{rate: 10/s, fair: true}", "field 'fair': a fair limit shares its rate among"),
        (
            "{rate: 10/s, key: '{t}', fair: true, weights: {free: 0}}",
            "field 'weights.free': must be a finite number > 0 (got 0)",
        ),
    ],
    ids=["rate", "fair-without-key", "weight"],
)
def test_a_bad_limits_file_stops_the_worker_with_its_place(
    tmp_path: Path, entry: str, message: str
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"limits:\n  github: {entry}\n")
    with RedisServer() as server:
        env = {"DEMO_BROKER_URL": server.url, "THROTTLE_CONFIG": str(bad)}
        proc = subprocess.run(
            [sys.executable, "-m", "celery", "-A", "tests.apps.celery_app", "worker", "-P", "solo",
             "--without-mingle", "--without-gossip", "-l", "WARNING"],
            cwd=ROOT, env={**os.environ, **env}, capture_output=True, timeout=60, check=False,
        )  # fmt: skip
    output = proc.stdout.decode() + proc.stderr.decode()
    assert proc.returncode != 0
    assert f"{bad}: limit 'github': {message}" in output
