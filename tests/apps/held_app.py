"""The Celery app of the kill-while-held tests (tests/system/test_kill_held.py) and their full
matrix (bench/kill_matrix.py): real ``celery worker`` subprocesses, any pool, killed with
SIGKILL while they hold throttled tasks that wait for their slots.

Settings come from the environment, so that the producer (the test process) and the
workers build the same app:

* ``HELD_BROKER_URL``: the broker, a private redis-server (``redis://``) or a private
  RabbitMQ vhost (``amqp://``);
* ``HELD_REDIS_URL``: the limiter and the counts (a private redis-server; the broker's
  with a Redis broker);
* ``HELD_QUEUE``: the queue of the case (a quorum queue with ``HELD_QUORUM=1``);
* ``HELD_ACKS_LATE``: ``1`` for ``task_acks_late`` (and ``task_reject_on_worker_lost``),
  ``0`` for Celery's default (acked when the pool starts the task);
* ``HELD_VISIBILITY_S``: the Redis transport's visibility timeout, in s (default 8): a
  killed worker's unacknowledged messages come back once they are that old;
* ``HELD_PREFETCH``: ``worker_prefetch_multiplier`` (default 1);
* ``THROTTLE_CONFIG``: the limits file (limit ``held``).

Each body counts itself in ``held:runs`` (HASH task id -> count) and names its worker in
``held:by:<task id>`` (a list), in one round trip and nothing else, so that a body killed
mid-way is all but impossible and a count of 2 is a task run twice.
With ``HELD_COUNT_PUBLISHES=1`` (the workers), every message a worker publishes (a
re-publish, a release from parking) is counted per task id
(:func:`tests.support.publishes.count_publishes`).
"""

from __future__ import annotations

import os
from typing import Any

import redis
from celery import Celery
from kombu import Exchange, Queue

from tests.support.publishes import count_publishes
from throttle.celery import install, throttled

BROKER = os.environ.get("HELD_BROKER_URL", "redis://127.0.0.1:6379/15")
REDIS = os.environ.get("HELD_REDIS_URL", BROKER)
QUEUE = os.environ.get("HELD_QUEUE", "held")
ACKS_LATE = os.environ.get("HELD_ACKS_LATE", "1") == "1"
VISIBILITY_S = float(os.environ.get("HELD_VISIBILITY_S", "8"))
QUORUM = os.environ.get("HELD_QUORUM") == "1"
ARGUMENTS = {"x-queue-type": "quorum"} if QUORUM else None

app = Celery("held", broker=BROKER, backend=None)
app.conf.update(
    throttle_config=os.environ.get("THROTTLE_CONFIG"),
    throttle_redis_url=REDIS,
    task_queues=[Queue(QUEUE, Exchange(QUEUE), routing_key=QUEUE, queue_arguments=ARGUMENTS)],
    task_default_queue=QUEUE,
    task_acks_late=ACKS_LATE,
    task_reject_on_worker_lost=ACKS_LATE,
    task_ignore_result=True,
    worker_prefetch_multiplier=int(os.environ.get("HELD_PREFETCH", "1")),
    broker_connection_retry_on_startup=True,
    broker_transport_options={
        # Redis: unacked messages come back after this, swept every second by a live
        # worker (kombu's default sweep is 100 s apart); RabbitMQ ignores both and gives a
        # dropped connection's messages back at once.
        "visibility_timeout": VISIBILITY_S,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
        # RabbitMQ's default consumer_timeout, said explicitly (the worker's start-up check
        # compares how long a task may be held with half of it).
        **({} if BROKER.startswith("redis") else {"consumer_timeout": 1800}),
    },
)
install(app)

_clients: dict[str, redis.Redis] = {}


def _redis() -> redis.Redis:
    """One connection pool per process (made on first use, after the fork)."""
    client = _clients.get(REDIS)
    if client is None:
        client = _clients[REDIS] = redis.Redis.from_url(REDIS)
    return client


# shared=False: the task must not join the other test apps of the same pytest process.
@app.task(bind=True, shared=False)
@throttled("held")
def call(self: Any, n: int) -> None:
    """One call under limit ``held``: counted per task id, with the worker that ran it."""
    pipe = _redis().pipeline(transaction=False)
    pipe.hincrby("held:runs", self.request.id, 1)
    pipe.rpush(f"held:by:{self.request.id}", self.request.hostname or "")
    pipe.execute()


@app.task(bind=True, shared=False)
def ping(self: Any) -> None:
    """Not throttled: when it ran (Redis clock, epoch s) in ``held:ping:<task id>``."""
    client = _redis()
    seconds, micros = client.time()
    client.set(f"held:ping:{self.request.id}", seconds + micros / 1e6)


if os.environ.get("HELD_COUNT_PUBLISHES") == "1":
    count_publishes(_redis, lambda: {call.name})


if os.environ.get("HELD_KILL_AFTER_PARK") == "1":
    # Fault injection for tests/system/test_kill_held.py: the first task this worker
    # parks kills the worker (its main process, then this pool child: run with -c 1)
    # right after the parking lot took it, before the message it ran is acknowledged.
    import signal

    from throttle.parking import ParkingLot

    _park = ParkingLot.park

    def _park_then_die(self: ParkingLot, *args: Any, **kwargs: Any) -> str:
        token = _park(self, *args, **kwargs)
        _redis().rpush("held:killed_after_park", kwargs.get("task_id") or "")
        os.kill(os.getppid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
        return token  # not reached

    ParkingLot.park = _park_then_die  # type: ignore[method-assign]
