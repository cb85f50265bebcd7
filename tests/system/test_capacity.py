"""Capacity goes to the tasks that wait in the worker's consumer as it appears
(:mod:`throttle.celery.capacity`): a refund settled by another task, a rate raised at run
time, in priority order; with real ``celery worker`` subprocesses on a private
redis-server (broker, results, limiter); app: tests/apps/capacity_app.py.

Judged on the Redis clock (each body logs ``TIME``; a task's slot is its lease record's
``at``), never on host speed. Without the announcements of :mod:`throttle.celery.capacity`
the waiting task of each test would start tens of seconds later: at the time its limit's
own refill named.
"""

from __future__ import annotations

import itertools
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery.bin.base import CLIContext
from click.testing import CliRunner

from tests.support.servers import RedisServer
from tests.support.waits import wait_for as _wait_for
from throttle.adaptive import Adaptive, LearnedRates
from throttle.cli import throttle
from throttle.rates import RateBook
from throttle.redis.keys import KeySpace
from throttle.spec import Limit
from workers.harness import Worker, running

REFUND_BOUND_S = 0.25
"""The most a refund may take to reach a task waiting for it, in s: from the end of the
body that reports the lower cost (its settle follows) to the waiting task's slot. What
it takes: the settle's round trip, the announcement's, a wake-up of the consumer's loop
and one acquisition (a few ms on an idle host); the bound leaves room for a loaded one."""
RATE_BOUND_S = 1.0
"""The most a rate raised at run time may take to reach a task waiting for it, in s."""
# late_tolerance: a pool child that starts a task more than this after its slot gives the
# slot up and sends the task back through the broker; on a loaded host (the first task of
# a prefork child loads the throttler) 20 ms is often passed, which is not what these
# tests are about.
CONFIG = """
settings:
  sleep_max: 1s
  late_tolerance: 500ms
  refresh: 500ms
limits:
  tokens: {algorithm: token_bucket, rate: 6/m, burst: 10, cost: cost}
  rated: {algorithm: token_bucket, rate: 2/m, burst: 1}
  learner: {algorithm: token_bucket, rate: 60/m, burst: 1, adaptive: true}
  ordered: {algorithm: gcra, rate: 12/m, burst: 1}
  units: {rate: 2 concurrent}
  paced: {algorithm: gcra, rate: 5/s, burst: 1}
  shared: {rate: 2/s, burst: 1, key: "{tenant}", fair: true}
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisServer, Path]]:
    tmp = tmp_path_factory.mktemp("capacity")
    (tmp / "limits.yaml").write_text(CONFIG)
    with RedisServer() as server:
        yield server, tmp


def worker(server: RedisServer, tmp: Path, name: str, pool: str, concurrency: int = 1) -> Worker:
    env = {"CAPACITY_BROKER_URL": server.url, "THROTTLE_CONFIG": str(tmp / "limits.yaml")}
    return Worker(
        name, env, concurrency=concurrency, queues="capacity", app="tests.apps.capacity_app",
        log=tmp / f"{name}.log", pool=pool,
    )  # fmt: skip


def waiting_in_lines(app: Any) -> dict[str, str]:
    """Task id -> where it waits, of every worker's ``inspect throttle_waiting``."""
    replies = app.control.inspect(timeout=1)._request("throttle_waiting") or {}
    return {e["request"]["id"]: e["where"] for entries in replies.values() for e in entries}


def events(client: redis.Redis) -> list[tuple[str, str, float]]:
    """(tag, event, Redis time) of every body's start and end, in order."""
    entries = [entry.decode().split() for entry in client.lrange("capacity:log", 0, -1)]
    return [(tag, event, float(at)) for tag, event, at in entries]


def most_at_once(seen: list[tuple[str, str, float]]) -> int:
    """The most bodies that ran at once, from their starts and ends in order."""
    running_now, most = 0, 0
    for _, event, _ in seen:
        running_now += 1 if event == "start" else -1
        most = max(most, running_now)
    return most


def at(client: redis.Redis, tag: str, event: str) -> float:
    return next(t for name, what, t in events(client) if (name, what) == (tag, event))


def slot_of(client: redis.Redis, task_id: str) -> float:
    """The slot of a task's acquisition (Redis time, s)."""
    slot_us = client.hget(KeySpace().lease_key(task_id), "at")
    assert slot_us is not None
    return float(slot_us) / 1e6


def wait_for(what: Any, timeout_s: float) -> Any:
    return _wait_for(what, timeout_s, 0.02)


def fresh(server: tuple[RedisServer, Path]) -> tuple[Any, redis.Redis]:
    from tests.apps.capacity_app import app  # noqa: PLC0415

    redis_server, _ = server
    client = redis_server.client()
    client.flushall()
    # A restart's fence long over: a limit the fence would start empty starts full
    # (lua/prelude.lua), so that the first task takes the whole bucket at once.
    client.set(KeySpace().fence_key(), 0)
    app.conf.broker_url = app.conf.result_backend = redis_server.url
    return app, client


# Every pool is covered by test_waiting.py (and the full matrix is bench.pools): here two.
@pytest.mark.parametrize("pool", ["prefork", "gevent"])
def test_a_refund_reaches_a_waiting_task_within_a_round_trip_of_the_settle(
    server: tuple[RedisServer, Path], pool: str
) -> None:
    from tests.apps.capacity_app import spend  # noqa: PLC0415

    app, client = fresh(server)
    redis_server, tmp = server
    with running(app, [worker(redis_server, tmp, f"w-refund-{pool}", pool, 2)]):
        # Given a task that reserved the whole bucket (10 tokens, refilled at 0.1/s)
        first = spend.delay("t1", 10, 1, 1.0)
        wait_for(lambda: any(tag == "t1" for tag, _, _ in events(client)), 30)
        # and a second one that needs 5: its limit says 50 s, so it waits, reserving nothing
        second = spend.delay("t2", 5, 5, 0.0)
        first.get(timeout=30)
        # When the first reports 1 token used (9 refunded when it settles)
        second.get(timeout=30)
        # Then the second's slot came within a round trip or so of the settle (the settle
        # follows the end of the first's body), not 50 s later
        took = slot_of(client, second.id) - at(client, "t1", "end")
        print(f"refund reached the waiting task after {took * 1000:.1f} ms ({pool})")
        assert 0 <= took <= REFUND_BOUND_S
        assert at(client, "t2", "start") >= at(client, "t1", "end")
    assert client.hgetall("capacity:done") == {b"t1": b"1", b"t2": b"1"}


@pytest.mark.parametrize("pool", ["threads"])
def test_a_rate_raised_at_run_time_reaches_a_waiting_task(
    server: tuple[RedisServer, Path], pool: str
) -> None:
    from tests.apps.capacity_app import rated  # noqa: PLC0415

    app, client = fresh(server)
    redis_server, tmp = server
    with running(app, [worker(redis_server, tmp, f"w-rate-{pool}", pool)]):
        # Given a limit of 2/m, burst 1: after one task the next waits 30 s
        rated.delay("r1").get(timeout=30)
        second = rated.delay("r2")
        time.sleep(0.5)
        assert client.hget("capacity:done", "r2") is None
        # (it waits in the worker's line, reserving nothing: `inspect throttle_waiting`
        # lists it, `inspect scheduled`, for tasks held to a near slot, does not; a slow
        # host may take a while to receive and decide it)
        wait_for(lambda: waiting_in_lines(app) == {second.id: "line"}, 10)
        assert not any((app.control.inspect(timeout=1).scheduled() or {}).values())
        # and `celery throttle task ID` finds it there (Redis alone does not know it)
        obj = CLIContext(app=app, no_color=True, workdir=None, quiet=False)
        said = CliRunner().invoke(throttle, ["task", second.id], obj=obj)
        assert said.exit_code == 0, said.output
        assert "waiting in worker w-rate-threads@" in said.output, said.output
        assert "for its limits to admit it, reserving nothing" in said.output, said.output
        # with its queue and the limits it waits for (the worker's word)
        assert "queue capacity" in said.output and "limits rated" in said.output, said.output
        # When an operator raises the rate (celery throttle set rated 100/s)
        seconds, micros = client.time()
        raised_at = seconds + micros / 1e6
        RateBook(client, KeySpace()).set(Limit.parse("2/m burst 1", name="rated"), "100/s")
        second.get(timeout=30)
        # Then the waiting task runs at once, not at its old slot
        took = at(client, "r2", "start") - raised_at
        print(f"raised rate reached the waiting task after {took * 1000:.1f} ms ({pool})")
        assert 0 <= took <= RATE_BOUND_S
    assert client.hgetall("capacity:done") == {b"r1": b"1", b"r2": b"1"}


LEARNED_BOUND_S = 2.0
"""The most a learned rate that rose may take to reach a task waiting for it, in s: the
line reads it again every ``refresh`` (0.5 s here), twice at worst (the consumer's cache
of learned rates is as old), then one acquisition; at the old rate the task waited 10 s."""


def test_an_adaptive_limit_probing_up_reaches_a_waiting_task(
    server: tuple[RedisServer, Path],
) -> None:
    from tests.apps.capacity_app import learner  # noqa: PLC0415

    app, client = fresh(server)
    redis_server, tmp = server
    limit = Limit.parse("60/m burst 1", name="learner")
    rates = LearnedRates(client, KeySpace())
    with running(app, [worker(redis_server, tmp, "w-learner", "prefork")]):
        # Given an adaptive limit that learned 6/m (its floor, a tenth of 60/m): after
        # one task the next waits 10 s, in the line
        rates.stated(limit, None, Adaptive(), 0.1)
        learner.delay("l1").get(timeout=30)
        second = learner.delay("l2")
        wait_for(lambda: waiting_in_lines(app) == {second.id: "line"}, 10)
        # When its learned rate climbs back to 60/m (what probing up does, as the
        # upstream answers without refusing; nobody announces it)
        seconds, micros = client.time()
        risen_at = seconds + micros / 1e6
        rates.stated(limit, None, Adaptive(), 1.0)
        second.get(timeout=30)
        # Then the waiting task runs within a refresh or two, not 10 s after the first
        took = at(client, "l2", "start") - risen_at
        print(f"a learned rate that rose reached the waiting task after {took:.2f} s")
        assert 0 <= took <= LEARNED_BOUND_S
    assert client.hgetall("capacity:done") == {b"l1": b"1", b"l2": b"1"}


def test_waiting_tasks_take_capacity_by_priority_then_arrival(
    server: tuple[RedisServer, Path],
) -> None:
    from tests.apps.capacity_app import ordered  # noqa: PLC0415

    app, client = fresh(server)
    redis_server, tmp = server
    with running(app, [worker(redis_server, tmp, "w-order", "prefork")]):
        # Given one task running under a limit of one call per 5 s (the next waits 4 s in
        # the line before it asks again: time for all four to arrive, on a loaded host)
        first = ordered.delay("o0")
        first.get(timeout=30)
        # When four more arrive at once, two of priority 0 then two of priority 9
        handles = [
            ordered.apply_async(("a1",), priority=0),
            ordered.apply_async(("a2",), priority=0),
        ]
        handles += [
            ordered.apply_async(("b1",), priority=9),
            ordered.apply_async(("b2",), priority=9),
        ]
        for handle in handles:
            handle.get(timeout=90)
    # Then the higher priority goes first, each priority in arrival order, once each
    starts = [tag for tag, event, _ in events(client) if event == "start"]
    assert starts == ["o0", "b1", "b2", "a1", "a2"], starts
    # on slots one spacing apart (Redis time; a body may start late on a loaded host)
    slots = sorted(slot_of(client, h.id) for h in [first, *handles])
    assert all(b - a >= 5.0 - 0.001 for a, b in itertools.pairwise(slots)), slots
    assert all(int(n) == 1 for n in client.hvals("capacity:done"))


def test_a_released_concurrency_unit_goes_to_a_task_waiting_in_the_line(
    server: tuple[RedisServer, Path],
) -> None:
    from tests.apps.capacity_app import held  # noqa: PLC0415

    app, client = fresh(server)
    redis_server, tmp = server
    # Given a limit of 2 concurrent with no task time limit (a unit's lease: 360 s) and 8
    # tasks of 0.3 s on a worker of 4 pool slots
    with running(app, [worker(redis_server, tmp, "w-units", "prefork", concurrency=4)]):
        handles = [held.delay(f"u{i}", 0.3) for i in range(8)]
        # Then every task runs as a unit comes back (4 rounds of 0.3 s), the others
        # waiting in the worker's line for it, not sent back for the lease's 360 s
        for handle in handles:
            handle.get(timeout=60)
    seen = events(client)
    starts = [t for _, event, t in seen if event == "start"]
    assert max(starts) - min(starts) <= 10.0, seen
    # and never more than 2 at once
    assert most_at_once(seen) <= 2, seen
    assert client.hgetall("capacity:done") == {f"u{i}".encode(): b"1" for i in range(8)}
    # and each of the six tasks that waited in the line for a unit logs its wait, counted
    # from when the limit first held it back (the last two waited for two tasks of 0.3 s
    # before theirs; the worker's clock), not from the unit's grant (~0)
    text = (tmp / "w-units.log").read_text()
    waits = [float(w) for w in re.findall(r"waits ([\d.]+) s for its slot \(limits units\)", text)]
    assert len(waits) >= 6, text
    assert max(waits) >= 0.5, waits


def test_a_task_denied_by_a_rate_and_a_concurrency_limit_at_once_waits_for_the_unit(
    server: tuple[RedisServer, Path],
) -> None:
    from tests.apps.capacity_app import paced_units  # noqa: PLC0415

    app, client = fresh(server)
    redis_server, tmp = server
    # Given a limit of 5/s (burst 1) and one of 2 concurrent (a unit's lease: 360 s) on one
    # task, and 6 tasks of 0.3 s on a worker of 4 pool slots: the later ones are denied by
    # both limits at once
    with running(app, [worker(redis_server, tmp, "w-paced", "prefork", concurrency=4)]):
        handles = [paced_units.delay(f"p{i}", 0.3) for i in range(6)]
        # Then each runs as a unit comes back (3 rounds of 0.3 s), not sent back for the
        # 360 s the concurrency limit's lease names
        for handle in handles:
            handle.get(timeout=60)
    seen = events(client)
    starts = sorted(t for _, event, t in seen if event == "start")
    assert starts[-1] - starts[0] <= 10.0, seen
    # and at most 2 at once (the 5/s spacing is the slots', which a body's start may
    # reach up to late_tolerance late: the limits' own tests judge it)
    assert most_at_once(seen) <= 2, seen
    assert client.hgetall("capacity:done") == {f"p{i}".encode(): b"1" for i in range(6)}


def test_a_fair_limit_reaches_its_rate_for_two_tenants_waiting_in_one_workers_line(
    server: tuple[RedisServer, Path],
) -> None:
    from tests.apps.capacity_app import shared_fairly  # noqa: PLC0415

    app, client = fresh(server)
    redis_server, tmp = server
    # Given a fair limit of 2/s (burst 1) shared by two tenants whose 12 tasks, sent
    # alternately, all wait in one worker's line
    with running(app, [worker(redis_server, tmp, "w-fair", "threads", concurrency=4)]):
        handles = [shared_fairly.delay("ab"[i % 2], f"f{i}") for i in range(12)]
        for handle in handles:
            handle.get(timeout=60)
    # Then the two together run at the limit's rate (11 intervals of 0.5 s after the
    # first, on the Redis clock), each tenant at about half of it: a look of the line at
    # a fair limit is not made before the time its denial named, which would be denied
    # again and push the tenant's turn a share interval further (half the rate: 10-11 s).
    # The bound leaves a loaded host a turn or two missed.
    starts = sorted(t for _, event, t in events(client) if event == "start")
    assert len(starts) == 12 and starts[-1] - starts[0] <= 11 * 0.5 * 1.5, starts
    for tenant in "ab":
        own = sorted(t for tag, event, t in events(client) if event == "start" and tag == tenant)
        assert len(own) == 6 and own[-1] - own[0] <= 5 * 1.0 * 1.5, own
