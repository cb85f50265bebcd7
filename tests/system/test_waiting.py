"""Throttled tasks wait in the worker's consumer, not in a pool slot
(:mod:`throttle.celery.waiting`), with real ``celery worker`` subprocesses of one pool
child (``-c 1``) on a private redis-server (broker, results, limiter); app:
tests/apps/waiting_app.py.

Judged on the Redis clock and on the order of the bodies, never on host speed: with one
pool slot, an unthrottled task sent after a throttled one that waits for its slot runs
before it only if that wait is not spent in the pool slot.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.support.clock import redis_now_s
from tests.support.publishes import broker_lpushes
from tests.support.servers import RedisServer
from tests.support.waits import wait_for
from throttle.celery.waiting import LEAD_S
from throttle.limiter import Limiter
from throttle.rates import RateBook
from throttle.redis.keys import KeySpace
from throttle.spec import Limit
from workers.harness import ROOT, Worker, running

SPACING_S = 1.0
SLOW_SPACING_S = 2.5
TIMER_SLACK_S = 0.005
"""How much earlier than asked a timer may fire (kombu's hub rounds its poll timeout)."""
VISIBILITY_S = 8.0
# A task is held at most park_after + park_lead + sleep_max = 3.6 s: within half the
# visibility timeout, as the worker requires. reserve_ahead as long: these tests hold a
# task in the consumer's timer for its slot, seconds ahead (by default a slot more than
# 250 ms ahead is waited for in the line, reserving nothing: test_capacity.py).
STOCKED_LIMITS = """
  roomy: {algorithm: gcra, rate: 10000/d, burst: 10000}
  budget: {algorithm: gcra, rate: 100000/d, burst: 100000, key: "{tenant}", cost: tokens}
"""
"""The limits of ``stocked``, in every limits file of this module: a worker with the
throttler's worker step (``release=True``) refuses to start while a task of the app names
a limit its file does not define."""
# late_tolerance 1 s: these tests count script calls and read slots, which a host too
# loaded to start a task within the default 20 ms of its slot would change (the task gives
# its slot up and takes another: two more calls); lateness has its own tests.
CONFIG = (
    """
settings:
  sleep_max: 3s
  reserve_ahead: 3s
  park_after: 0.5s
  park_lead: 0.1s
  late_tolerance: 1s
limits:
  spaced: {algorithm: gcra, rate: 1/s, burst: 1}
  slow: {algorithm: gcra, rate: 24/m, burst: 1}
  bulk: {rate: 1000/s, burst: 10}"""
    + STOCKED_LIMITS
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisServer, Path]]:
    tmp = tmp_path_factory.mktemp("waiting")
    config = tmp / "limits.yaml"
    config.write_text(CONFIG)
    with RedisServer() as server:
        env = {
            "WAITING_BROKER_URL": server.url,
            "THROTTLE_CONFIG": str(config),
            "WAITING_VISIBILITY_S": str(VISIBILITY_S),
        }
        os.environ.update(env)  # the test process is the producer: the same app
        try:
            yield server, tmp
        finally:
            for name in env:
                os.environ.pop(name, None)


def worker(
    server: RedisServer,
    tmp: Path,
    name: str,
    pool: str,
    *,
    config: str = "limits.yaml",
    visibility_s: float = VISIBILITY_S,
    concurrency: int = 1,
    release: bool = False,
) -> Worker:
    env = {
        "WAITING_BROKER_URL": server.url,
        "THROTTLE_CONFIG": str(tmp / config),
        "WAITING_VISIBILITY_S": str(visibility_s),
    }
    if release:  # the releaser of parked tasks, as install(app) runs it
        env["WAITING_RELEASE"] = "1"
    return Worker(
        name, env, concurrency=concurrency, queues="waiting", app="tests.apps.waiting_app",
        log=tmp / f"{name}.log", pool=pool,
    )  # fmt: skip


def fresh(
    server: RedisServer, tmp: Path | None = None, name: str = "", config: str = ""
) -> redis.Redis:
    """The module's Redis emptied, and the producer's app pointed at it: a client of it.
    With ``tmp``, the limits file ``name`` written there first (``config``, a test's
    own, for its workers)."""
    from tests.apps.waiting_app import app  # noqa: PLC0415

    if tmp is not None:
        (tmp / name).write_text(config)
    client = server.client()
    client.flushall()
    app.conf.broker_url = app.conf.result_backend = server.url
    return client


def log(client: redis.Redis) -> list[tuple[str, float]]:
    """(tag, Redis time of the body's start) of every body, in order."""
    entries = [entry.decode().split() for entry in client.lrange("waiting:log", 0, -1)]
    return [(tag, float(at)) for tag, at, *_ in entries]


def slept(client: redis.Redis) -> dict[str, float]:
    """How long each logged throttled body's pool child slept to its slot (s)."""
    entries = [entry.decode().split() for entry in client.lrange("waiting:log", 0, -1)]
    return {tag: float(rest[0]) for tag, _, *rest in entries if rest}


def fcalls(client: redis.Redis) -> int:
    """The limiter's script calls so far (acquire, settle, space: one FCALL each)."""
    stats = client.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in ("fcall",))


@contextlib.contextmanager
def script_calls(server: RedisServer) -> Iterator[list[str]]:
    """The script calls ``server`` ran within the block (each one's Redis time, function
    and first keys, as MONITOR shows them), in order: a count that is off says which calls
    were extra."""
    calls: list[str] = []
    ready, done = threading.Event(), threading.Event()

    def watch() -> None:
        with server.client().monitor() as monitor:
            ready.set()
            for command in monitor.listen():
                if done.is_set():
                    return
                if command["command"][:5].upper() == "FCALL":
                    words = command["command"].split()
                    calls.append(f"{command['time']:.3f} {words[1]} {' '.join(words[3:5])}")

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    ready.wait(10)  # MONITOR has begun (redis-py read its OK)
    try:
        yield calls
    finally:
        done.set()
        server.client().execute_command("ECHO", "monitor-done")  # wakes the watcher
        watcher.join(10)


@pytest.mark.parametrize("pool", ["prefork", "threads", "gevent", "eventlet", "solo"])
def test_a_task_waiting_for_its_slot_leaves_the_pool_slot_free(
    server: tuple[RedisServer, Path], pool: str
) -> None:
    from tests.apps.waiting_app import app, bulk, plain, spaced  # noqa: PLC0415

    redis_server, tmp = server
    client = fresh(redis_server)
    with running(app, [worker(redis_server, tmp, f"w-{pool}", pool)]):
        # Given one pool slot, and two tasks under a limit of one call per second: the
        # second waits about a second for its slot
        first = spaced.delay("t1")
        first.get(timeout=30)
        second = spaced.delay("t2")
        # When an unthrottled task is sent after them, on the same queue
        plain.delay("p").get(timeout=30)
        second.get(timeout=30)
        # Then it ran while the second waited: the wait did not hold the pool slot
        order = log(client)
        tags = [tag for tag, _ in order]
        assert tags == ["t1", "p", "t2"], order
        at = dict(order)
        assert at["t2"] - at["t1"] >= SPACING_S - 0.05  # the limit kept (Redis time)
        assert at["p"] < at["t2"]
        # and the pool child slept at most LEAD_S to the slot (plus the timer's slack:
        # the consumer hands the task over no earlier than LEAD_S before its slot)
        assert slept(client)["t2"] <= LEAD_S + TIMER_SLACK_S

        # And the pool child takes no second round trip for what the consumer decided:
        # tasks admitted at once cost one acquisition each, nothing more (``bulk`` never
        # has room for 20 more tasks, so the consumer decides every one of them)
        with script_calls(redis_server) as calls:
            for handle in [bulk.delay(f"b{i}") for i in range(20)]:
                handle.get(timeout=30)
        assert len(calls) == 20, "\n".join(calls)
    assert all(int(n) == 1 for n in client.hvals("waiting:done"))


def flood_config(spaced: str = "") -> str:
    """The default settings, and ``spaced`` at 2/s (with ``spaced``'s own fields)."""
    return f"""
limits:
  spaced: {{algorithm: gcra, rate: 2/s, burst: 1{spaced}}}
  slow: {{algorithm: gcra, rate: 24/m, burst: 1}}
  bulk: {{rate: 1000/s, burst: 10}}{STOCKED_LIMITS}"""


FLOOD_CONFIG = flood_config()


def test_a_flood_longer_than_the_line_s_budget_goes_back_through_the_broker_once(
    server: tuple[RedisServer, Path],
) -> None:
    from tests.apps.waiting_app import app, spaced_late  # noqa: PLC0415

    redis_server, tmp = server
    client = fresh(redis_server, tmp, "flood.yaml", FLOOD_CONFIG)
    # Given the default settings, a visibility timeout of 10 s (the line's budget: half of
    # it, less sleep_max and park_lead, 3.5 s), two pool slots, Celery's prefetch of 4 a
    # slot, and a flood of 30 tasks of a 2/s limit acknowledged when they return: most wait
    # in the line longer than its budget
    flood = worker(redis_server, tmp, "w-flood", "prefork", config="flood.yaml",
                   visibility_s=10.0, concurrency=2, release=True)  # fmt: skip
    with running(app, [flood]):
        published = broker_lpushes(client)
        handles = [spaced_late.delay(f"f{i}") for i in range(30)]
        for handle in handles:
            handle.get(timeout=90)
        published = broker_lpushes(client) - published
    # Then those went back through the broker and every task ran once: none was held in
    # the worker past the visibility timeout (the broker would deliver it again, to run
    # twice)
    done = {tag.decode(): int(n) for tag, n in client.hgetall("waiting:done").items()}
    assert done == {f"f{i}": 1 for i in range(30)}
    # each sent back for about when its turn comes, one spacing (0.5 s) after the one sent
    # on before it, not all for the limit's next slot (under 1 s), to leave again and
    # again: the countdowns (computed, not timed) reach several seconds, and the
    # publishes stay near one more per task (2.3 a task before; a slow host may send a
    # few back once more for a slot it reached late)
    countdowns = [
        float(found) for found in re.findall(
            r"deferred ([\d.]+) s by spaced \([^)]*, deferral 1\)",
            (tmp / "w-flood.log").read_text(),
        )
    ]  # fmt: skip
    assert len(countdowns) >= 5 and max(countdowns) >= 2.0, countdowns
    assert published <= 3 * 30, published
    # and no pool child slept for a slot: a task sent on from the line without having
    # asked goes with a denial, not to be decided in the pool and sleep there up to
    # sleep_max while the others wait for a free pool slot
    assert max(slept(client).values()) <= LEAD_S + 0.2, slept(client)


SHADOW_SWITCH_CONFIG = """
settings: {refresh: 0.5s}
limits:
  spaced: {algorithm: gcra, rate: 2/s, burst: 1}
"""


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the Redis backend's setex
def test_a_limit_switched_to_shadow_lets_the_tasks_waiting_in_the_line_run_at_once(
    server: tuple[RedisServer, Path],
) -> None:
    from tests.apps.waiting_app import app, spaced_late  # noqa: PLC0415

    redis_server, tmp = server
    client = fresh(redis_server, tmp, "switch.yaml", SHADOW_SWITCH_CONFIG)
    # Given a flood of 20 tasks of a 2/s limit (10 s of work), waiting in the line (a
    # visibility timeout of 60 s: the line keeps waits far longer than this flood's)
    line = worker(redis_server, tmp, "w-switch", "prefork", config="switch.yaml",
                  visibility_s=60.0)  # fmt: skip
    with running(app, [line]):
        handles = [spaced_late.delay(f"s{i}") for i in range(20)]
        wait_for(lambda: len(log(client)) >= 3, timeout_s=30)
        # When an operator switches the limit to shadow mode (celery throttle shadow)
        RateBook(client, KeySpace()).set_mode("spaced", "shadow")
        switched_at = redis_now_s(client)
        for handle in handles:
            handle.get(timeout=60)
    # Then the tasks waiting in the line run at once, each once, not at the limit's 2/s
    # (at which the 17 or fewer left would take 8 s and more): within the line's next
    # look (announced at once, the modes read afresh) and the pool's run of a no-op task
    done = {tag.decode(): int(n) for tag, n in client.hgetall("waiting:done").items()}
    assert done == {f"s{i}": 1 for i in range(20)}
    last = max(at for _, at in log(client))
    assert last - switched_at < 5.0, (last - switched_at, log(client))


PAUSE_CONFIG = """
limits:
  spaced: {algorithm: gcra, rate: 5/s, burst: 1}
"""


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the Redis backend's setex
def test_a_pause_keeps_the_waiting_tasks_in_the_workers_and_a_resume_runs_them(
    server: tuple[RedisServer, Path],
) -> None:
    from tests.apps.waiting_app import app, spaced_late  # noqa: PLC0415

    redis_server, tmp = server
    client = fresh(redis_server, tmp, "pause.yaml", PAUSE_CONFIG)
    limiter = Limiter(client)
    # Given a flood of 20 tasks with an expiry far off (a deadline), at 5/s: most wait
    # in the line, one is held in the consumer for its near slot
    line = worker(redis_server, tmp, "w-pause", "prefork", config="pause.yaml",
                  visibility_s=60.0)  # fmt: skip
    with running(app, [line]):
        handles = [spaced_late.apply_async((f"p{i}",), expires=600) for i in range(20)]
        wait_for(lambda: len(log(client)) >= 3, timeout_s=30)
        # When an operator pauses the limit for 2 s, then resumes it
        limiter.hold("spaced")
        time.sleep(2.0)
        limiter.unhold("spaced")
        resumed_at = redis_now_s(client)
        for handle in handles:
            handle.get(timeout=90)
    # Then every task ran once, the last within the backlog's own time after the resume
    # (17 or fewer left at 5/s: 3.4 s, with ample room for a slow host): none was sent back for
    # pause_recheck (30 s and more) because it had a deadline, or because the pause
    # caught it held for its slot
    done = {tag.decode(): int(n) for tag, n in client.hgetall("waiting:done").items()}
    assert done == {f"p{i}": 1 for i in range(20)}
    last = max(at for _, at in log(client))
    assert last - resumed_at < 15.0, (last - resumed_at, log(client))


SHORT_LINE_CONFIG = f"""
settings: {{line_max: 2s}}
limits:
  spaced: {{algorithm: gcra, rate: 5/s, burst: 1}}
  slow: {{algorithm: gcra, rate: 24/m, burst: 1}}
  bulk: {{rate: 1000/s, burst: 10}}{STOCKED_LIMITS}"""


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the Redis backend's setex
def test_a_pause_that_sent_tasks_on_from_the_line_leaves_no_pause_behind(
    server: tuple[RedisServer, Path],
) -> None:
    from tests.apps.waiting_app import app, spaced  # noqa: PLC0415

    redis_server, tmp = server
    client = fresh(redis_server, tmp, "short.yaml", SHORT_LINE_CONFIG)
    limiter = Limiter(client)
    # Given a line that holds a task 2 s at most, with parking, and a limit paused for
    # longer than that while 10 tasks wait: they leave the line for the pause's recheck
    # (parked)
    line = worker(redis_server, tmp, "w-short", "prefork", config="short.yaml", release=True)
    with running(app, [line]):
        for i in range(10):
            spaced.delay(f"a{i}")
        wait_for(lambda: len(log(client)) >= 1, timeout_s=30)
        limiter.hold("spaced")
        time.sleep(4.0)  # twice the line's 2 s
        assert "(parked in Redis" in (tmp / "w-short.log").read_text()
        # (the tasks parked for the recheck come back 30 s or more later: after the test)
        limiter.unhold("spaced")
        # When a flood of 20 comes after the resume (4 s of work at 5/s: the later ones
        # wait in the line longer than it holds them, and are sent on for their turn)
        sent_at = redis_now_s(client)
        second = [spaced.delay(f"b{i}") for i in range(20)]
        for handle in second:
            handle.get(timeout=90)
    # Then each comes back for its turn, not for the pause's recheck (30 s and more): the
    # pause left nothing behind in the line
    last = max(at for tag, at in log(client) if tag.startswith("b"))
    assert last - sent_at < 15.0, (last - sent_at, log(client))
    done = {tag.decode(): int(n) for tag, n in client.hgetall("waiting:done").items()}
    assert {tag: n for tag, n in done.items() if tag.startswith("b")} == {
        f"b{i}": 1 for i in range(20)
    }


SLOW_SHORT_LINE_CONFIG = SHORT_LINE_CONFIG.replace("rate: 5/s", "rate: 2/s")


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the Redis backend's setex
def test_a_rate_raised_at_run_time_brings_the_tasks_parked_for_the_old_one(
    server: tuple[RedisServer, Path],
) -> None:
    from tests.apps.waiting_app import app, spaced  # noqa: PLC0415

    redis_server, tmp = server
    client = fresh(redis_server, tmp, "slowshort.yaml", SLOW_SHORT_LINE_CONFIG)
    # Given a line that holds a task 2 s at most, with parking, and 20 tasks at 2/s: those
    # that would wait longer are sent on, parked for their turn at 2/s (up to 10 s out)
    line = worker(redis_server, tmp, "w-raise", "prefork", config="slowshort.yaml",
                  release=True)  # fmt: skip
    with running(app, [line]):
        handles = [spaced.delay(f"r{i}") for i in range(20)]
        wait_for(lambda: "(parked in Redis" in (tmp / "w-raise.log").read_text(), timeout_s=30)
        # When the operator raises the rate to 50/s
        env = {**os.environ, "THROTTLE_CONFIG": str(tmp / "slowshort.yaml")}
        raised_at = redis_now_s(client)
        done = subprocess.run(
            [sys.executable, "-m", "celery", "-A", "tests.apps.waiting_app", "throttle",
             "set", "spaced", "50/s"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert "parked for the old rate come back now" in done.stdout, done.stdout
        for handle in handles:
            handle.get(timeout=60)
    # Then the parked ones come back now and run at the new rate: the last within a few
    # seconds of the change, not at the old pace (about 8 s more)
    last = max(at for _, at in log(client))
    assert last - raised_at < 4.0, (last - raised_at, log(client))


MAX_WAIT_CONFIG = flood_config(", max_wait: 2s")


def test_max_wait_counts_for_a_task_in_the_line_from_its_first_look(
    server: tuple[RedisServer, Path],
) -> None:
    from tests.apps.waiting_app import app, spaced  # noqa: PLC0415

    redis_server, tmp = server
    client = fresh(redis_server, tmp, "maxwait.yaml", MAX_WAIT_CONFIG)
    # Given the default settings (the line's budget, 3.5 s here, longer than max_wait) and
    # a flood of 12 tasks of a 2/s limit with max_wait 2 s: 6 s of work
    line = worker(redis_server, tmp, "w-maxwait", "prefork", config="maxwait.yaml")
    with running(app, [line]):
        seconds, micros = client.time()
        sent_at = seconds + micros / 1e6
        handles = [spaced.delay(f"m{i}") for i in range(12)]
        for handle in handles:
            handle.get(timeout=60, propagate=False)
    # Then the tasks whose slot came within max_wait ran, the others failed with
    # ThrottleTimeout (on_timeout: fail), though they waited in the line: a look at the
    # limits does not restart the task's max_wait
    states = [handle.state for handle in handles]
    ran = [at for tag, at in log(client)]
    # (about 5 slots come within 2 s; each task's max_wait counts from when the worker
    # first looked at it, which a slow host spreads a little: 10 of 12 ran before)
    assert 3 <= states.count("SUCCESS") <= 8, states
    assert states.count("SUCCESS") + states.count("FAILURE") == 12, states
    assert all(
        type(handle.result).__name__ == "ThrottleTimeout"
        for handle in handles
        if handle.state == "FAILURE"
    ), [handle.result for handle in handles]
    # and none ran past it: 2 s after the send on the Redis clock, with room for the
    # worker's first look and the pool's start on a slow host (without the deadline held,
    # the tenth started 4.5 s after the send)
    assert len(ran) == states.count("SUCCESS") and max(ran) - sent_at <= 2.0 + 1.5, ran


def test_a_task_deep_in_the_line_expires_at_its_expires_not_at_its_turn(
    server: tuple[RedisServer, Path],
) -> None:
    from tests.apps.waiting_app import app, spaced  # noqa: PLC0415

    redis_server, tmp = server
    client = fresh(redis_server, tmp, "flood.yaml", FLOOD_CONFIG)
    # Given 24 tasks of a 2/s limit waiting in the line (12 s of work; a visibility
    # timeout of 30 s: the line's budget, 14 s, keeps them all), and behind them one that
    # expires 1 s after it is sent
    line = worker(redis_server, tmp, "w-expires", "prefork", config="flood.yaml",
                  visibility_s=30.0)  # fmt: skip
    with running(app, [line]):
        for i in range(24):
            spaced.delay(f"e{i}")
        wait_for(lambda: len(log(client)) >= 1, 10)
        late = spaced.apply_async(("late",), expires=1.0)
        seconds, micros = client.time()
        sent_at = seconds + micros / 1e6
        # Then it is revoked as expired when it expires (on the Redis clock, with room
        # for a slow host), though its turn is about 12 s away, and it never runs
        late.get(timeout=30, propagate=False)
        seconds, micros = client.time()
        assert late.state == "REVOKED", late.state
        assert seconds + micros / 1e6 - sent_at <= 1.0 + 3.0
    assert "late" not in {tag for tag, _ in log(client)}


def test_a_task_is_decided_when_a_pool_slot_is_free(server: tuple[RedisServer, Path]) -> None:
    from tests.apps.waiting_app import app, bulk, busy  # noqa: PLC0415

    redis_server, tmp = server
    client = fresh(redis_server)
    with running(app, [worker(redis_server, tmp, "w-busy", "prefork")]):
        # Given the only pool slot busy for a second
        before = fcalls(client)
        busy.delay("busy", 1.0)
        # When a throttled task arrives meanwhile
        handle = bulk.delay("b")
        handle.get(timeout=30)
        # Then it was decided when the pool could start it, not when it arrived: no script
        # call while the pool slot was busy (decided then, its slot would have passed while
        # it waited for the pool), and its slot is after the busy task's end (Redis time)
        assert int(client.get("waiting:fcalls:busy") or -1) == before
        assert fcalls(client) - before >= 1
        slot_us = client.hget(KeySpace().lease_key(handle.id), "at")
        assert slot_us is not None
        assert float(slot_us) / 1e6 >= dict(log(client))["busy"] - 0.01


STALL_S = 0.9
"""A gap between two no-op bodies this long is a stalled consumer: kombu's Redis transport
without an event loop (gevent, eventlet) waits out its poll's timeout (1-2 s) when the
poll began with the prefetch count reached."""


@pytest.mark.parametrize("pool", ["gevent", "eventlet"])
def test_a_green_worker_whose_pool_is_busy_keeps_receiving_the_tasks_it_decides(
    server: tuple[RedisServer, Path], pool: str
) -> None:
    from tests.apps.waiting_app import app, bulk  # noqa: PLC0415

    redis_server, tmp = server
    client = fresh(redis_server)
    # Given a green worker of one pool slot (prefetch count 4) and 60 tasks of `bulk`,
    # which never wait but which the consumer decides (its limit never has room for 20)
    with running(app, [worker(redis_server, tmp, f"w-green-{pool}", pool)]):
        handles = [bulk.delay(f"g{i}") for i in range(60)]
        for handle in handles:
            handle.get(timeout=120)
    # Then the consumer never stalls between them: the tasks it received while the pool
    # slot was busy filled the prefetch count, and each poll that began so waited out its
    # timeout (about 15 gaps of 1-2 s, 16-22 s in all, where 60 no-op tasks take 0.3 s)
    starts = sorted(at for _, at in log(client))
    stalls = [round(b - a, 2) for a, b in itertools.pairwise(starts) if b - a >= STALL_S]
    assert len(stalls) <= 1, stalls
    # and every task ran once
    assert client.hgetall("waiting:done") == {f"g{i}".encode(): b"1" for i in range(60)}


def test_a_task_the_consumer_does_not_hold_comes_back_for_its_slot_at_most_twice(
    server: tuple[RedisServer, Path],
) -> None:
    from tests.apps.waiting_app import app, spaced_limited  # noqa: PLC0415

    redis_server, tmp = server
    client = fresh(redis_server)
    with running(app, [worker(redis_server, tmp, "w-limited", "prefork", concurrency=2)]):
        # Given tasks under Celery's own rate_limit too, which the consumer hands to the
        # pool undecided, without acks_late (a pool child sleeps at most 50 ms to a slot)
        # When four of them come at once for a limit of one a second
        handles = [spaced_limited.delay(f"l{i}") for i in range(4)]
        for handle in handles:
            handle.get(timeout=30)
    # Then each ran once, and came back for its slot at most twice: once as far ahead as
    # the limit said, then, arrived early by the arrival's lead, once more to arrive
    # within the sleep its pool child may take (it was sent back again and again, 100 ms
    # early, then a few ms less each time: up to 14 re-publishes for one slot)
    done = {k.decode(): int(v) for k, v in client.hgetall("waiting:done").items()}
    assert done == {f"l{i}": 1 for i in range(4)}
    deferrals = {k.decode(): int(v) for k, v in client.hgetall("waiting:deferrals").items()}
    assert max(deferrals.values()) <= 2, deferrals


def test_a_pool_child_does_not_spend_a_tasks_time_limit_waiting_for_its_slot(
    server: tuple[RedisServer, Path],
) -> None:
    from tests.apps.waiting_app import app, spaced_limited_late  # noqa: PLC0415

    redis_server, tmp = server
    client = fresh(redis_server)
    with running(app, [worker(redis_server, tmp, "w-time-limit", "prefork", concurrency=2)]):
        # Given tasks that the pool decides (under Celery's own rate_limit too), with
        # acks_late (a pool child may sleep up to sleep_max, 3 s here, to a slot)
        spaced_limited_late.delay("t0").get(timeout=30)
        # When tasks come whose slots are up to 2 s ahead, with time limits of 0.5 s
        # (soft) and 0.8 s (hard), enough for their bodies
        soft = [spaced_limited_late.apply_async((f"s{i}",), soft_time_limit=0.5) for i in (1, 2)]
        hard = spaced_limited_late.apply_async(("h",), time_limit=0.8)
        # Then each runs, once: its pool child did not sleep past its time limit to its slot
        # (SoftTimeLimitExceeded, TimeLimitExceeded before the body began), but sent it
        # back to arrive shortly before the slot
        for handle in [*soft, hard]:
            handle.get(timeout=30)
    done = {k.decode(): int(v) for k, v in client.hgetall("waiting:done").items()}
    assert done == {"t0": 1, "s1": 1, "s2": 1, "h": 1}


def bodies_at_once(client: redis.Redis, bodies: int) -> tuple[int, list[tuple[float, float]]]:
    """The most bodies that ran side by side, of the ``bodies`` spans the tasks recorded
    (start and end on the Redis clock), and those spans."""
    spans = [entry.decode().split() for entry in client.lrange("waiting:spans", 0, -1)]
    assert len(spans) == bodies
    times = [(float(start), float(end)) for _, start, end in spans]
    return max(sum(1 for s, e in times if s <= start < e) for start, _ in times), times


def test_an_autoscaled_worker_grows_its_pool_for_throttled_tasks(
    server: tuple[RedisServer, Path],
) -> None:
    from tests.apps.waiting_app import app, bulk_busy  # noqa: PLC0415

    redis_server, tmp = server
    client = fresh(redis_server)
    scaled = worker(redis_server, tmp, "w-autoscale", "prefork")
    scaled.extra = ["--autoscale", "4,1"]
    with running(app, [scaled]):
        # Given a worker started with --autoscale 4,1 (one process at first)
        # When four throttled tasks that hold their pool slot 3 s each arrive at once,
        # decided in the consumer (``bulk`` never has room for 20 more)
        handles = [bulk_busy.delay(f"t{n}", 3.0) for n in range(4)]
        for handle in handles:
            handle.get(timeout=60)
    # Then the pool grew as it does for plain tasks: bodies ran side by side. (The
    # consumer handed a task on only while fewer were reserved than the pool's current
    # processes, so Celery's autoscaler, which grows the pool when more are reserved than
    # that, never saw a reason to: one body at a time, 12 s.)
    at_once, times = bodies_at_once(client, 4)
    assert at_once >= 2, f"at most {at_once} body at a time under --autoscale 4,1: {times}"


def test_an_autoscaled_worker_grows_its_pool_as_waiting_tasks_reach_it(
    server: tuple[RedisServer, Path],
) -> None:
    from tests.apps.waiting_app import app, spaced_busy  # noqa: PLC0415

    redis_server, tmp = server
    client = fresh(redis_server)
    scaled = worker(redis_server, tmp, "w-autoscale-spaced", "prefork")
    scaled.extra = ["--autoscale", "4,1"]
    with running(app, [scaled]):
        # Given a worker started with --autoscale 4,1, and four tasks under a 1/s limit
        # that hold their pool slot 3 s each, all received at once: they reach the pool a
        # second apart, from the consumer's timer, long after their messages came
        handles = [spaced_busy.delay(f"s{n}", 3.0) for n in range(4)]
        for handle in handles:
            handle.get(timeout=60)
    # Then the pool grew as they reached it: bodies ran side by side. (The event loop's
    # autoscaler looks when a message arrives, and every 30 s: one body at a time.)
    at_once, times = bodies_at_once(client, 4)
    assert at_once >= 2, f"at most {at_once} body at a time under --autoscale 4,1: {times}"


def held_ids(app: Any) -> set[str]:
    """The ids of the tasks the workers hold in their consumer's timer."""
    replies = app.control.inspect(timeout=0.5).scheduled() or {}
    return {entry["request"]["id"] for entries in replies.values() for entry in entries}


def held_slow(app: Any, slow: Any, first: str, second: str) -> Any:
    """Run ``slow`` tagged ``first``, then send it tagged ``second``: a task held in the
    consumer for its slot (:data:`SLOW_SPACING_S` after the first's); its handle, once the
    worker lists it as scheduled."""
    slow.delay(first).get(timeout=30)
    held = slow.delay(second)
    assert held.id in wait_for(lambda: held_ids(app), SLOW_SPACING_S)
    return held


def test_a_held_task_revoked_never_runs_and_gives_its_slot_up(
    server: tuple[RedisServer, Path],
) -> None:
    from tests.apps.waiting_app import app, slow  # noqa: PLC0415

    redis_server, tmp = server
    client = fresh(redis_server)
    with running(app, [worker(redis_server, tmp, "w-revoke", "prefork")]):
        # Given a task held in the consumer for its slot
        held = held_slow(app, slow, "r1", "r2")
        # When it is revoked, as one revokes a task with an ETA
        app.control.revoke(held.id)
        # Then, when its timer fires at its slot, it is not handed to the pool: its
        # reservation is given up (settled: its lease record says so)
        lease = KeySpace().lease_key(held.id)
        wait_for(lambda: client.hget(lease, "s") == b"2", 2 * SLOW_SPACING_S)
        # and it never runs: REVOKED (as Celery marks it when revoked), its message
        # acknowledged
        time.sleep(0.5)
        assert held.state == "REVOKED"
        assert client.hget("waiting:done", "r2") is None
        # (the acknowledgement leaves the consumer's loop shortly after: a loaded host
        # takes a while)
        wait_for(lambda: client.hlen("unacked") == 0, 10)


def test_a_hold_placed_while_a_task_is_held_for_its_slot_keeps_it_from_calling(
    server: tuple[RedisServer, Path],
) -> None:
    from tests.apps.waiting_app import app, slow  # noqa: PLC0415

    redis_server, tmp = server
    client = fresh(redis_server)
    with running(app, [worker(redis_server, tmp, "w-hold", "prefork")]):
        # Given a task held in the consumer for its slot (2.5 s after the one before),
        # with time left before it (Redis time; on a slow host, the next one)
        tag, held = "h2", held_slow(app, slow, "h1", "h2")
        for later in ("h3", "h4"):
            slot_us = client.hget(KeySpace().lease_key(held.id), "at")
            if slot_us is not None and float(slot_us) / 1e6 - redis_now_s(client) > 0.3:
                break
            held.get(timeout=30)
            tag, held = later, slow.delay(later)
            assert held.id in wait_for(lambda: held_ids(app), SLOW_SPACING_S)
        # When the upstream's word holds its limit for 4 s, past that slot
        placed = redis_now_s(client)
        Limiter(client).hold("slow", None, 4.0)
        held.get(timeout=30)
    # Then it did not call inside the hold: the worker had heard of the hold when it
    # handed the task to the pool, whose child looked again and sent it back for after
    assert dict(log(client))[tag] >= placed + 4.0 - 0.01
    assert int(client.hget("waiting:done", tag) or 0) == 1


def test_a_worker_killed_while_it_holds_a_task_loses_none_and_runs_none_twice(
    server: tuple[RedisServer, Path],
) -> None:
    from tests.apps.waiting_app import app, slow  # noqa: PLC0415

    redis_server, tmp = server
    client = fresh(redis_server)
    first = worker(redis_server, tmp, "w-killed", "prefork")
    with running(app, [first], kill=True):
        # Given a worker that holds a task in its consumer, waiting for its slot
        held = held_slow(app, slow, "k1", "k2")
        # When the worker is killed (SIGKILL) before the slot
        first.kill()
    assert client.hget("waiting:done", "k2") is None
    # Then its message comes back (unacknowledged: after the visibility timeout) and
    # another worker runs it, once
    with running(app, [worker(redis_server, tmp, "w-next", "prefork")]):
        held.get(timeout=VISIBILITY_S + 30)
    assert client.hgetall("waiting:done") == {b"k1": b"1", b"k2": b"1"}


STOCK_CONFIG = (
    """
settings:
  burst_margin: 1h  # an hour of these slow refills in hand: stocks fit in it
limits:"""
    + STOCKED_LIMITS
)


def test_roomy_tasks_draw_from_stocks_on_gevent_and_take_exactly_what_they_used(
    server: tuple[RedisServer, Path],
) -> None:
    """Stocks (throttle/celery/stock.py) under gevent, whose closing thread is a greenlet:
    most tasks take no round trip, each runs once, and once the worker stopped (its open
    stocks given back) the limits are charged what the tasks used, less what they refilled
    meanwhile on the Redis clock, not what the stocks took."""
    from tests.apps.waiting_app import app, stocked  # noqa: PLC0415

    redis_server, tmp = server
    client = fresh(redis_server, tmp, "stock.yaml", STOCK_CONFIG)
    tasks = 300
    with running(app, [worker(redis_server, tmp, "w-stock", "gevent", config="stock.yaml",
                              concurrency=20)]):  # fmt: skip
        started = redis_now_s(client)
        before = fcalls(client)
        handles = [stocked.delay(f"s{i}", "acme", 100, 4) for i in range(tasks)]
        for handle in handles:
            handle.get(timeout=60)
        calls = fcalls(client) - before
    limiter = Limiter.from_url(redis_server.url)
    roomy = limiter.peek(Limit.parse("10000/d burst 10000", name="roomy", algorithm="gcra"))
    budget = limiter.peek(
        Limit.parse("100000/d burst 100000", name="budget", algorithm="gcra"), "acme"
    )
    elapsed = redis_now_s(client) - started
    assert [int(n) for n in client.hvals("waiting:done")] == [1] * tasks
    # Without stocks, an acquire and a settle a task (600); 130 on a quiet host, more on a
    # loaded one, whose consumer decides more of the tasks itself
    assert calls < tasks * 1.5, calls
    refilled = elapsed / 86400  # tokens a second: 10,000 and 100,000 a day
    assert tasks - 10000 * refilled - 0.5 <= 10000 - roomy.remaining <= tasks + 0.5
    # 4 a task (what each reported), not 100 (what it reserved)
    assert tasks * 4 - 100000 * refilled - 1 <= 100000 - budget.remaining <= tasks * 4 + 1
