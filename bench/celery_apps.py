"""The two baselines of ``bench/celery_fleet.py``: a Celery app without the throttler.

Run by ``celery -A bench.celery_apps worker -Q upstream``; settings come from the same
environment variables as ``workers/demo_app.py`` (``DEMO_BROKER_URL``: broker, result backend
and the naive recipe's counters; ``MOCK_API_URL``: the mock API), and the app has the same
worker settings (late acks, prefetch 1), so that only the way of limiting differs.

* ``rate_limited_call``: Celery's built-in ``rate_limit="20/s"``. It is enforced by each
  worker on its own (a token bucket in the worker's consumer), so a fleet of two workers
  sends up to twice the rate.
* ``naive_call``: the recipe found in many blog posts and answers: a fixed one-second window
  counted in Redis, checked with GET and then bumped with INCR + EXPIRE (two round trips, not
  atomic: concurrent children read the same count), and ``self.retry(countdown=1)`` when the
  window is full, with ``max_retries=None``.

Each calls the mock API once per execution and returns what it saw.
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import Celery

from workers.demo_app import _post
from workers.harness import WORKER_SETTINGS

BROKER = os.environ.get("DEMO_BROKER_URL", "redis://127.0.0.1:6379/0")
LIMIT_PER_S = 20

app = Celery("bench", broker=BROKER, backend=BROKER)
app.conf.update(WORKER_SETTINGS)

_clients: dict[int, redis.Redis] = {}


def _redis() -> redis.Redis:
    """One client per process (a pool child builds its own after the fork)."""
    client = _clients.get(os.getpid())
    if client is None:
        client = _clients[os.getpid()] = redis.Redis.from_url(BROKER)
    return client


def _result(task: Any, n: int, status: int) -> dict[str, Any]:
    return {"n": n, "status": status, "id": task.request.id, "retries": task.request.retries}


@app.task(bind=True, rate_limit=f"{LIMIT_PER_S}/s")
def rate_limited_call(self: Any, n: int) -> dict[str, Any]:
    """One call to the upstream, under Celery's per-worker ``rate_limit``."""
    return _result(self, n, _post("/call", self.request.id))


@app.task(bind=True, max_retries=None)
def naive_call(self: Any, n: int) -> dict[str, Any]:
    """One call to the upstream, under a non-atomic fixed window of 20 per second."""
    client = _redis()
    key = f"naive:{int(time.time())}"
    count = int(client.get(key) or 0)
    if count >= LIMIT_PER_S:
        raise self.retry(countdown=1)
    client.incr(key)
    client.expire(key, 2)
    return _result(self, n, _post("/call", self.request.id))
