"""The Celery app of the RabbitMQ tests (tests/test_rabbitmq.py), run by real ``celery
worker`` subprocesses against the RabbitMQ service, in a private vhost.

``RABBIT_BROKER_URL`` is the broker (``amqp://.../VHOST``); ``RABBIT_REDIS_URL`` the
private redis-server that is result backend, limiter and ledger (``test:*`` keys).
``RABBIT_COUNT_PUBLISHES=1`` (the workers) counts the messages they publish per task id
(:func:`tests.support.publishes.count_publishes`).
``RABBIT_QUORUM=1`` adds the quorum queues (``quorum``, ``prelane``) to ``task_queues``:
Celery turns global QoS off for a worker that knows a quorum queue, so the classic fleet
is started without them and a worker of its own consumes them.
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import Celery
from kombu import Exchange, Queue

from tests.support.publishes import count_publishes
from throttle.celery import ThrottledTask, install, throttled
from throttle.redis.keys import KeySpace
from workers.demo_app import _post

BROKER = os.environ.get("RABBIT_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672/")
REDIS = os.environ.get("RABBIT_REDIS_URL", "redis://127.0.0.1:6379/15")
QUORUM = {"x-queue-type": "quorum"}

TOPIC = Exchange("tasks", type="topic")
queues = [
    Queue("celery", Exchange("celery"), routing_key="celery"),
    Queue("upstream", Exchange("upstream"), routing_key="upstream"),
    Queue("kill", Exchange("kill"), routing_key="kill"),
    # Celery's topic-routing example: the routing key of a message is not the queue's name.
    Queue("github", TOPIC, routing_key="github.#"),
]
if os.environ.get("RABBIT_QUORUM") == "1":
    queues += [
        Queue("quorum", Exchange("quorum"), routing_key="quorum", queue_arguments=QUORUM),
        Queue("prelane", Exchange("prelane"), routing_key="prelane", queue_arguments=QUORUM),
    ]

app = Celery("rabbit", broker=BROKER, backend=REDIS, task_cls=ThrottledTask)
app.conf.update(
    throttle_config=os.environ.get("THROTTLE_CONFIG"),
    throttle_redis_url=REDIS,
    task_queues=queues,
    task_default_queue="celery",
    task_routes={"tests.apps.rabbit_app.call_api": {"queue": "upstream"}},
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    # The server's consumer_timeout (RabbitMQ's default, said explicitly: the start-up check
    # compares park_after + park_lead + sleep_max with half of it).
    broker_transport_options={"consumer_timeout": 1800},
)
install(app)
_KEYS = KeySpace()
_clients: list[redis.Redis] = []


def _counter() -> redis.Redis:
    """The ledger's client of this process, made on first use (after a pool's fork)."""
    if not _clients:
        _clients.append(redis.Redis.from_url(REDIS))
    return _clients[0]


if os.environ.get("RABBIT_COUNT_PUBLISHES") == "1":  # the workers: what they send back
    count_publishes(_counter, lambda: set(app.tasks))


def _record(task: Any, name: str) -> dict[str, Any]:
    """Count this execution in Redis and describe it (see tests/celery_app.py): ``at`` when
    the body started (this host's clock), ``slot`` the slot its lease records (Redis time),
    ``queue`` the queue the worker resolved, ``routing_key`` what the message carried."""
    at = time.time()
    client = redis.Redis.from_url(REDIS)
    key = f"test:runs:{task.request.id}"
    pipe = client.pipeline(transaction=False)
    pipe.incr(key).expire(key, 600).hget(_KEYS.lease_key(task.request.id), "at")
    runs, _, slot_us = pipe.execute()
    client.close()
    headers = task.request.headers or {}
    info = task.request.delivery_info or {}
    return {
        "task": name,
        "id": task.request.id,
        "retries": task.request.retries,
        "deferrals": headers.get("throttle_deferrals", 0),
        "parked": bool(headers.get("throttle_parked")),
        "runs": runs,
        "at": at,
        "slot": None if slot_us is None else float(slot_us) / 1e6,
        "queue": info.get("queue"),
        "routing_key": info.get("routing_key"),
        "exchange": info.get("exchange"),
    }


@app.task(bind=True)
def call_api(self: Any, n: int) -> dict[str, Any]:
    """One call to the mock API (queue ``upstream`` is throttled by the file)."""
    status = _post("/call", self.request.id)
    return {**_record(self, "call_api"), "n": n, "status": status}


@app.task(bind=True, max_retries=0)
@throttled("slow")
def slow(self: Any, x: int) -> dict[str, Any]:
    return {**_record(self, "slow"), "x": x}


@app.task(bind=True)
@throttled("parked")
def far(self: Any, x: int) -> dict[str, Any]:
    return {**_record(self, "far"), "x": x}


@app.task(bind=True)
def plain(self: Any, x: int) -> dict[str, Any]:
    """Not decorated: throttled only by the limits of the queue it came from."""
    return {**_record(self, "plain"), "x": x}


@app.task(bind=True)
def sleepy(self: Any, x: int, seconds: float) -> dict[str, Any]:
    """Counts its starts and its completions apart (a killed body started, never ended)."""
    client = redis.Redis.from_url(REDIS)
    client.rpush(f"test:starts:{self.request.id}", time.time())
    client.close()
    time.sleep(seconds)
    record = _record(self, "sleepy")
    return {**record, "x": x}
