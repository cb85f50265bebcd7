"""The Celery app of tests/system/test_hostile.py, run by a real ``celery worker`` subprocess.

Its limits file is written by the test fixture (``THROTTLE_CONFIG``); its broker, result
backend and limiter are the test's private redis-server (``DEMO_BROKER_URL``). An app of its
own (not tests.apps.celery_app): a producer app caches the connections of the first test module
that used it. Tasks are ``shared=False`` so that they join no other test module's app.
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import Celery

from throttle.celery import ThrottledTask, install, throttled

BROKER = os.environ.get("DEMO_BROKER_URL", "redis://127.0.0.1:6379/15")

app = Celery("hostile", broker=BROKER, backend=BROKER, task_cls=ThrottledTask)
app.conf.update(
    throttle_config=os.environ.get("THROTTLE_CONFIG"),
    task_default_queue="celery",
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
)
install(app)


def _record(task: Any) -> dict[str, Any]:
    """Count this execution in Redis (runs per task id) and say when the body started."""
    at = time.time()
    client = redis.Redis.from_url(BROKER)
    try:
        runs = client.incr(f"test:runs:{task.request.id}")
    finally:
        client.close()
    return {"id": task.request.id, "runs": runs, "at": at}


@app.task(bind=True, shared=False)
@throttled("spaced")
def spaced(self: Any, x: int) -> dict[str, Any]:
    """5/s burst 1: one start every 200 ms, whatever the headers say."""
    return {**_record(self), "x": x}


@app.task(bind=True, shared=False)
@throttled("gate")
def gated(self: Any, x: int) -> dict[str, Any]:
    """1/h, max_wait 1 s, then the dead-letter queue ``dead``."""
    return {**_record(self), "x": x}


@app.task(bind=True, shared=False)
@throttled("hourly")
def hourly(self: Any, x: int) -> dict[str, Any]:
    """1/h, max_wait 1 s, then ThrottleTimeout."""
    return {**_record(self), "x": x}
