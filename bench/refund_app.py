"""The Celery app of ``bench/refund.py``: LLM-style calls that reserve an estimate and
report their usage.

Run by ``celery -A bench.refund_app worker``. Broker and limiter: the benchmark's private
redis-server (``REFUND_BROKER_URL``); the mock OpenAI provider: ``MOCK_PROVIDER_URL``. The
settings are the demo's (``workers.harness.WORKER_SETTINGS``), results ignored, the
throttler's default settings otherwise.

Each task posts one chat completion on a kept-alive connection (``http.client``: the
provider mock is what is measured, not an SDK's CPU) and reports the reply's
``usage.total_tokens`` with :func:`throttle.celery.report_cost`. Two tasks, one limit
each (:data:`RATE`, :data:`BURST`):

* ``estimated``: reserves ``estimate`` (prompt + ``max_tokens``), about twice what it
  reports: the refund case;
* ``exact``: reserves ``usage``, what it will report (a caller that knew the usage in
  advance): the reference for the same fleet without refunds.

A call the provider refuses (429) reports 0 (the provider charged nothing) and counts in
the provider's arrivals.
"""

from __future__ import annotations

import http.client
import json
import os
import threading
from typing import Any
from urllib.parse import urlsplit

from celery import Celery

from throttle.celery import install, report_cost, throttled
from workers.harness import WORKER_SETTINGS

BROKER = os.environ.get("REFUND_BROKER_URL", "redis://127.0.0.1:6379/0")
URL = os.environ.get("MOCK_PROVIDER_URL", "http://127.0.0.1:8080")
RATE, BURST = 2000, 4000
"""The token limit: tokens per s, and the bucket's size in tokens."""

app = Celery("refund", broker=BROKER)
app.conf.update(
    WORKER_SETTINGS,
    task_ignore_result=True,
    throttle_config={
        "limits": {
            "tokens": {"rate": f"{RATE}/s", "burst": BURST, "cost": "estimate"},
            "tokens-exact": {"rate": f"{RATE}/s", "burst": BURST, "cost": "usage"},
        }
    },
)
install(app)

_local = threading.local()


def _complete(task_id: str, prompt: str, max_tokens: int) -> int:
    """One chat completion; the tokens it used (0 when refused)."""
    url = urlsplit(URL)
    conn = getattr(_local, "conn", None)
    if conn is None:
        conn = _local.conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    body = json.dumps({"model": "mock", "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": prompt}]})  # fmt: skip
    try:
        headers = {"Content-Type": "application/json", "X-Task-Id": task_id}
        conn.request("POST", "/v1/chat/completions", body=body, headers=headers)
        response = conn.getresponse()
        reply = json.loads(response.read())
    except (OSError, http.client.HTTPException):
        conn.close()
        _local.conn = None
        raise
    if response.status != 200:
        return 0
    return int(reply["usage"]["total_tokens"])


@app.task(bind=True)
@throttled("tokens")
def estimated(self: Any, prompt: str, max_tokens: int, estimate: int) -> int:
    """Reserves ``estimate`` tokens, reports the usage."""
    used = _complete(self.request.id, prompt, max_tokens)
    report_cost(used)
    return used


@app.task(bind=True)
@throttled("tokens-exact")
def exact(self: Any, prompt: str, max_tokens: int, usage: int) -> int:
    """Reserves ``usage`` tokens, what it will report."""
    used = _complete(self.request.id, prompt, max_tokens)
    report_cost(used)
    return used
