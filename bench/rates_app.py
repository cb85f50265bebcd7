"""The Celery app of ``bench/rates.py``: one API call per task, plain or throttled.

Run by ``celery -A bench.rates_app worker -P POOL``. Broker and limiter: the benchmark's
private redis-server (``RATES_BROKER_URL``); the API: ``MOCK_API_URL``. The settings are
the demo's (``workers.harness.WORKER_SETTINGS``: late acks, one prefetched task per pool
slot), results ignored, and kombu's Redis transport allowed ``RATES_CONNECTIONS``
connections (its default of 10 is fewer than a large gevent or threads pool acks with).

Each task makes one ``requests`` call on a kept-alive session taken from a pool of idle
ones (made on demand, one per call in flight at most). Not a session per thread
(``threading.local``): the gevent pool runs every task in a new greenlet, and gevent's
``local`` is per greenlet, so that would open a new connection per call, and leave the
old one open until the session is collected. ``plain`` is not throttled: the pool's own
ceiling, measured in the same invocation; ``limited_100`` and ``limited_500`` are
throttled by a GCRA limit of 100/s and 500/s (:data:`LIMITS`).
"""

from __future__ import annotations

import os
import queue
from typing import Any

import requests
from celery import Celery

from throttle.celery import install, throttled
from workers.harness import WORKER_SETTINGS

BROKER = os.environ.get("RATES_BROKER_URL", "redis://127.0.0.1:6379/0")
API_URL = os.environ.get("MOCK_API_URL", "")

LIMITS = {100: 5, 500: 25}
"""Each limit's rate per s and its burst (a twentieth of a second's worth: the API allows
a tenth, so a call may reach it up to about 50 ms off its slot without a refusal)."""

app = Celery("rates", broker=BROKER)
app.conf.update(
    WORKER_SETTINGS,
    task_ignore_result=True,
    broker_transport_options={"max_connections": int(os.environ.get("RATES_CONNECTIONS", "20"))},
    throttle_config={
        "limits": {
            f"api-{rate}": {"algorithm": "gcra", "rate": f"{rate}/s", "burst": burst}
            for rate, burst in LIMITS.items()
        }
    },
)
install(app)

_idle: queue.SimpleQueue[requests.Session] = queue.SimpleQueue()
"""Sessions no call is using (per process: made after the fork)."""


def _call(task_id: str) -> int:
    """One POST to the API on an idle kept-alive session; the HTTP status."""
    try:
        session = _idle.get_nowait()
    except queue.Empty:
        session = requests.Session()
    try:
        response = session.post(f"{API_URL}/call", headers={"X-Task-Id": task_id}, timeout=30)
    except requests.RequestException:
        session.close()
        raise
    _idle.put(session)
    return response.status_code


@app.task(bind=True)
def plain(self: Any, n: int) -> int:
    """Not throttled: the pool's own ceiling."""
    return _call(self.request.id)


@app.task(bind=True)
@throttled("api-100")
def limited_100(self: Any, n: int) -> int:
    """Throttled at 100/s."""
    return _call(self.request.id)


@app.task(bind=True)
@throttled("api-500")
def limited_500(self: Any, n: int) -> int:
    """Throttled at 500/s."""
    return _call(self.request.id)
