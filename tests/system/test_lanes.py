"""Lanes under either setting of ``task_create_missing_queues``, on a Redis and a RabbitMQ
broker: a throttled task never fails because of how the throttler routes it.

Celery looks a queue up by name when a task is published there: with
``task_create_missing_queues`` off (Celery's own test suite, strict production setups) an
unknown name raises ``QueueNotFound``. A task the throttler re-published comes back
through the lane ``celery.throttled``, and Celery's own ``retry`` sends it back to the
queue it came from: every process of every worker must know the lane, including the pool
children that never re-published anything themselves (the task may have been re-published
by another worker). Real ``celery worker`` subprocesses of tests/apps/canvas_app.py; on
RabbitMQ, a private vhost created and deleted here.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import chord

from tests.support.canvas import canvas_fleet
from tests.system.test_rabbitmq import AMQP, rabbitmqctl
from throttle.celery.routing import lane_queue

pytestmark = pytest.mark.slow

CONFIG = """
settings:
  sleep_max: 0.05s
  park_after: 0.5s
  line_max: 0s  # waits beyond sleep_max are rescheduled (re-published, parked), as tested here
  park_lead: 0.2s
  late_tolerance: 5s
limits:
  celery: {algorithm: gcra, rate: 10/s, burst: 1}  # 20 runs of retry_once: 2 s of slots
  eta: {algorithm: gcra, rate: 2/s, burst: 1, key: "{k}"}
  fast: {algorithm: gcra, rate: 5/s, burst: 1, key: "{k}"}
  hourly: {algorithm: gcra, rate: 1/h, burst: 1, key: "{k}"}
  waiting: {algorithm: gcra, rate: 1/h, burst: 1, key: "{k}", max_wait: 1s}
queues:
  celery: [celery]
"""
TIMEOUT = 60


@pytest.fixture(scope="module")
def vhost() -> Iterator[str]:
    """A private vhost for this module (guest may do anything there), deleted at the end."""
    name = f"throttle-lanes-{uuid.uuid4().hex[:10]}"
    rabbitmqctl("add_vhost", name)
    try:
        rabbitmqctl("set_permissions", "-p", name, "guest", ".*", ".*", ".*")
        yield name
    finally:
        rabbitmqctl("delete_vhost", name)


@pytest.mark.parametrize("missing_queues", [False, True], ids=["strict", "create-missing"])
@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_a_task_that_came_through_a_lane_retries_and_completes(
    broker: str, missing_queues: bool, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    url = f"{AMQP}/{request.getfixturevalue('vhost')}" if broker == "rabbitmq" else None
    with canvas_fleet(
        tmp_path, CONFIG, broker=url, missing_queues=missing_queues,
        concurrency=2,
    ) as fleet:  # fmt: skip
        from tests.apps.canvas_app import add, retry_once, tsum  # noqa: PLC0415

        # Given a task re-published to the lane by another worker (as the throttler does:
        # through the default exchange), taken by a pool child that never re-published
        lane = lane_queue(fleet.app, "celery")
        first = retry_once.apply_async((-1,), queue=lane, exchange="", routing_key=lane.name)
        # When its body retries (Celery sends it back to the queue it came from: the lane)
        # Then it completes, as do tasks that the limit re-publishes and that then retry,
        # and a chord whose header the limit spreads over its slots
        assert first.get(timeout=TIMEOUT)["retries"] == 1
        handles = [retry_once.delay(n) for n in range(10)]
        done = [h.get(timeout=TIMEOUT) for h in handles]
        assert [d["retries"] for d in done] == [1] * 10
        assert sum(d["deferrals"] for d in done) > 0  # the limit bound: some came by the lane
        assert chord(add.s(i, i) for i in range(10))(tsum.s()).get(timeout=TIMEOUT) == 90
        assert "QueueNotFound" not in fleet.logs()
