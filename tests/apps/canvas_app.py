"""The Celery app of tests/system/test_canvas.py and test_semantics.py: Celery's canvas
(the tasks of Celery's own t/integration/tasks.py that its canvas tests use) with every task
a ``ThrottledTask``, run by real ``celery worker`` subprocesses.

As Celery's integration suite, ``task_create_missing_queues`` is off (``CANVAS_MISSING=1``
turns it on) and the default queue ``celery`` is the only queue; the limits file
(``THROTTLE_CONFIG``) puts a binding limit on it. ``CANVAS_BROKER_URL`` is the broker
(Redis or ``amqp://``), ``CANVAS_REDIS_URL`` the private redis-server that is result
backend, limiter and ledger (``test:*`` keys).
"""

from __future__ import annotations

import json
import os
from typing import Any

import redis
from celery import Celery, signals

from throttle.celery import ThrottledTask, install, throttled

REDIS = os.environ.get("CANVAS_REDIS_URL", "redis://127.0.0.1:6379/15")
BROKER = os.environ.get("CANVAS_BROKER_URL", REDIS)
REVOKED = "test:revoked"
"""A list of the ``task_revoked`` signals seen (JSON: id, expired, terminated)."""
ERRBACKS = "test:errbacks"
"""A list of the ids of failed tasks whose inline errback ran."""

app = Celery("canvas", broker=BROKER, backend=REDIS, task_cls=ThrottledTask)
app.conf.update(
    throttle_config=os.environ.get("THROTTLE_CONFIG"),
    throttle_redis_url=REDIS,
    task_create_missing_queues=os.environ.get("CANVAS_MISSING") == "1",
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    result_extended=True,  # as Celery's integration suite
    broker_transport_options={"consumer_timeout": 1800},
)
install(app)


class ExpectedError(Exception):
    """Raised by :func:`fail` (Celery's ``ExpectedException``)."""


def _ledger() -> redis.Redis:
    return redis.Redis.from_url(REDIS)


def _deferrals(task: Any) -> int:
    return int((task.request.headers or {}).get("throttle_deferrals", 0))


@app.task
def add(x: int, y: int) -> int:
    return x + y


@app.task
def tsum(nums: list[int]) -> int:
    return sum(nums)


@app.task
def identity(x: Any) -> Any:
    return x


@app.task(bind=True)
def ids(self: Any, i: int) -> tuple[Any, Any, int]:
    """``root_id``, ``parent_id`` and ``i`` (Celery's ``ids``)."""
    return self.request.root_id, self.request.parent_id, i


@app.task
def fail(*args: Any) -> None:
    raise ExpectedError("Task expected to fail", *args)


@app.task(bind=True)
def return_request_eta(self: Any) -> Any:
    """This task's ETA (Celery's ``return_request_eta``)."""
    return self.request.eta


@app.task(bind=True, max_retries=1)
def retry_once(self: Any, x: int) -> dict[str, Any]:
    """Retries once through Celery's own ``self.retry`` (which re-publishes to the queue
    the message came from: a lane, for a task the throttler re-published)."""
    if self.request.retries == 0:
        raise self.retry(countdown=0.1)
    return {"x": x, "retries": self.request.retries, "deferrals": _deferrals(self)}


@app.task(bind=True)
@throttled("eta")
def eta_seen(self: Any, k: str, n: int) -> dict[str, Any]:
    """What ``request.eta`` reads, after the throttler re-published the task."""
    return {"n": n, "eta": self.request.eta, "deferrals": _deferrals(self)}


@app.task(bind=True)
@throttled("fast")
def counted(self: Any, k: str, n: int) -> dict[str, Any]:
    """How often throttling re-published this task (``throttle_deferrals``)."""
    return {"n": n, "deferrals": _deferrals(self)}


@app.task(bind=True)
@throttled("hourly")
def hourly(self: Any, k: str) -> str:
    return str(self.request.id)


@app.task(bind=True)
@throttled("waiting")
def waiting(self: Any, k: str) -> str:
    return str(self.request.id)


@app.task
def inline_errback(request: Any, exc: BaseException, traceback: Any) -> None:
    """An errback Celery calls inline, in the failing task's process (three arguments)."""
    client = _ledger()
    client.rpush(ERRBACKS, str(request.id))
    client.close()


@signals.task_revoked.connect
def _on_revoked(request: Any = None, expired: Any = None, terminated: Any = None, **_: Any) -> None:
    client = _ledger()
    seen = {"id": getattr(request, "id", None), "expired": expired, "terminated": terminated}
    client.rpush(REVOKED, json.dumps(seen))
    client.close()
