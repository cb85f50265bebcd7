"""The Celery app of the outage tests (tests/system/test_outage.py), run by real ``celery worker``
subprocesses. Three separate redis-servers, so that each can go away on its own:

* ``OUTAGE_BROKER_URL``: the broker;
* ``THROTTLE_REDIS_URL``: the limiter's Redis (the one the test kills);
* ``OUTAGE_LEDGER_URL``: the result backend and the ledger where every execution of a task
  body is recorded (never stopped: it is how the test sees each run, even mid-outage).

The limits file comes from ``THROTTLE_CONFIG`` (written by the test).
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import Celery

from throttle.celery import install, throttled

BROKER = os.environ.get("OUTAGE_BROKER_URL", "redis://127.0.0.1:6379/15")
LEDGER = os.environ.get("OUTAGE_LEDGER_URL", BROKER)

app = Celery("outage", broker=BROKER, backend=LEDGER)
app.conf.update(
    throttle_config=os.environ.get("THROTTLE_CONFIG"),
    throttle_redis_url=os.environ.get("THROTTLE_REDIS_URL"),
    task_default_queue="outage",
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    broker_connection_max_retries=None,  # a broker outage: keep trying, never give up
    result_expires=600,
    # A task that ran while the broker was away could not be acknowledged: it is delivered
    # again (flagged "redelivered") and skipped, as its SUCCESS is in the result backend.
    worker_deduplicate_successful_tasks=True,
    # Messages a worker held when the broker went away (prefetched, or deferred as ETA
    # messages) stay in kombu's "unacked" hash: they come back after the visibility
    # timeout, swept every second here (default: 1 h, swept every 100 s).
    broker_transport_options={
        "visibility_timeout": 8,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    },
)
install(app)


def _record(task: Any, policy: str) -> dict[str, Any]:
    """Count this execution in the ledger (duplicates show) and say when and where it ran."""
    at = time.time()
    ledger = redis.Redis.from_url(LEDGER)
    runs = int(ledger.incr(f"runs:{task.request.id}"))
    row = f"{policy} {at:.6f} {os.getpid()} {task.request.hostname} {task.request.id}"
    ledger.rpush("calls", row)
    return {"policy": policy, "at": at, "runs": runs, "pid": os.getpid()}


@app.task(bind=True)
@throttled("closed")
def closed(self: Any, n: int) -> dict[str, Any]:
    return _record(self, "closed")


@app.task(bind=True)
@throttled("opened")
def opened(self: Any, n: int) -> dict[str, Any]:
    return _record(self, "opened")


@app.task(bind=True)
@throttled("local")
def local(self: Any, n: int) -> dict[str, Any]:
    return _record(self, "local")


@app.task(bind=True)
@throttled("plain")
def plain(self: Any, n: int) -> dict[str, Any]:
    return _record(self, "plain")


@app.task(bind=True)
@throttled("paced")
def paced(self: Any, n: int) -> dict[str, Any]:
    return _record(self, "paced")
