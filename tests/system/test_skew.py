"""Workers whose wall clocks disagree keep the schedule: nothing in a message is a time of a
worker's clock (tests/support/skew.py offsets a worker's wall clock only).

Two real ``celery worker`` processes, one +30 s and one -30 s off, share a limit of 3.96/s
against the mock API (4/s burst 2, judging arrivals on this process's true clock). Every
time is judged on the Redis clock: the slots the limiter granted (lease records), when the
bodies started, and the deadlines the tasks carried.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.support.servers import RedisServer
from tests.support.skew import build_shim, skewed_env
from tests.support.upstream import api_lateness, violations_explained
from workers.harness import ROOT, Api, Worker, running, start_api

pytestmark = pytest.mark.slow

SKEW_S = 30.0
MAX_WAIT_S = 120.0
RATE = 3.96
CONFIG = f"""
settings:
  line_max: 0s  # the backlog is deferred (parked, released on the Redis clock), as tested here
limits:
  upstream: {{algorithm: gcra, rate: {RATE}/s, burst: 1, max_wait: {MAX_WAIT_S:g}s}}
queues:
  upstream: [upstream]
"""
API_RATE, API_BURST = 4.0, 2.0
TASKS = 40


def redis_now(client: redis.Redis) -> float:
    seconds, micros = client.time()
    return seconds + micros / 1e6


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_shim(tmp_path_factory.mktemp("shim"))


def test_the_shim_moves_the_wall_clock_only(shim: Path) -> None:
    # A process 30 s ahead: time.time() and datetime move; sleeps and timed waits do not
    code = (
        "import datetime, json, threading, time\n"
        "m0 = time.monotonic(); wall = time.time(); dt = datetime.datetime.now().timestamp()\n"
        "time.sleep(0.2); m1 = time.monotonic(); threading.Event().wait(0.2)\n"
        "print(json.dumps([wall, dt, m1 - m0, time.monotonic() - m1]))\n"
    )
    before = __import__("time").time()
    out = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **skewed_env(shim, SKEW_S)},
        capture_output=True, text=True, check=True, timeout=30,
    )  # fmt: skip
    after = __import__("time").time()
    wall, dt, slept, waited = json.loads(out.stdout)
    assert before + SKEW_S <= wall <= after + SKEW_S
    assert before + SKEW_S <= dt <= after + SKEW_S
    assert 0.2 <= slept < 5 and 0.2 <= waited < 5  # true waits (a loaded host: slower)


class SkewedFleet:
    def __init__(self, server: RedisServer, api: Api, config: Path, shim: Path, tmp: Path):
        self.server, self.api = server, api
        self.env = {
            "DEMO_BROKER_URL": server.url,
            "MOCK_API_URL": api.url,
            "THROTTLE_CONFIG": str(config),
        }
        self.workers = [
            Worker(name, {**self.env, **skewed_env(shim, offset)}, app="tests.apps.skew_app",
                   queues="upstream", log=tmp / f"{name}.log")
            for name, offset in (("ahead", SKEW_S), ("behind", -SKEW_S))
        ]  # fmt: skip
        self.client = redis.Redis.from_url(server.url)


@pytest.fixture(scope="module")
def fleet(shim: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SkewedFleet]:
    tmp = tmp_path_factory.mktemp("skew")
    config = tmp / "limits.yaml"
    config.write_text(CONFIG)
    with RedisServer() as server:
        api = start_api(API_RATE, API_BURST)
        fleet = SkewedFleet(server, api, config, shim, tmp)
        os.environ.update(fleet.env)
        from tests.apps.skew_app import app  # noqa: PLC0415

        app.conf.broker_url = app.conf.result_backend = server.url
        try:
            with running(app, fleet.workers):
                yield fleet
        finally:
            api.stop()
            fleet.client.close()
            cached = getattr(app, "_throttler", None)
            if cached is not None:
                cached[1].limiter.client.close()
            for name in fleet.env:
                os.environ.pop(name, None)


def test_workers_with_clocks_a_minute_apart_keep_the_schedule(fleet: SkewedFleet) -> None:
    from tests.apps.skew_app import call  # noqa: PLC0415

    # Given a backlog ten seconds deep, enqueued at once from a process with a true clock
    fleet.api.api.reset()
    enqueued = redis_now(fleet.client)
    handles = [call.delay(n) for n in range(TASKS)]
    done = [handle.get(timeout=180) for handle in handles]
    # Then every task ran once, on both workers, and no call was refused
    assert sorted(r["n"] for r in done) == list(range(TASKS))
    assert all(r["runs"] == 1 for r in done)
    assert {r["worker"].split("@")[0] for r in done} == {"ahead", "behind"}
    arrivals = fleet.api.api.arrivals_json()
    assert collections.Counter(a["task_id"] for a in arrivals) == {h.id: 1 for h in handles}
    # No body started before its slot (Redis time; the lease records' slots), and no call
    # was refused but for a call that a stalled host made late (violations_explained)
    assert all(r["started"] >= r["slot"] - 1e-3 for r in done)
    late = api_lateness(fleet.api, arrivals, {r["id"]: r["slot"] for r in done})
    unexplained = violations_explained(arrivals, late, API_RATE, API_BURST)
    assert unexplained == [], (fleet.api.api.stats(), unexplained)
    # The slots are back to back: a task handed from one worker to the other arrives in
    # time for its slot, rather than 60 s late or early (its ETA read on the other clock)
    slots = sorted(r["slot"] for r in done)
    spacing = 1 / RATE
    assert min(b - a for a, b in itertools.pairwise(slots)) >= spacing - 1e-4
    utilization = len(slots) / (1 + RATE * (slots[-1] - slots[0]))
    assert utilization > 0.9, (utilization, slots[-1] - slots[0])
    # The deadline a deferred task carries is on the Redis clock: its first denial plus
    # max_wait, whichever worker's clock wrote it
    finished = redis_now(fleet.client)
    deadlines = [r["deadline"] for r in done if r["deferrals"]]
    assert deadlines, "the backlog was deferred"
    assert all(enqueued + MAX_WAIT_S <= d <= finished + MAX_WAIT_S for d in deadlines)


def test_each_worker_reports_its_clock_and_warns_at_start(fleet: SkewedFleet) -> None:
    env = {**os.environ, **fleet.env, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.apps.skew_app", "throttle", "status",
         "--json", "--timeout", "0"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    clocks = {c["worker"].split("@")[0]: c for c in json.loads(out.stdout)["clocks"]}
    assert set(clocks) == {"ahead", "behind"}
    for name, sign in (("ahead", 1), ("behind", -1)):
        clock = clocks[name]
        assert abs(clock["offset_s"] - sign * SKEW_S) <= clock["error_s"] + 0.01, clock
    for worker in fleet.workers:
        log: Any = worker.log
        text = Path(log).read_text()
        assert "off the Redis clock" in text, text[-2000:]
