"""A deferred task is the same task: what its message carried, its own ``Reject`` and its
own ``retry`` state survive throttling's re-publish and park, on the Redis broker and on
RabbitMQ (the service at 127.0.0.1:5672, a private vhost per run: see
tests/system/test_rabbitmq.py). One ``celery worker`` subprocess (solo pool) of
tests/apps/copy_app.py; results and limiter on a private redis-server.

Each test first holds the limit (as an upstream's 429 does), so that the task under test
is denied and comes back when the hold ends: in 1 s on ``hop`` (between ``sleep_max`` and
``park_after``: re-published), 5 s on ``lot`` (parked: beyond ``park_after`` however late
the worker takes the task, up to 3.5 s). The task's own headers say it
was deferred, and how.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from kombu import Exchange, Queue

from tests.support.servers import RedisServer
from tests.system.test_rabbitmq import AMQP, vhost  # noqa: F401 (the vhost fixture)
from throttle import Limiter
from workers.harness import Worker, running

pytestmark = pytest.mark.slow

CONFIG = """
settings:
  sleep_max: 0.05s
  park_after: 1.5s
  line_max: 0s  # a held task comes back as a copy (re-published or parked), as checked here
  park_lead: 0.02s
  jitter: 0.1s  # a hop task denied by a 1 s hold comes back within 1.1 s: re-published
limits:
  hop: {algorithm: gcra, rate: 2/s, burst: 1}
  lot: {algorithm: gcra, rate: 20/m, burst: 1}
queues:
  hop: [hop]
  lot: [lot]
"""
APP = "tests.apps.copy_app"
ROUTES = {"hop": ("hop", "hop"), "lot": ("lot", "lot.eu")}
"""queue -> (exchange, routing key) a task is sent with: ``lot``'s exchange is a topic, so
its routing key is not the queue's name."""


class Fleet:
    """One worker of tests/apps/copy_app.py and a producer app for it."""

    def __init__(self, broker: str, server: RedisServer, tmp: Path) -> None:
        self.server = server
        config = tmp / "limits.yaml"
        config.write_text(CONFIG)
        env = {
            "COPY_BROKER_URL": broker,
            "COPY_REDIS_URL": server.url,
            "THROTTLE_CONFIG": str(config),
        }
        self.worker = Worker(
            "copy", env, concurrency=1, queues="hop,lot", app=APP, log=tmp / "worker.log",
            pool="solo",
        )  # fmt: skip
        self.client = redis.Redis.from_url(server.url)
        self.limiter = Limiter(self.client)
        self.app = Celery("copy-producer", broker=broker, backend=server.url)
        self.app.conf.update(
            task_queues=[
                Queue("hop", Exchange("hop"), routing_key="hop"),
                Queue("lot", Exchange("lot", type="topic"), routing_key="lot.#"),
            ],
            broker_connection_retry_on_startup=True,
        )

    def send(self, name: str, queue: str, **options: Any) -> Any:
        exchange, routing_key = ROUTES[queue]
        return self.app.send_task(
            f"{APP}.{name}", queue=queue, exchange=exchange, routing_key=routing_key, **options
        )

    def hold(self, queue: str) -> None:
        """Hold ``queue``'s limit, so that the next task is denied and comes back when the
        hold ends: in 1 s on ``hop`` (re-published), 5 s on ``lot`` (parked). A hold, not
        tasks taking the slots: a solo worker runs those in its consumer, which receives
        the next task only once their slots have passed."""
        self.limiter.hold(queue, None, 1.0 if queue == "hop" else 5.0)

    def runs(self, task_id: str) -> int:
        return int(self.client.hget("copy:runs", task_id) or 0)

    def deferrals(self, task_id: str) -> list[int]:
        """How many times throttling had deferred the task, at each of its executions."""
        return [int(n) for n in self.client.lrange(f"copy:deferrals:{task_id}", 0, -1)]

    def close(self) -> None:
        self.app.close()
        self.client.close()


@pytest.fixture(scope="module", params=["redis", "rabbitmq"])
def fleet(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp(f"copy-{request.param}")
    with RedisServer() as server:
        if request.param == "redis":
            broker = server.url
        else:
            broker = f"{AMQP}/{request.getfixturevalue('vhost')}"
        fleet = Fleet(broker, server, tmp)
        try:
            with running(fleet.app, [fleet.worker]):
                yield fleet
        finally:
            fleet.close()


@pytest.mark.parametrize("queue", ["hop", "lot"])
def test_a_deferred_task_keeps_what_its_message_carried(fleet: Fleet, queue: str) -> None:
    # Given a task sent with properties, a header and a routing key of its own, while its
    # limit is held
    fleet.hold(queue)
    sent = fleet.send(
        "seen", queue, app_id="1234", correlation_id="corr-1", reply_to="replies",
        priority=3, headers={"tenant": "acme"},
    )  # fmt: skip
    # When it runs, after throttling re-published it (hop) or parked it (lot)
    seen = sent.get(timeout=60)
    assert seen["deferrals"] >= 1, seen
    assert seen["parked"] is (queue == "lot"), seen
    # Then it sees its message as the producer sent it: properties, header, priority,
    # and the exchange and routing key it was delivered with (not the queue's lane)
    assert seen["properties"]["app_id"] == "1234", seen
    assert seen["correlation_id"] == "corr-1", seen
    assert seen["reply_to"] == "replies", seen
    assert seen["priority"] == 3, seen
    assert seen["tenant"] == "acme", seen
    assert seen["parent_id"] is None, seen  # sent by no task: the copy's is not the task
    exchange, routing_key = ROUTES[queue]
    assert seen["delivery_info"] == {
        "exchange": exchange, "routing_key": routing_key, "redelivered": False,
    }, seen  # fmt: skip
    assert fleet.runs(sent.id) == 1


def test_a_tasks_own_reject_with_requeue_is_redelivered_and_runs(fleet: Fleet) -> None:
    # Given a task (acks_late) that gives its first delivery back to the broker, deferred
    # by throttling before that (its limit is held)
    fleet.hold("hop")
    sent = fleet.send("reject_once", "hop")
    # When it runs
    seen = sent.get(timeout=60)
    # Then its redelivery ran on the slot the first delivery paid for, and succeeded:
    # two executions, the second told it is a redelivery
    assert seen["deferrals"] >= 1, seen
    assert seen["delivery_info"]["redelivered"] is True, seen
    assert fleet.runs(sent.id) == 2


def test_throttling_never_overwrites_the_state_a_task_stored(fleet: Fleet) -> None:
    # Given a task that retries itself once (countdown 1 s) with an error of its own,
    # deferred by throttling before its first run (its limit is held) and when its retry
    # comes (held for 2 s again once the task's RETRY shows)
    fleet.hold("hop")
    sent = fleet.send("retry_once", "hop")
    seen: list[tuple[str, str]] = []
    deadline = time.monotonic() + 60
    held = False
    while time.monotonic() < deadline:
        meta = fleet.app.backend.get_task_meta(sent.id)  # state and result: one read
        state, value = meta["status"], meta["result"]
        if not seen or seen[-1] != (state, repr(value)):
            seen.append((state, repr(value)))
        if state == "RETRY" and not held:
            fleet.limiter.hold("hop", None, 2.0)
            held = True
        if state == "SUCCESS":
            break
        time.sleep(0.01)
    # Then the result backend only ever showed what the task stored: PENDING before its
    # first run, its own RETRY while its retry waited, its result at the end
    states = [state for state, _ in seen]
    assert states == ["PENDING", "RETRY", "SUCCESS"], seen
    assert seen[1][1] == repr(ValueError("the task's own retry")), seen
    # while throttling deferred it before its first run, and its retry (once or more,
    # between its two executions)
    first, second = fleet.deferrals(sent.id)
    assert 0 < first < second, (first, second)
