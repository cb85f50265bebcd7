"""The Celery app of ``bench/plans.py``: three tenants on three plans of one limit.

Run by ``celery -A bench.plans_app worker -Q upstream``; broker, result backend and limiter
are the Redis at ``DEMO_BROKER_URL``, the upstream the mock API at ``MOCK_API_URL`` (which
enforces each tenant's plan, ``X-Tenant``). ``PLANS_MODE`` (``enforce`` or ``shadow``) is
the limits' ``settings.mode``; ``PLANS_RATES`` the plan table as ``free=4,pro=16,...``;
``PLANS_LATE_TOLERANCE`` (a diagnosis only) the ``settings.late_tolerance``.

* ``plan_call(tenant, plan, n)``: throttled by ``api`` (GCRA, key ``{tenant}``, plan
  ``{plan}``);
* ``plain_call(tenant, plan, n)``: the same call, not throttled (the control).
"""

from __future__ import annotations

import http.client
import os
import threading
from typing import Any
from urllib.parse import urlsplit

from celery import Celery

from throttle.celery import install, throttled
from workers.harness import WORKER_SETTINGS

BROKER = os.environ.get("DEMO_BROKER_URL", "redis://127.0.0.1:6379/0")
PLANS = {
    name: float(rate)
    for name, rate in (
        item.split("=")
        for item in os.environ.get("PLANS_RATES", "free=4,pro=16,enterprise=40").split(",")
    )
}
BURST_S = 0.5
"""Each plan's burst: half a second of its rate."""


def plan_spec(rate: float) -> str:
    return f"{rate:g}/s burst {max(rate * BURST_S, 1):g}"


app = Celery("plans", broker=BROKER, backend=BROKER)
app.conf.update(
    WORKER_SETTINGS,
    task_ignore_result=True,
    throttle_config={
        "settings": {
            "mode": os.environ.get("PLANS_MODE", "enforce"),
            # a diagnosis only (bench.plans --late-tolerance): the library's default otherwise
            **({"late_tolerance": os.environ["PLANS_LATE_TOLERANCE"]}
               if os.environ.get("PLANS_LATE_TOLERANCE") else {}),
        },
        "limits": {
            "api": {
                "algorithm": "gcra", "rate": "1/s", "key": "{tenant}", "plan": "{plan}",
                "plans": {name: plan_spec(rate) for name, rate in PLANS.items()},
            },
        },
    },
)  # fmt: skip
install(app)
_local = threading.local()


def _post(task_id: str, tenant: str) -> int:
    """POST /call to the mock API on a kept-alive connection, as ``tenant``."""
    conn = getattr(_local, "conn", None)
    if conn is None:
        url = urlsplit(os.environ.get("MOCK_API_URL", "http://127.0.0.1:8080"))
        conn = _local.conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    try:
        conn.request("POST", "/call", body=b"", headers={"X-Task-Id": task_id, "X-Tenant": tenant})
        response = conn.getresponse()
        response.read()
    except (OSError, http.client.HTTPException):
        _local.conn = None
        conn.close()
        raise
    return response.status


@app.task(bind=True)
@throttled("api")
def plan_call(self: Any, tenant: str, plan: str, n: int) -> int:
    return _post(self.request.id, tenant)


@app.task(bind=True)
def plain_call(self: Any, tenant: str, plan: str, n: int) -> int:
    return _post(self.request.id, tenant)
