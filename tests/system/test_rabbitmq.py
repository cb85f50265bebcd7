"""The throttler on RabbitMQ: real ``celery worker`` subprocesses against the RabbitMQ
service (127.0.0.1:5672, guest/guest) in a private vhost created and deleted here, a
private redis-server (results, limiter, ledger) and the mock API.

Timing is judged on Redis time (the slots the limiter granted, read from the leases) with
the bounds of tests/system/test_celery.py; RabbitMQ unreachable is a failure, not a skip.
"""

from __future__ import annotations

import collections
import itertools
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from kombu import Connection, Exchange, Queue

from tests.support.servers import RedisServer
from tests.support.upstream import api_lateness, violations_explained
from workers.harness import Api, Worker, start_api, wait_ready

pytestmark = pytest.mark.slow

AMQP = "amqp://guest:guest@127.0.0.1:5672"
CONFIG = """
settings:
  refresh: 0.5s
  sleep_max: 0.5s
  park_after: 3s
  line_max: 0s  # waits beyond sleep_max are rescheduled (re-published, parked), as tested here
  park_lead: 1s
limits:
  upstream: {algorithm: gcra, rate: 20/s, burst: 1}
  slow: {algorithm: gcra, rate: 4/s, burst: 1}
  parked: {algorithm: gcra, rate: 1/s, burst: 1}
  github: {algorithm: gcra, rate: 4/s, burst: 1}
  quorum: {algorithm: gcra, rate: 4/s, burst: 1}
  prelane: {algorithm: gcra, rate: 4/s, burst: 1}
  kill: {algorithm: gcra, rate: 10/s, burst: 1}
  tokens: {rate: 10000/d, key: "{tenant}", cost: estimate}  # workers.demo_app's (shared) task
queues:
  upstream: [upstream]
  github: [github]
  quorum: [quorum]
  prelane: [prelane]
  kill: [kill]
"""
API_RATE, API_BURST = 20.0, 2.0
SLOT_ROUNDING_S = 1e-4
RAN_LATE_S = 0.5
"""The most a body may start after its slot (see tests/system/test_celery.py)."""
CLOCK_S = 0.002
REDELIVERED_S = 5.0
"""How soon RabbitMQ must give a killed worker's unacked messages back: when the
connection drops (no visibility timeout), plus a loaded host's delay in noticing."""


def rabbitmqctl(*args: str) -> str:
    if shutil.which("rabbitmqctl") is None:
        pytest.fail("rabbitmqctl is not installed: these tests need the RabbitMQ service")
    done = subprocess.run(
        ["rabbitmqctl", *args], capture_output=True, text=True, timeout=120, check=False
    )
    if done.returncode != 0:
        pytest.fail(
            f"rabbitmqctl {' '.join(args)} failed ({done.returncode}): is RabbitMQ running at "
            f"127.0.0.1:5672? {done.stderr.strip() or done.stdout.strip()}"
        )
    return done.stdout


@pytest.fixture(scope="module")
def vhost() -> Iterator[str]:
    """A private vhost for this run (guest may do anything there), deleted at the end."""
    name = f"throttle-test-{uuid.uuid4().hex[:10]}"
    rabbitmqctl("add_vhost", name)
    try:
        rabbitmqctl("set_permissions", "-p", name, "guest", ".*", ".*", ".*")
        url = f"{AMQP}/{name}"
        try:
            with Connection(url, connect_timeout=5) as conn:
                conn.ensure_connection(max_retries=2)
        except Exception as exc:  # any failure to connect says the same
            pytest.fail(f"RabbitMQ is not reachable at {url}: {exc!r}")
        yield name
    finally:
        rabbitmqctl("delete_vhost", name)


def queue_types(vhost: str) -> dict[str, str]:
    out = rabbitmqctl("list_queues", "-p", vhost, "-q", "--no-table-headers", "name", "type")
    return dict(line.split("\t")[:2] for line in out.splitlines() if "\t" in line)


class Fleet:
    def __init__(self, vhost: str, server: RedisServer, api: Api, config: Path, tmp: Path):
        self.vhost, self.server, self.api, self.tmp = vhost, server, api, tmp
        self.broker = f"{AMQP}/{vhost}"
        self.env = {
            "RABBIT_BROKER_URL": self.broker,
            "RABBIT_REDIS_URL": server.url,
            "MOCK_API_URL": api.url,
            "THROTTLE_CONFIG": str(config),
        }
        counting = {**self.env, "RABBIT_COUNT_PUBLISHES": "1"}
        classic = {**counting, "RABBIT_QUORUM": "0"}
        self.workers = [
            Worker(f"w{i}", classic, app="tests.apps.rabbit_app", queues="celery,upstream,github",
                   log=tmp / f"w{i}.log")
            for i in (1, 2)
        ]  # fmt: skip
        # Celery turns global QoS off in a worker that knows a quorum queue: a worker of its own.
        self.workers.append(
            Worker("q1", {**counting, "RABBIT_QUORUM": "1"}, app="tests.apps.rabbit_app",
                   queues="quorum,prelane", concurrency=4, log=tmp / "q1.log")
        )  # fmt: skip
        self.client = redis.Redis.from_url(server.url)

    def runs(self, task_id: str) -> int:
        return int(self.client.get(f"test:runs:{task_id}") or 0)


@pytest.fixture(scope="module")
def fleet(vhost: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("rabbit")
    config = tmp / "limits.yaml"
    config.write_text(CONFIG)
    with RedisServer() as server:
        api = start_api(API_RATE, API_BURST)
        fleet = Fleet(vhost, server, api, config, tmp)
        # The test process is the producer: it knows every queue (the quorum ones too).
        os.environ.update({**fleet.env, "RABBIT_QUORUM": "1"})
        from tests.apps.rabbit_app import app  # noqa: PLC0415

        app.conf.broker_url = fleet.broker
        app.conf.result_backend = app.conf.throttle_redis_url = server.url
        # An operator pre-declared the quorum queue's lane as a quorum queue: the lane the
        # workers declare must agree with it (else PRECONDITION_FAILED closes the channel).
        with Connection(fleet.broker) as conn:
            lane = Queue("prelane.throttled", Exchange("prelane.throttled"),
                         routing_key="prelane.throttled",
                         queue_arguments={"x-queue-type": "quorum"})  # fmt: skip
            lane(conn.default_channel).declare()
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
            if cached is not None:
                cached[1].limiter.client.close()
            for name in (*fleet.env, "RABBIT_QUORUM"):
                os.environ.pop(name, None)


def results(handles: list[Any], timeout: float = 60) -> list[Any]:
    return [handle.get(timeout=timeout) for handle in handles]


def spaced(done: list[dict[str, Any]], rate: float) -> float:
    """The smallest gap between the slots granted (Redis time), which must be 1/rate."""
    slots = sorted(r["slot"] for r in done)
    gap = min(b - a for a, b in itertools.pairwise(slots))
    assert gap >= 1 / rate - SLOT_ROUNDING_S, slots
    return gap


def on_time(done: list[dict[str, Any]]) -> None:
    late = [r["at"] - r["slot"] for r in done]
    assert min(late) >= -CLOCK_S and max(late) < RAN_LATE_S, late


def test_a_fleet_on_rabbitmq_calls_the_api_at_the_limit_with_no_violation(fleet: Fleet) -> None:
    # Given two workers of 4 prefork children each and a backlog 10 s deep at 20/s
    from tests.apps.rabbit_app import call_api  # noqa: PLC0415

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
    assert {r["queue"] for r in done} <= {"upstream", "upstream.throttled"}
    # on slots 1/20 s apart, none reaching the API before its slot, and no refusal that
    # calls on time cannot explain (tests/support/upstream.py: violations_explained)
    spaced(done, API_RATE)
    slot_of = {r["id"]: r["slot"] for r in done}
    late = api_lateness(fleet.api, arrivals, slot_of)
    assert min(late) >= -CLOCK_S, min(late)
    assert violations_explained(arrivals, late, API_RATE, API_BURST) == [], stats
    slots = sorted(slot_of.values())
    utilization = len(slots) / (1 + API_RATE * (slots[-1] - slots[0]))
    # Close to the limit: gaps between slots come from a consumer that cannot fill its line
    # in time, which a loaded host makes (0.88 measured with three other jobs on the CI
    # machine's 2 cores; bench/ measures the precision itself).
    assert utilization > 0.8, utilization
    deferrals = sum(r["deferrals"] for r in done)
    assert deferrals / len(done) <= 1.1, deferrals
    print(f"\nrabbitmq fleet: 200 calls over {slots[-1] - slots[0]:.2f} s, utilization "
          f"{utilization:.3f}, {stats['violations']} refusals, {deferrals} deferrals")  # fmt: skip


def test_deferred_tasks_are_republished_to_the_lane_and_keep_their_id(fleet: Fleet) -> None:
    # Given 8 tasks at 4/s with max_retries=0: waits up to 1.75 s, below park_after (3 s)
    from tests.apps.rabbit_app import slow  # noqa: PLC0415

    handles = [slow.delay(x) for x in range(8)]
    done = results(handles)
    # Then each ran once under its id, without spending retries, on its slot
    assert [r["id"] for r in done] == [h.id for h in handles]
    assert all(r["runs"] == 1 and r["retries"] == 0 for r in done)
    assert sum(r["deferrals"] for r in done) >= 5
    assert not any(r["parked"] for r in done)
    # the deferred ones through the default queue's lane
    assert {r["queue"] for r in done if r["deferrals"]} == {"celery.throttled"}
    spaced(done, 4)
    on_time(done)


def test_long_waits_are_parked_and_come_back_through_the_lane(fleet: Fleet) -> None:
    # Given 7 tasks at 1/s: the last 3 wait more than park_after (3 s)
    from tests.apps.rabbit_app import far  # noqa: PLC0415

    handles = [far.delay(x) for x in range(7)]
    done = results(handles)
    assert all(r["runs"] == 1 for r in done)
    parked = [r for r in done if r["parked"]]
    assert len(parked) >= 2, done
    assert {r["queue"] for r in parked} == {"celery.throttled"}
    spaced(done, 1)
    on_time(done)


def test_topic_routing_applies_the_queue_limits_and_deferred_tasks_come_back(
    fleet: Fleet,
) -> None:
    # Given Celery's topic-routing example: queue "github" bound to exchange "tasks" with
    # "github.#", tasks sent with routing key "github.fetch" (no queue of that name)
    from tests.apps.rabbit_app import plain  # noqa: PLC0415

    handles = [
        plain.apply_async((x,), exchange="tasks", routing_key="github.fetch") for x in range(8)
    ]
    done = results(handles)
    # Then the worker knew they came from "github": its limit (4/s) applied
    assert all(r["runs"] == 1 for r in done)
    assert {r["routing_key"] for r in done if not r["deferrals"]} == {"github.fetch"}
    assert {r["queue"] for r in done if not r["deferrals"]} == {"github"}
    assert all(r["slot"] is not None for r in done)
    spaced(done, 4)
    on_time(done)
    # and the deferred ones came back through github's lane, not a queue nobody consumes
    assert sum(r["deferrals"] for r in done) >= 5
    assert {r["queue"] for r in done if r["deferrals"]} == {"github.throttled"}
    types = queue_types(fleet.vhost)
    assert "github.fetch.throttled" not in types, types


def test_a_quorum_queue_has_a_quorum_lane_even_one_declared_beforehand(fleet: Fleet) -> None:
    # Given tasks on a quorum queue, and on one whose lane an operator pre-declared quorum
    from tests.apps.rabbit_app import plain  # noqa: PLC0415

    handles = {
        queue: [plain.apply_async((x,), queue=queue) for x in range(8)]
        for queue in ("quorum", "prelane")
    }
    for queue, sent in handles.items():
        done = results(sent)
        # Then each ran once at its queue's limit, the deferred ones through the lane
        assert all(r["runs"] == 1 for r in done)
        assert {r["queue"] for r in done if not r["deferrals"]} == {queue}
        assert {r["queue"] for r in done if r["deferrals"]} == {f"{queue}.throttled"}
        spaced(done, 4)
        on_time(done)
    # and each lane was declared like its queue: quorum lanes for quorum queues
    types = queue_types(fleet.vhost)
    assert types["quorum"] == types["quorum.throttled"] == "quorum", types
    assert types["prelane"] == types["prelane.throttled"] == "quorum", types
    assert types["celery.throttled"] == types["github.throttled"] == "classic", types


def test_a_killed_worker_s_tasks_come_back_at_once_and_complete_once(fleet: Fleet) -> None:
    # Given a worker of 2 children running 2 long tasks of queue "kill" (acks_late)
    from tests.apps.rabbit_app import app, sleepy  # noqa: PLC0415

    env = {**fleet.env, "RABBIT_QUORUM": "0"}
    doomed = Worker("k1", env, app="tests.apps.rabbit_app", queues="kill", concurrency=2,
                    log=fleet.tmp / "k1.log")  # fmt: skip
    doomed.start()
    try:
        wait_ready(app, [doomed])
        handles = [sleepy.apply_async((x, 3.0), queue="kill") for x in range(2)]
        deadline = time.monotonic() + 30
        while not all(fleet.client.llen(f"test:starts:{h.id}") for h in handles):
            assert time.monotonic() < deadline, "the tasks never started"
            time.sleep(0.05)
        # When the whole worker is killed (SIGKILL) mid-body
        doomed.kill()
        killed_at = time.monotonic()
    finally:
        doomed.stop()
    # Then RabbitMQ gives both messages back as soon as the connection drops (no
    # visibility timeout to wait for)
    with Connection(fleet.broker) as conn:
        kill = Queue("kill", Exchange("kill"), routing_key="kill")(conn.default_channel)
        while True:
            ready = kill.queue_declare(passive=True).message_count
            if ready == 2:
                break
            assert time.monotonic() - killed_at < REDELIVERED_S, ready
            time.sleep(0.05)
    back_s = time.monotonic() - killed_at
    # and another worker completes each once (each body started twice: at-least-once)
    app.control.add_consumer("kill", destination=[fleet.workers[0].hostname], reply=True)
    done = results(handles)
    assert [r["id"] for r in done] == [h.id for h in handles]
    assert all(r["runs"] == 1 for r in done)
    assert all(fleet.client.llen(f"test:starts:{h.id}") == 2 for h in handles)
    assert {r["queue"] for r in done} == {"kill"}
    print(f"\nkilled worker: its 2 messages were back {back_s:.2f} s after the kill")


def test_a_worker_starting_while_its_lane_holds_messages_runs_them(fleet: Fleet) -> None:
    # Given messages waiting in a queue's lane and no worker consuming it (a killed
    # worker's deferred tasks, a restart during a backlog)
    from tests.apps.rabbit_app import app, plain  # noqa: PLC0415

    handles = [plain.apply_async((x,), queue="cold.throttled") for x in range(3)]
    # When a worker starts on the queue (it consumes the lane too)
    env = {**fleet.env, "RABBIT_QUORUM": "0"}
    cold = Worker("k2", env, app="tests.apps.rabbit_app", queues="cold", concurrency=2,
                  log=fleet.tmp / "k2.log")  # fmt: skip
    cold.start()
    try:
        wait_ready(app, [cold])
        # Then it runs them, once each (the broker delivers them as soon as the worker
        # consumes the lane: before its loop had a callback, the worker stopped with
        # "Consumer does not have any callbacks")
        done = results(handles)
        assert all(r["runs"] == 1 for r in done)
        assert cold.proc is not None and cold.proc.poll() is None
    finally:
        cold.stop()


def test_a_deferred_task_goes_back_to_its_own_queue_only_even_from_a_fanout(vhost: str) -> None:
    # Given a fanout exchange bound to two queues, and a task consumed from one of them
    from celery import Celery  # noqa: PLC0415

    from throttle.celery.reschedule import route_of  # noqa: PLC0415

    fan = Exchange("fan", type="fanout")
    queues = [Queue("fan-a", fan, routing_key="fan-a"), Queue("fan-b", fan, routing_key="fan-b")]
    app = Celery("fanout", broker=f"{AMQP}/{vhost}")
    app.conf.task_queues = queues
    with Connection(f"{AMQP}/{vhost}") as conn:
        for queue in queues:
            queue(conn.default_channel).declare()

        def depth(name: str) -> int:
            return int(conn.default_channel.queue_declare(name, passive=True).message_count)

        # When the throttler sends it back with lanes off (the queue resolved as fan-a)
        execution = SimpleNamespace(
            queue="fan-a", settings=SimpleNamespace(lanes=False),
            throttler=SimpleNamespace(releasing=True),
        )  # fmt: skip
        route = route_of(execution)  # type: ignore[arg-type]
        app.send_task("proj.t", **route)
        # Then only fan-a has it, as the default exchange routes by queue name
        deadline = time.monotonic() + 10
        while depth("fan-a") < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (depth("fan-a"), depth("fan-b")) == (1, 0)
        # while publishing to the queue by its own exchange would copy it to both
        app.send_task("proj.t", queue="fan-a")
        deadline = time.monotonic() + 10
        while depth("fan-b") < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (depth("fan-a"), depth("fan-b")) == (2, 1)
    app.close()
