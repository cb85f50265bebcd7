"""The Celery app of tests/system/test_deferred_copy.py: a deferred task is the same task.
Run by real ``celery worker`` subprocesses (one solo pool each), on the Redis broker or on
RabbitMQ.

Settings come from the environment, so that the producer (the test process) and the
worker build the same app: ``COPY_BROKER_URL`` (a private redis-server, or a private
RabbitMQ vhost), ``COPY_REDIS_URL`` (results and limiter: a private redis-server) and
``THROTTLE_CONFIG`` (the limits file the test writes).

The queues: ``hop`` (re-published: a wait between ``sleep_max`` and ``park_after``) and
``lot`` (parked: a longer wait), each through an exchange of its own (direct ``hop``,
topic ``lot``, bound with ``lot.#``: a routing key that is not the queue's name).
Every body counts itself in ``copy:runs`` (HASH task id -> count) and notes how many
times the task had been deferred in ``copy:deferrals:ID``.
"""

from __future__ import annotations

import os
from typing import Any

import redis
from celery import Celery
from celery.exceptions import Reject
from kombu import Exchange, Queue

from throttle.celery import ThrottledTask, install

BROKER = os.environ.get("COPY_BROKER_URL", "redis://127.0.0.1:6379/15")
REDIS = os.environ.get("COPY_REDIS_URL", BROKER)

app = Celery("copy", broker=BROKER, backend=REDIS, task_cls=ThrottledTask)
app.conf.update(
    throttle_config=os.environ.get("THROTTLE_CONFIG"),
    throttle_redis_url=REDIS,
    task_queues=[
        Queue("hop", Exchange("hop"), routing_key="hop"),
        Queue("lot", Exchange("lot", type="topic"), routing_key="lot.#"),
    ],
    task_default_queue="hop",
    broker_connection_retry_on_startup=True,
    result_expires=600,
)
install(app)

_clients: dict[str, redis.Redis] = {}


def _redis() -> redis.Redis:
    """One connection pool per process (made after the fork, never at import)."""
    client = _clients.get(REDIS)
    if client is None:
        client = _clients[REDIS] = redis.Redis.from_url(REDIS)
    return client


def _ran(task: Any) -> None:
    """Count this execution, and note how many times throttling had deferred the task when
    it ran (the list ``copy:deferrals:ID``, one entry per execution)."""
    request = task.request
    deferrals = (request.headers or {}).get("throttle_deferrals", 0)
    pipe = _redis().pipeline(transaction=False)
    pipe.hincrby("copy:runs", request.id, 1)
    pipe.rpush(f"copy:deferrals:{request.id}", deferrals)
    pipe.execute()


def _seen(task: Any) -> dict[str, Any]:
    """What the body sees of its message."""
    request = task.request
    headers = request.headers or {}
    return {
        "properties": {k: v for k, v in (request.properties or {}).items() if k != "delivery_info"},
        "delivery_info": {
            k: request.delivery_info.get(k) for k in ("exchange", "routing_key", "redelivered")
        },
        "priority": request.delivery_info.get("priority"),
        "tenant": headers.get("tenant", getattr(request, "tenant", None)),
        "deferrals": headers.get("throttle_deferrals", 0),
        "parked": bool(headers.get("throttle_parked")),
        "parent_id": request.parent_id,
        "correlation_id": request.correlation_id,
        "reply_to": request.reply_to,
    }


@app.task(bind=True)
def seen(self: Any) -> dict[str, Any]:
    _ran(self)
    return _seen(self)


@app.task(bind=True, acks_late=True)
def reject_once(self: Any) -> dict[str, Any]:
    """Celery's ``reject_then_succeed``: gives its first delivery back to the broker."""
    _ran(self)
    if not self.request.delivery_info.get("redelivered"):
        raise Reject(requeue=True)
    return _seen(self)


@app.task(bind=True, max_retries=1)
def retry_once(self: Any) -> dict[str, Any]:
    """Retries itself once, with an error of its own (stored as its RETRY state)."""
    _ran(self)
    if not self.request.retries:
        raise self.retry(exc=ValueError("the task's own retry"), countdown=1)
    return _seen(self)
