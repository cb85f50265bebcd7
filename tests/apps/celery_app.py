"""The Celery app of the integration tests, run by real ``celery worker`` subprocesses.

Its limits file is written by the test fixture (``THROTTLE_CONFIG``); its broker, result
backend and limiter are the test's private redis-server (``DEMO_BROKER_URL``).
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import Celery

from throttle.celery import ThrottledTask, install, report_cost, throttled
from throttle.redis.keys import KeySpace
from workers.demo_app import _post

BROKER = os.environ.get("DEMO_BROKER_URL", "redis://127.0.0.1:6379/15")

app = Celery("tests", broker=BROKER, backend=BROKER, task_cls=ThrottledTask)
app.conf.update(
    throttle_config=os.environ.get("THROTTLE_CONFIG"),
    task_default_queue="celery",
    task_routes={"tests.apps.celery_app.call_api": {"queue": "upstream"}},
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
)
install(app)
_KEYS = KeySpace()  # the workers' namespace: the default
BLOCKS = "test:blocks"
"""A counter of the ``block`` tasks started (a backlog's progress, read by ``_record``)."""


def _record(task: Any, name: str) -> dict[str, Any]:
    """Count this execution in Redis (so tests see duplicates) and describe it.

    ``at`` is when the body started (this host's clock); ``slot`` is the slot the limiter
    granted it, read from its lease record in Redis (Redis time, epoch s; None for a task
    that holds no lease), so that tests judge the limiter on what it granted and the worker
    on how late it ran, apart; ``blocks`` is how many ``block`` tasks had started by then
    (read in the same round trip).
    """
    at = time.time()  # first: when the body started, before any Redis round trip
    client = redis.Redis.from_url(BROKER)
    key = f"test:runs:{task.request.id}"
    pipe = client.pipeline(transaction=False)
    pipe.incr(key).expire(key, 600).hget(_KEYS.lease_key(task.request.id), "at").get(BLOCKS)
    runs, _, slot_us, blocks = pipe.execute()
    client.close()
    headers = task.request.headers or {}
    return {
        "task": name,
        "id": task.request.id,
        "retries": task.request.retries,
        "deferrals": headers.get("throttle_deferrals", 0),
        "runs": runs,
        "at": at,
        "slot": None if slot_us is None else float(slot_us) / 1e6,
        "blocks": int(blocks or 0),
        # The queue the worker consumed it from (a deferred copy: the lane), as it resolved
        # it; the routing key the task sees is the one its producer sent it with.
        "queue": (task.request.delivery_info or {}).get("queue"),
    }


@app.task(bind=True, max_retries=0)
@throttled("slow")
def slow(self: Any, x: int) -> dict[str, Any]:
    return {**_record(self, "slow"), "x": x}


@app.task(bind=True, max_retries=2)
@throttled("slow")
def flaky(self: Any, fail_times: int) -> dict[str, Any]:
    """Fails ``fail_times`` times through its own ``self.retry``."""
    if self.request.retries < fail_times:
        raise self.retry(countdown=0.1)
    return _record(self, "flaky")


@app.task
@throttled("slow")
def add(x: int, y: int) -> int:
    return x + y


@app.task
@throttled("slow")
def total(xs: list[int]) -> int:
    return sum(xs)


@app.task(bind=True)
@throttled("tokens")
def spend(self: Any, tenant: str, estimate: int, used: int | None, fail: bool = False) -> int:
    if used is not None:
        report_cost(used)
    if fail:
        raise ValueError("the call failed before it was made")
    return estimate


@app.task(bind=True)
@throttled("fair")
def fair_call(self: Any, tenant: str, n: int) -> dict[str, Any]:
    """A tenant's call under a limit shared fairly among tenants."""
    return {**_record(self, "fair_call"), "tenant": tenant, "n": n}


@app.task
@throttled("1000/s")
def roomy(x: int) -> int:
    """A fixed cost under a limit that never binds: admitted at once (inline, so that every
    limits file the tests write for this app may leave it out)."""
    return x


@app.task
@throttled("deadline")
def hurry(x: int) -> int:
    return x


@app.task
@throttled("dlq")
def doomed(x: int) -> int:
    return x


@app.task(bind=True)
def plain(self: Any, x: int) -> dict[str, Any]:
    """Not decorated: throttled only by its queue's limits in the file."""
    return {**_record(self, "plain"), "x": x}


@app.task(bind=True)
def call_api(self: Any, n: int) -> dict[str, Any]:
    """One call to the mock API (queue ``upstream`` is throttled by the file)."""
    status = _post("/call", self.request.id)
    return {**_record(self, "call_api"), "n": n, "status": status}


@app.task(bind=True)
@throttled("parked")
def far(self: Any, x: int) -> dict[str, Any]:
    return {**_record(self, "far"), "x": x}


@app.task(bind=True)
@throttled("live")
def live(self: Any, x: int) -> dict[str, Any]:
    return {**_record(self, "live"), "x": x}


@app.task(bind=True)
@throttled("strict")
def strict(self: Any, x: int) -> dict[str, Any]:
    return {**_record(self, "strict"), "x": x}


@app.task(bind=True)
@throttled("held")
def held_call(self: Any, x: int) -> dict[str, Any]:
    return {**_record(self, "held"), "x": x}


@app.task
def block(seconds: float) -> float:
    """Occupies a pool child (not throttled): saturates the workers. Counted as it starts."""
    client = redis.Redis.from_url(BROKER)
    client.incr(BLOCKS)
    client.close()
    time.sleep(seconds)
    return seconds
