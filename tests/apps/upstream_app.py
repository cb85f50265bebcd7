"""The Celery app of tests/integration/test_upstream.py's fleet, run by a real ``celery worker``.

Its tasks call the mock API (``MOCK_API_URL``) through requests or httpx with
:func:`throttle.upstream.upstream_hook` installed (``retry=True``): a 429 holds the limit
fleet-wide, a slower stated policy lowers its rate, and the refused task runs again after
the hold. The limits file is written by the test (``THROTTLE_CONFIG``); broker, result
backend and limiter are the test's private redis-server (``UPSTREAM_BROKER_URL``).
"""

from __future__ import annotations

import os
from typing import Any

import httpx
import redis
import requests
from celery import Celery

from throttle.celery import install, throttled
from throttle.upstream import upstream_hook
from workers.harness import WORKER_SETTINGS

BROKER = os.environ.get("UPSTREAM_BROKER_URL", "redis://127.0.0.1:6379/15")
API_URL = os.environ.get("MOCK_API_URL", "http://127.0.0.1:8080")

app = Celery("upstream_tests", broker=BROKER, backend=BROKER)
app.conf.update(WORKER_SETTINGS, throttle_config=os.environ.get("THROTTLE_CONFIG"))
install(app)

# One client per pool child, made on first use (after the fork: no socket is shared).
_clients: dict[str, Any] = {}


def _session() -> requests.Session:
    session: requests.Session | None = _clients.get("requests")
    if session is None:
        session = _clients["requests"] = requests.Session()
        session.hooks["response"].append(upstream_hook(retry=True))
    return session


def _httpx() -> httpx.Client:
    client: httpx.Client | None = _clients.get("httpx")
    if client is None:
        client = _clients["httpx"] = httpx.Client(
            event_hooks={"response": [upstream_hook(retry=True)]}, timeout=10
        )
    return client


def _run(task: Any) -> int:
    """Count this execution of the task's body in Redis (a refused call runs it again)."""
    client: redis.Redis = _clients.get("redis") or _clients.setdefault(
        "redis", redis.Redis.from_url(BROKER)
    )
    key = f"test:runs:{task.request.id}"
    runs = int(client.incr(key))
    client.expire(key, 600)
    return runs


def _result(task: Any, n: int, status: int) -> dict[str, Any]:
    headers = task.request.headers or {}
    return {
        "n": n, "id": task.request.id, "status": status, "retries": task.request.retries,
        "deferrals": headers.get("throttle_deferrals", 0),
        # The queue the worker consumed it from (a deferred copy: the lane), as it resolved
        # it; the routing key the task sees is the one its producer sent it with.
        "queue": (task.request.delivery_info or {}).get("queue"),
        "runs": int(_clients["redis"].get(f"test:runs:{task.request.id}") or 0),
    }  # fmt: skip


@app.task(bind=True, max_retries=0)
@throttled("api")
def fetch(self: Any, n: int) -> dict[str, Any]:
    """One call through requests: a 429 never returns here, the task runs again later."""
    _run(self)
    response = _session().post(
        f"{API_URL}/call", headers={"X-Task-Id": self.request.id}, timeout=10
    )
    return _result(self, n, response.status_code)


@app.task(bind=True, max_retries=0)
@throttled("solo")
def fetch_httpx(self: Any, n: int) -> dict[str, Any]:
    """The same through httpx."""
    _run(self)
    response = _httpx().post(f"{API_URL}/call", headers={"X-Task-Id": self.request.id})
    return _result(self, n, response.status_code)


@app.task(bind=True, max_retries=0)
@throttled("hurry")
def fetch_keyed(self: Any, account: str, n: int) -> dict[str, Any]:
    """A keyed limit with a max_wait: a refusal holds this account only, and a hold longer
    than the task may still wait ends it with ThrottleTimeout."""
    _run(self)
    response = _session().post(
        f"{API_URL}/call", headers={"X-Task-Id": self.request.id}, timeout=10
    )
    return _result(self, n, response.status_code)


@app.task(bind=True, max_retries=0)
@throttled("learn")
def fetch_adaptive(self: Any, n: int) -> dict[str, Any]:
    """An adaptive limit: the API's 429s (Retry-After only) teach the fleet its rate."""
    _run(self)
    response = _session().post(
        f"{API_URL}/call", headers={"X-Task-Id": self.request.id}, timeout=10
    )
    return _result(self, n, response.status_code)


@app.task(bind=True, max_retries=0)
@throttled("watch")
def fetch_shadow(self: Any, n: int) -> dict[str, Any]:
    """A limit in shadow mode: it delays nothing, and a 429 still sends the task back for
    after the API's time, as enforced."""
    _run(self)
    response = _session().post(
        f"{API_URL}/call", headers={"X-Task-Id": self.request.id}, timeout=10
    )
    return _result(self, n, response.status_code)
