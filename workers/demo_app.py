"""The demo Celery app: tasks that call the rate-capped mock API through the throttler.

Run a worker with ``celery -A workers.demo_app worker -Q upstream``. Settings come from
the environment, so that ``make demo``, the tests, the benchmark and docker-compose start
the same app:

* ``DEMO_BROKER_URL``: broker and result backend (default ``redis://127.0.0.1:6379/0``);
* ``THROTTLE_REDIS_URL``: the limiter's Redis (default: the broker);
* ``THROTTLE_CONFIG``: the limits file (default ``configs/demo.yaml``);
* ``MOCK_API_URL``: the mock API (default ``http://127.0.0.1:8080``).

Every task of queue ``upstream`` is throttled by the file's ``queues:`` mapping (the app's
task class is :class:`throttle.celery.ThrottledTask`); ``complete`` adds a per-tenant token
budget with ``@throttled``.
"""

from __future__ import annotations

import http.client
import os
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

from celery import Celery

from throttle.celery import ThrottledTask, install, report_cost, slot_time, throttled
from workers.harness import WORKER_SETTINGS

BROKER = os.environ.get("DEMO_BROKER_URL", "redis://127.0.0.1:6379/0")
CONFIG = os.environ.get(
    "THROTTLE_CONFIG", str(Path(__file__).resolve().parent.parent / "configs" / "demo.yaml")
)

app = Celery("demo", broker=BROKER, backend=BROKER, task_cls=ThrottledTask)
app.conf.update(WORKER_SETTINGS, throttle_config=CONFIG)
install(app)

_local = threading.local()


def _post(path: str, task_id: str | None) -> int:
    """POST to the mock API on a kept-alive connection; returns the HTTP status."""
    url = urlsplit(os.environ.get("MOCK_API_URL", "http://127.0.0.1:8080"))
    conn = getattr(_local, "conn", None)
    for attempt in (1, 2):
        if conn is None:
            conn = _local.conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
        try:
            conn.request("POST", path, body=b"", headers={"X-Task-Id": task_id or ""})
            response = conn.getresponse()
            response.read()
            return response.status
        except (OSError, http.client.HTTPException):
            conn.close()
            conn = _local.conn = None
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


@app.task(bind=True)
def call_api(self, n: int) -> dict[str, object]:
    """One call to the upstream (throttled by queue ``upstream``'s limits)."""
    late_s = _late()
    status = _post("/call", self.request.id)
    return {
        "n": n, "status": status, "id": self.request.id, "deferrals": _deferrals(self),
        "late_s": late_s, "slot": slot_time(),
    }  # fmt: skip


@app.task(bind=True)
@throttled("tokens")
def complete(self, tenant: str, max_tokens: int, used: int) -> dict[str, object]:
    """An LLM-style call: reserves ``max_tokens`` of the tenant's budget, uses ``used``."""
    status = _post("/call", self.request.id)
    report_cost(used)
    return {"tenant": tenant, "status": status, "used": used, "deferrals": _deferrals(self)}


def _late() -> float | None:
    """How late this call is behind the slot the throttler gave it, in s."""
    slot = slot_time()
    return None if slot is None else time.time() - slot


def _deferrals(task: object) -> int:
    """How many times throttling re-published this task (its header, for the statistics)."""
    headers = getattr(task, "request").headers or {}  # noqa: B009
    value = headers.get("throttle_deferrals", 0)
    return value if isinstance(value, int) else 0
