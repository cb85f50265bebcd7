"""The Celery app of tests/system/test_tenants.py and bench/tenants.py: one task under a
per-tenant limit and a limit shared by every tenant, run by real ``celery worker``
subprocesses. The limits file comes from ``THROTTLE_CONFIG``; broker, result backend and
limiter are the caller's private redis-server (``TENANTS_BROKER_URL``); the calls go to the
mock API at ``MOCK_API_URL`` when set.
"""

from __future__ import annotations

import os
import time
import urllib.error
import urllib.request
from typing import Any

import redis
from celery import Celery

from throttle.celery import install, throttled
from throttle.redis.keys import KeySpace
from workers.harness import WORKER_SETTINGS

BROKER = os.environ.get("TENANTS_BROKER_URL", "redis://127.0.0.1:6379/15")
API_URL = os.environ.get("MOCK_API_URL", "")

app = Celery("tenants", broker=BROKER, backend=BROKER)
app.conf.update(WORKER_SETTINGS, throttle_config=os.environ.get("THROTTLE_CONFIG"))
if os.environ.get("TENANTS_MAX_CONNECTIONS"):
    # kombu's Redis transport keeps 10 connections per worker by default: a gevent or
    # threads worker of more than that fails its acks (bench/tenants.py --pools).
    app.conf.broker_transport_options = {
        "max_connections": int(os.environ["TENANTS_MAX_CONNECTIONS"])
    }
install(app)
_KEYS = KeySpace()


@app.task(bind=True, max_retries=0)
@throttled("tenant", "shared")
def call(self: Any, tenant: str, n: int) -> dict[str, Any]:
    """One call of ``tenant`` under its own limit and the shared one."""
    return _body(self, tenant, n)


@app.task(bind=True, max_retries=0)
@throttled("tenant", "shared", max_wait=5)
def hurried(self: Any, tenant: str, n: int) -> dict[str, Any]:
    """As ``call``, but given up (ThrottleTimeout) when it cannot run within 5 s."""
    return _body(self, tenant, n)


@app.task(bind=True, max_retries=0)
@throttled("shared")
def solo(self: Any, n: int) -> dict[str, Any]:
    """A call under the shared limit alone (the single-limit baseline)."""
    return _body(self, "solo", n)


def _body(task: Any, tenant: str, n: int) -> dict[str, Any]:
    """The call: its slot (Redis time, from its lease record), when the body started (this
    host's clock, epoch s), how many times it ran, the API's status (0: no API)."""
    at = time.time()
    client = redis.Redis.from_url(BROKER)
    key = f"test:runs:{task.request.id}"
    pipe = client.pipeline(transaction=False)
    pipe.incr(key).expire(key, 600).hget(_KEYS.lease_key(task.request.id), "at")
    runs, _, slot_us = pipe.execute()
    client.close()
    status = 0
    if API_URL:
        request = urllib.request.Request(
            f"{API_URL}/call", method="POST", headers={"X-Task-Id": task.request.id}
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                status = response.status
        except urllib.error.HTTPError as exc:
            status = exc.code
    headers = task.request.headers or {}
    return {
        "tenant": tenant, "n": n, "id": task.request.id, "runs": runs, "at": at,
        "slot": None if slot_us is None else float(slot_us) / 1e6, "status": status,
        "deferrals": headers.get("throttle_deferrals", 0),
        "planned": headers.get("throttle_planned", 0),
    }  # fmt: skip
