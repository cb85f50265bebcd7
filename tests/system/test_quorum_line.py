"""A flood waiting in a worker's line on a RabbitMQ quorum queue leaves the queue to the
tasks that can run.

Celery turns global QoS off for quorum queues: a raised prefetch count reaches only
consumers started after it, so each task waiting in the consumer keeps one of the fixed
prefetch slots (``worker_prefetch_multiplier`` x concurrency). Without a bound, a flood
waiting for its limit took them all, and an unthrottled task sent behind it on the same
queue waited for the flood to drain (5 s here). The line now holds at most the prefetch
slots beyond the pool's size (:func:`throttle.celery.waiting.line_room`); the rest of the
flood is decided in the pool, which reserves each task's slot and sends it back.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.support.held import CaseError, rabbit_vhost
from tests.support.held import _producer as held_app
from tests.support.servers import RedisServer
from tests.support.waits import wait_for
from workers.harness import Worker, wait_ready

pytestmark = pytest.mark.slow

CONFIG = """
settings:
  refresh: 0.5s
limits:
  held: {algorithm: gcra, rate: 4/s, burst: 1}
"""
FLOOD = 30
"""7.5 s at 4/s: the part beyond the 8 prefetch slots is 5.5 s of it."""
PING_WITHIN_S = 3.0
"""How soon the unthrottled task must run once sent (Redis clock): well above what it
takes (a fraction of a second), well below the flood's drain without the bound."""


@pytest.fixture
def vhost() -> Iterator[str]:
    try:
        with rabbit_vhost("throttle-quorum") as url:
            yield url
    except CaseError as exc:
        pytest.fail(str(exc))


@pytest.mark.timeout(180)
def test_a_flood_on_a_quorum_queue_leaves_room_for_a_task_that_can_run(
    vhost: str, tmp_path: Path
) -> None:
    config = tmp_path / "limits.yaml"
    config.write_text(CONFIG)
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        env = {
            "HELD_BROKER_URL": vhost, "HELD_REDIS_URL": server.url,
            "HELD_QUEUE": f"quorum-{uuid.uuid4().hex[:8]}", "HELD_QUORUM": "1",
            "HELD_ACKS_LATE": "1", "HELD_PREFETCH": "4", "THROTTLE_CONFIG": str(config),
        }  # fmt: skip
        module = held_app(env)
        worker = Worker(
            "quorum", env, concurrency=2, queues=env["HELD_QUEUE"], app="tests.apps.held_app",
            log=tmp_path / "worker.log", pool="threads",
        )  # fmt: skip
        try:
            worker.start()
            wait_ready(module.app, [worker])
            # Given a flood of one limit's tasks on a quorum queue, waiting for its slots
            ids = [module.call.delay(n).id for n in range(FLOOD)]
            wait_for(lambda: client.hlen("held:runs") >= 2, 60, 0.01)
            # When an unthrottled task is sent on the same queue
            seconds, micros = client.time()
            sent = seconds + micros / 1e6
            ping = module.ping.delay().id
            ran = wait_for(lambda: client.get(f"held:ping:{ping}"), 60, 0.01)
            # Then it runs at once, not after the flood (5.5 s without the bound)
            assert float(ran) - sent < PING_WITHIN_S, float(ran) - sent
            # and every task of the flood runs, once
            wait_for(lambda: client.hlen("held:runs") >= FLOOD, 60, 0.05)
            time.sleep(0.5)
            runs = {k.decode(): int(v) for k, v in client.hgetall("held:runs").items()}
            assert sorted(runs) == sorted(ids) and set(runs.values()) == {1}, runs
            log = (tmp_path / "worker.log").read_text()
            assert "at most 6 tasks wait in this worker's line" in log, log[-2000:]
        finally:
            worker.stop()
            client.close()
