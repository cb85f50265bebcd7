"""The Celery app of ``bench/fair.py``: three tenants calling one shared upstream.

Run by ``celery -A bench.fair_app worker -Q upstream``; its broker, result backend and
limiter are the Redis at ``DEMO_BROKER_URL`` (the benchmark's private redis-server), the
upstream the mock API at ``MOCK_API_URL``. The worker settings are the demo app's
(``workers.harness.WORKER_SETTINGS``). One task per variant, each throttled by one limit of
19.6/s burst 1 (2 % under the mock API's 20/s, as ``configs/demo.yaml``):

* ``fair_call``: ``fair: true`` over ``{tenant}``, every tenant of weight 1;
* ``weighted_call``: the same with ``weights: {a: 2}``;
* ``fcfs_call``: today's shared limit, one state for every tenant (first come first served);
* ``unguarded_call``: as ``fair_call`` with ``spacing_guard: false`` (the guard is on by
  default at burst 1; the mock API allows burst 2).
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
RATE = "19.6/s"
SHARED = {"algorithm": "gcra", "rate": RATE, "burst": 1}

app = Celery("fair", broker=BROKER, backend=BROKER)
app.conf.update(
    WORKER_SETTINGS,
    task_ignore_result=True,
    throttle_config={
        "limits": {
            "fair": {**SHARED, "key": "{tenant}", "fair": True},
            "weighted": {**SHARED, "key": "{tenant}", "fair": True, "weights": {"a": 2}},
            "fcfs": SHARED,
            "unguarded": {**SHARED, "key": "{tenant}", "fair": True, "spacing_guard": False},
        },
    },
)
install(app)
_local = threading.local()


def _post(task_id: str) -> int:
    """POST /call to the mock API on a kept-alive connection; returns the HTTP status. (Not
    workers.demo_app's: importing that app would declare its limits in this worker.)"""
    conn = getattr(_local, "conn", None)
    if conn is None:
        url = urlsplit(os.environ.get("MOCK_API_URL", "http://127.0.0.1:8080"))
        conn = _local.conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    try:
        conn.request("POST", "/call", body=b"", headers={"X-Task-Id": task_id})
        response = conn.getresponse()
        response.read()
    except (OSError, http.client.HTTPException):
        _local.conn = None
        conn.close()
        raise
    return response.status


@app.task(bind=True)
@throttled("fair")
def fair_call(self: Any, tenant: str, n: int) -> int:
    return _post(self.request.id)


@app.task(bind=True)
@throttled("weighted")
def weighted_call(self: Any, tenant: str, n: int) -> int:
    return _post(self.request.id)


@app.task(bind=True)
@throttled("fcfs")
def fcfs_call(self: Any, tenant: str, n: int) -> int:
    return _post(self.request.id)


@app.task(bind=True)
@throttled("unguarded")
def unguarded_call(self: Any, tenant: str, n: int) -> int:
    return _post(self.request.id)
