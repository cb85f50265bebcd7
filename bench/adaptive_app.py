"""The Celery app of bench/adaptive.py, run by real ``celery worker`` processes of this tree
or of an older revision (bench/checkout.py copies this file into it).

Its one task calls the mock API (``MOCK_API_URL``) through a ``requests`` session with the
README's ``upstream_hook(retry=True)``: a refused call re-runs the task after the
upstream's time. The task is throttled by the limits of its queue (``THROTTLE_CONFIG``).
Each served call counts one in ``bench:done`` (the benchmark's feeder keeps a bounded
number of tasks outstanding). Broker, result backend and limiter: the benchmark's private
redis-server (``DEMO_BROKER_URL``).
"""

from __future__ import annotations

import os
from typing import Any

import redis
import requests
from celery import Celery

from throttle.celery import ThrottledTask, install
from throttle.upstream import upstream_hook

BROKER = os.environ.get("DEMO_BROKER_URL", "redis://127.0.0.1:6379/15")
API_URL = os.environ.get("MOCK_API_URL", "http://127.0.0.1:8080")

app = Celery("adaptive", broker=BROKER, backend=BROKER, task_cls=ThrottledTask)
app.conf.update(
    throttle_config=os.environ.get("THROTTLE_CONFIG"),
    task_default_queue="upstream",
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    task_ignore_result=True,
)
install(app)

# One session and one Redis client per pool child, made on first use (after the fork).
_clients: dict[str, Any] = {}


def _session() -> requests.Session:
    session: requests.Session | None = _clients.get("session")
    if session is None:
        session = _clients["session"] = requests.Session()
        session.hooks["response"].append(upstream_hook(retry=True))
    return session


@app.task(bind=True)
def call(self: Any, n: int) -> int:
    """One call of the mock API; a 429 never returns here (the task comes back later)."""
    response = _session().post(
        f"{API_URL}/call", headers={"X-Task-Id": self.request.id}, timeout=10
    )
    client: redis.Redis = _clients.get("redis") or _clients.setdefault(
        "redis", redis.Redis.from_url(BROKER)
    )
    client.incr("bench:done")
    return int(response.status_code)
