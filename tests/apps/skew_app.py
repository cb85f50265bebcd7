"""The Celery app of the clock-skew tests (tests/system/test_skew.py), run by workers whose
wall clocks are off. Broker, result backend and limiter: the test's private redis-server
(``DEMO_BROKER_URL``; a RabbitMQ broker with ``DEMO_BACKEND_URL`` and
``THROTTLE_REDIS_URL`` naming the Redis, as bench/skew.py runs it); limits file:
``THROTTLE_CONFIG``; the mock API: ``MOCK_API_URL``.
"""

from __future__ import annotations

import http.client
import os
from typing import Any
from urllib.parse import urlsplit

import redis
from celery import Celery

from throttle.celery import ThrottledTask, install
from throttle.celery.message import deadline_header
from throttle.redis.keys import KeySpace

BROKER = os.environ.get("DEMO_BROKER_URL", "redis://127.0.0.1:6379/15")
BACKEND = os.environ.get("DEMO_BACKEND_URL", BROKER)
LIMITER = os.environ.get("THROTTLE_REDIS_URL", BACKEND)

app = Celery("skew", broker=BROKER, backend=BACKEND, task_cls=ThrottledTask)
app.conf.update(
    throttle_config=os.environ.get("THROTTLE_CONFIG"),
    task_default_queue="upstream",
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
)
install(app)
_KEYS = KeySpace()


def _post(task_id: str) -> int:
    """One call of the mock API (workers/demo_app.py is not imported: its shared tasks
    name limits this app's file does not have)."""
    url = urlsplit(os.environ["MOCK_API_URL"])
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=10)
    try:
        conn.request("POST", "/call", body=b"", headers={"X-Task-Id": task_id})
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


@app.task(bind=True)
def call(self: Any, n: int) -> dict[str, Any]:
    """One call of the mock API; reports the slot the limiter granted (its lease record)
    and when the body started, both on the Redis clock, and the task's headers."""
    client = redis.Redis.from_url(LIMITER)
    pipe = client.pipeline(transaction=False)
    pipe.time().hget(_KEYS.lease_key(self.request.id), "at").incr(f"test:runs:{self.request.id}")
    (seconds, micros), slot_us, runs = pipe.execute()
    client.close()
    status = _post(self.request.id)
    headers = self.request.headers or {}
    return {
        "n": n,
        "id": self.request.id,
        "status": status,
        "runs": runs,
        "started": seconds + micros / 1e6,
        "slot": None if slot_us is None else float(slot_us) / 1e6,
        # [deadline, retries] as the throttler writes it: the deadline, as the gate reads it
        "deadline": deadline_header(headers, self.request.retries or 0),
        "deferrals": headers.get("throttle_deferrals", 0),
        "worker": self.request.hostname,
    }
