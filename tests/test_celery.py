"""@throttled and ThrottledTask with real ``celery worker`` subprocesses, a real Redis broker,
result backend and limiter, and the mock API judging the calls it receives."""

from __future__ import annotations

import collections
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

from throttle import Limit, Limiter
from throttle.keys import KeySpace
from throttle.parking import ParkingLot
from throttle.rates import RateBook
from throttle.testing import RedisServer
from workers.harness import ROOT, Api, Worker, start_api, wait_ready

CONFIG = """
settings:
  refresh: 0.5s
  sleep_max: 0.5s
  park_after: 3s
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
            Worker(f"w{i}", self.env, app="tests.celery_app", queues="celery,upstream,shaped",
                   log=tmp / f"w{i}.log")
            for i in (1, 2)
        ]  # fmt: skip
        self.client = redis.Redis.from_url(server.url)
        self.limiter = Limiter(self.client)
        self.keyspace = KeySpace()

    def runs(self, task_id: str) -> int:
        return int(self.client.get(f"test:runs:{task_id}") or 0)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("fleet")
    config = tmp / "limits.yaml"
    config.write_text(CONFIG)
    with RedisServer() as server:
        api = start_api(API_RATE, API_BURST)
        fleet = Fleet(server, api, config, tmp)
        # The test process is the producer: it imports the same app with the same settings.
        os.environ.update(fleet.env)
        from tests.celery_app import app  # noqa: PLC0415

        app.conf.broker_url = app.conf.result_backend = server.url
        try:
            for worker in fleet.workers:
                worker.start()
            wait_ready(app, fleet.workers)
            yield fleet
        finally:
            for worker in fleet.workers:
                worker.stop()
            api.stop()
            fleet.client.close()
            cached = getattr(app, "_throttler", None)
            if cached is not None:  # the producer side built one (Releaser.publish)
                cached[1].limiter.client.close()
            for name in ("DEMO_BROKER_URL", "MOCK_API_URL", "THROTTLE_CONFIG"):
                os.environ.pop(name, None)


def results(handles: list[Any], timeout: float = 60) -> list[Any]:
    return [handle.get(timeout=timeout) for handle in handles]


def test_a_fleet_calls_the_api_at_the_limit_with_no_violation(fleet: Fleet) -> None:
    # Given two workers of 4 prefork children each and a backlog 10 s deep at 20/s
    from tests.celery_app import call_api  # noqa: PLC0415

    fleet.api.api.reset()
    handles = [call_api.delay(n) for n in range(200)]
    done = results(handles, timeout=120)
    stats = fleet.api.api.stats()
    arrivals = fleet.api.api.arrivals_json()
    # Then every task ran once, under its own id, and the API saw no violation
    assert sorted(r["n"] for r in done) == list(range(200))
    assert [r["id"] for r in done] == [h.id for h in handles]
    assert all(r["runs"] == 1 for r in done)
    assert collections.Counter(a["task_id"] for a in arrivals) == {h.id: 1 for h in handles}
    bad = [i for i, a in enumerate(arrivals) if not a["allowed"]]
    # On failure: the arrivals before each violation, in ms relative to it.
    around = [
        [round(1000 * (arrivals[j]["at_s"] - arrivals[i]["at_s"]), 1) for j in range(i - 3, i)]
        for i in bad
        if i >= 3
    ]
    assert stats["violations"] == 0, (stats, bad, around)
    # at close to the limit (the bound is burst + rate * span of the arrivals)
    span = arrivals[-1]["at_s"] - arrivals[0]["at_s"]
    utilization = len(arrivals) / (1 + 20 * span)
    assert utilization > 0.9, (utilization, span)
    # and rescheduled about once each, not bounced again and again
    deferrals = sum(r["deferrals"] for r in done)
    assert deferrals / len(done) <= 1.1, deferrals
    print(f"\nfleet: 200 calls in {span:.2f} s, utilization {utilization:.3f}, "
          f"{deferrals / 200:.2f} reschedules per task")  # fmt: skip


def test_throttled_tasks_keep_their_id_and_result_and_retry_budget(fleet: Fleet) -> None:
    from tests.celery_app import flaky, slow  # noqa: PLC0415

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
    from tests.celery_app import add, total  # noqa: PLC0415

    assert chain(add.s(1, 2), add.s(3), add.s(4)).delay().get(timeout=60) == 10
    assert chord([add.s(i, i) for i in range(6)])(total.s()).get(timeout=60) == 30


def test_reserved_cost_is_refunded_or_charged(fleet: Fleet) -> None:
    from tests.celery_app import spend  # noqa: PLC0415

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


def test_a_deadline_ends_in_throttle_timeout_or_the_dead_letter_queue(fleet: Fleet) -> None:
    from tests.celery_app import doomed, hurry  # noqa: PLC0415

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


def test_a_task_that_would_expire_before_its_slot_fails_at_once(fleet: Fleet) -> None:
    from tests.celery_app import slow  # noqa: PLC0415

    # 4/s: the 12th slot is ~3 s away, beyond the tasks' expiry 1.5 s from now
    handles = [slow.apply_async((x,), expires=1.5) for x in range(12)]
    outcomes = []
    for handle in handles:
        try:
            handle.get(timeout=30)
            outcomes.append("ran")
        except Exception as exc:
            outcomes.append(type(exc).__name__)
    # Slots 250 ms apart: about 1 + 1.5 * 4 fit before the expiry (whichever tasks the
    # children took first), the rest fail with ThrottleTimeout rather than being revoked
    # later or waiting forever.
    assert 4 <= outcomes.count("ran") <= 8, outcomes
    assert outcomes.count("ThrottleTimeout") == 12 - outcomes.count("ran"), outcomes


def test_queue_limits_apply_to_undecorated_tasks(fleet: Fleet) -> None:
    from tests.celery_app import plain  # noqa: PLC0415

    handles = [plain.apply_async((x,), queue="shaped") for x in range(6)]
    done = results(handles)
    starts = sorted(r["at"] for r in done)
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    # 4/s burst 1: one every 250 ms (less a little scheduling jitter)
    assert min(gaps) > 0.2, gaps
    assert all(r["runs"] == 1 for r in done)


def test_long_waits_are_parked_in_redis_and_released_once(fleet: Fleet) -> None:
    from tests.celery_app import far  # noqa: PLC0415

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
    from tests.celery_app import app, far  # noqa: PLC0415
    from throttle.celery import Releaser  # noqa: PLC0415

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
    from tests.celery_app import block, strict  # noqa: PLC0415

    handles = [strict.delay(x) for x in range(30)]
    time.sleep(0.3)
    blockers = [block.delay(2.0) for _ in range(8)]
    done = results(handles)
    results(blockers)
    # Then the tasks that come due together when the children free up do not run together:
    # a task later than late_tolerance (20 ms) gives its passed slot up and takes a new one.
    # (Without that, the gaps after the blockers were 0.1 ms.)
    starts = sorted(r["at"] for r in done)
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert min(gaps) > 0.1 - 0.02 - 0.005, [round(g, 3) for g in gaps]
    assert all(r["runs"] == 1 for r in done)
    assert sum(r["deferrals"] for r in done) >= 10  # they were rescheduled, some twice


def test_deferred_tasks_come_back_through_the_lane_not_behind_the_backlog(fleet: Fleet) -> None:
    # Given throttled tasks deferred for their slots (2/s), then a flood of 2,000 short
    # tasks on the same queue: about 5 s of work for the 8 children
    from tests.celery_app import block, far  # noqa: PLC0415

    handles = [far.delay(x) for x in range(6)]
    time.sleep(0.2)
    flood = [block.delay(0.02) for _ in range(2000)]
    done = results(handles)
    flood_done = sum(h.ready() for h in flood)
    results(flood, timeout=120)
    # Then the deferred tasks came back through queue "celery.throttled", which the workers
    # serve in turn with "celery", and ran at their slots while the flood was still queued
    assert {r["queue"] for r in done if r["deferrals"]} == {"celery.throttled"}
    starts = sorted(r["at"] for r in done)
    assert starts[-1] - starts[0] < 4.0, starts
    assert flood_done < 1500, flood_done


def test_a_rate_changed_at_run_time_is_followed_by_the_fleet(fleet: Fleet) -> None:
    from tests.celery_app import live  # noqa: PLC0415

    book = RateBook(fleet.client, fleet.keyspace)
    first = results([live.delay(x) for x in range(10)])
    book.set(Limit.parse("10/s burst 1", name="live", algorithm="gcra"), "2/s burst 1")
    try:
        time.sleep(1.0)  # two refresh periods of the workers
        second = results([live.delay(x) for x in range(6)])
    finally:
        book.clear("live")

    def span(rs: list[dict[str, Any]]) -> float:
        starts = sorted(r["at"] for r in rs)
        return starts[-1] - starts[0]

    assert span(first) < 1.5  # 10 at 10/s
    assert span(second) > 2.3  # 6 at 2/s: at least 2.5 s less jitter


def test_a_hold_stops_tasks_already_sleeping_to_their_slots(fleet: Fleet) -> None:
    # Given three tasks at 4/s burst 1: the first runs at once, the others reserve the next
    # slots (0.25 s and 0.5 s later, within sleep_max) and sleep in their pool children
    from tests.celery_app import held_call  # noqa: PLC0415

    handles = [held_call.delay(x) for x in range(3)]
    deadline = time.monotonic() + 20
    leases = [fleet.keyspace.lease_key(h.id) for h in handles]
    while fleet.client.exists(*leases) < 3:
        assert time.monotonic() < deadline, "the tasks never acquired"
        time.sleep(0.005)
    # When the upstream's word holds the limit for 1.5 s while they sleep
    held_at = time.time()
    fleet.limiter.hold("held", None, 1.5)
    done = results(handles)
    # Then no call lands inside the hold: the sleepers looked again before their slots,
    # gave them up and came back after it, once each, under their own ids
    late = sorted(r["at"] for r in done)[1:]
    assert all(at >= held_at + 1.4 for at in late), (held_at, [r["at"] for r in done])
    assert [r["runs"] for r in done] == [1, 1, 1]
    assert [r["id"] for r in done] == [h.id for h in handles]
    assert sum(r["deferrals"] for r in done) >= 2


def test_a_bad_limits_file_stops_the_worker_with_its_place(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("limits:\n  github:\n    rate: 10/fortnight\n")
    with RedisServer() as server:
        env = {"DEMO_BROKER_URL": server.url, "THROTTLE_CONFIG": str(bad)}
        proc = subprocess.run(
            [sys.executable, "-m", "celery", "-A", "tests.celery_app", "worker", "-P", "solo",
             "--without-mingle", "--without-gossip", "-l", "WARNING"],
            cwd=ROOT, env={**os.environ, **env}, capture_output=True, timeout=60, check=False,
        )  # fmt: skip
    output = proc.stdout.decode() + proc.stderr.decode()
    assert proc.returncode != 0
    assert f"{bad}: limit 'github': field 'rate': unknown time unit 'fortnight'" in output
